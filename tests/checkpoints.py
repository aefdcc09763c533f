"""Tiny random checkpoints of each supported architecture, written with transformers' own
save_pretrained (so the files are what a user would download), plus a small BPE tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
CORPUS = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step. "
          "To be, or not to be, that is the question. All happy families are alike; every unhappy family is "
          "unhappy in its own way. It was the best of times, it was the worst of times. ") * 4

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=1)

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<|bos|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


def make_config(arch: str):
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                rope_theta=10000.0, **COMMON)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **COMMON)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 head_dim=16, norm_topk_prob=True, **COMMON)
    if arch == "olmoe":
        return tf.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                              clip_qkv=5.0, **COMMON)
    if arch in ("deepseek_v2", "deepseek_v3"):
        return make_deepseek_config(arch)
    raise ValueError(arch)


# multi-head latent attention's architectures: not in ARCHS (the cross-architecture tests), tested on
# their own (tests/test_deepseek.py); a dense first layer, one shared expert
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")


def make_deepseek_config(arch: str, **overrides):
    import transformers as tf

    common = {**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}
    mla = dict(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1)
    if arch == "deepseek_v2":
        cfg = tf.DeepseekV2Config(topk_method="greedy", routed_scaling_factor=1.0, **mla, **common)
    else:
        cfg = tf.DeepseekV3Config(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  **mla, **common)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_deepseek_checkpoint(arch: str, out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random DeepSeek-V2/V3 (overrides: config fields), V3's selection bias drawn at random
    (transformers starts it at zero, which would leave the bias untested)."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(make_deepseek_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


def build_checkpoint(arch: str, out: Path, seed: int = 0, **overrides) -> Path:
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = make_config(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


def load_hf(path: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_batch_matches_alone(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Generate prompts as one batch and each alone: same tokens, and every page back in the pool.
    Returns the batch's token ids."""
    def ids(outs):
        return [o.outputs[0].token_ids for o in outs]

    batched = ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    alone = [ids(llm.generate([{"prompt_token_ids": p}], params))[0] for p in prompts]
    assert batched == alone
    return batched
