"""moekv against transformers on the same checkpoint: logits and greedy generation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moekv import LLM, SamplingParams
from tests.checkpoints import ARCHS, load_hf

PROMPTS = [
    [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14],  # crosses a page boundary
    [9, 8, 7],
    [250, 3, 3, 3, 3, 3, 31, 64, 128, 256, 17, 71, 72, 73, 74, 75],  # exactly one page of 16
]


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, checkpoints):
    path = checkpoints[request.param]
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None  # compare fixed-length continuations
    # a small token budget forces chunked prefill of the longest prompt
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    return request.param, hf, llm


def test_logits_match_transformers(arch_pair):
    """Prompt logits through the paged cache (chunked prefill included) equal transformers' to 1e-4."""
    _, hf, llm = arch_pair
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
def test_greedy_generation_matches_transformers(arch_pair):
    """32 greedy tokens per prompt, in one batch, equal transformers.generate token for token."""
    _, hf, llm = arch_pair
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert out.outputs[0].finish_reason == "length"


def test_text_prompts_match_transformers_tokenization(checkpoints):
    """A string prompt is tokenized as transformers' tokenizer does and continues identically."""
    from transformers import AutoTokenizer

    path = checkpoints["mixtral"]
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32", max_model_len=128)
    text = "It was the best of times, it was"
    out = llm.generate(text, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok(text)["input_ids"]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


MODELS = Path(__file__).resolve().parent.parent / "models"
DOMAIN_MOE = MODELS / "domain-moe"
DOMAIN_MLA = MODELS / "domain-mla"
HELDOUT = DOMAIN_MOE / "heldout"  # domain-mla shares domain-moe's tokenizer and held-out texts


def shipped_pair(model_dir: Path, max_model_len: int, max_num_batched_tokens: int):
    """A shipped model in float32, in transformers and in moekv (a small token budget: chunked prefill)."""
    hf = load_hf(model_dir)
    hf.generation_config.eos_token_id = None
    llm = LLM(str(model_dir), dtype="float32", max_model_len=max_model_len,
              max_num_batched_tokens=max_num_batched_tokens)
    return hf, llm


def heldout_prompts(llm, lengths: dict[str, int]) -> list[list[int]]:
    """The first n tokens of each named held-out text."""
    texts = {name: (HELDOUT / f"{name}.txt").read_text(encoding="utf-8")[: 8 * n] for name, n in lengths.items()}
    prompts = [llm.tokenizer.encode(texts[name], add_special_tokens=False)[:n] for name, n in lengths.items()]
    assert [len(p) for p in prompts] == list(lengths.values())
    return prompts


def assert_matches_transformers(hf, llm, prompts: list[list[int]], atol: float, max_tokens: int = 16) -> None:
    """The prompts' logits within atol of transformers' and max_tokens greedy tokens equal to its generate."""
    vocab = hf.config.vocab_size
    ours = llm.score([{"prompt_token_ids": p} for p in prompts])
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape == (len(prompt), vocab)
        assert (logits - ref).abs().max().item() < atol
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              repetition_penalty=1.0)  # generation_config.json's sampling defaults off: greedy
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
def test_domain_moe_logits_and_greedy_match_transformers():
    """Held-out code and prose prompts (hundreds of tokens, chunked prefill) score and continue as in transformers."""
    hf, llm = shipped_pair(DOMAIN_MOE, max_model_len=1024, max_num_batched_tokens=256)
    assert_matches_transformers(hf, llm, heldout_prompts(llm, {"code": 600, "prose": 333}), atol=1e-3)


def test_domain_mla_logits_and_greedy_match_transformers():
    """The shipped DeepSeek-V3 model (MLA, group-limited routing with its selection bias, float32 routers):
    held-out prompts scored in chunks (expanded form) and continued greedily (absorbed form) across a
    latent-cache page boundary, as transformers' DeepseekV3ForCausalLM does."""
    assert json.loads((DOMAIN_MLA / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    hf, llm = shipped_pair(DOMAIN_MLA, max_model_len=512, max_num_batched_tokens=64)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert_matches_transformers(hf, llm, heldout_prompts(llm, {"prose": 180, "code": 100}), atol=1e-4)


def test_domain_mla_info(capsys):
    """`moekv info` on the shipped DeepSeek-V3 model: its parameters, its groups and its latent cache
    (4 layers x (128 latent + 32 rotary) x 2 bytes in bf16)."""
    from moekv.cli import main

    assert main(["info", "--model", str(DOMAIN_MLA)]) == 0
    text = capsys.readouterr().out
    assert "DeepseekV3ForCausalLM" in text
    assert "4,983,552 total" in text
    assert "top-2 of 4 expert groups" in text
    assert "bf16            1,280 bytes/token" in text
