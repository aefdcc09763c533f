"""gpt-oss (GptOssForCausalLM) against transformers on tiny random checkpoints: sinks, sliding
windows crossed (window 8, prompts and generations longer), YaRN RoPE, biased clamped-SwiGLU
experts, the router's logit bias, MXFP4 experts; the unsupported variants' errors."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekv import LLM, SamplingParams
from moekv.kvcache.formats import format_class
from moekv.models.loader import load_model_config
from moekv.models.model_config import UnsupportedModelError
from moekv.models.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from tests.checkpoints import load_hf, make_config, write_tokenizer
from tests.kv_formats import engine_kwargs_for

PROMPTS = [
    [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14],  # crosses the window and a page
    [9, 8, 7],
    [250, 3, 3, 3, 3, 3, 31, 64, 128, 256, 17, 71, 72, 73, 74, 75],  # one page of 16
]
WINDOW = 8


def build_gpt_oss(out: Path, seed: int = 0, mxfp4: bool = False, **overrides) -> Path:
    """A tiny random GptOss saved by transformers, every bias, router bias and sink drawn at N(0, 0.5)
    (transformers' init zeroes the biases) and swiglu_limit 1.0, so the clamps bind. mxfp4: the experts'
    gate_up_proj / down_proj replaced by MXFP4 `_blocks` / `_scales` (quantize_mxfp4) and the model's own
    expert weights set to their dequantized values, so transformers runs what the file holds. Returns
    the folder moekv loads (with mxfp4: `<out>_mxfp4`; `out` keeps transformers' unquantized reference)."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = make_config("gpt_oss")
    cfg.swiglu_limit = 1.0
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.transpose(-1, -2))  # [E, out, in]
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(-1, -2))
    model.save_pretrained(out)
    write_tokenizer(out)
    if mxfp4:  # transformers' reference stays in `out`; the MXFP4 copy beside it
        reference, out = out, out.parent / (out.name + "_mxfp4")
        shutil.copytree(reference, out)
        tensors = load_file(out / "model.safetensors")
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(-1, -2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def gpt_oss_ckpt(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "bf16", seed=1)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4_ckpt(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "mxfp4", seed=2, mxfp4=True)


def hf_model(path: Path):
    """transformers' model of the checkpoint, its experts' clamp set from config.json: transformers
    releases before swiglu_alpha / swiglu_limit became GptOssConfig fields (5.17.0, the GPU image's)
    hard-code 1.702 / 7.0 and ignore the file's values, so our limit of 1.0 would part the reference
    from the checkpoint (0.4 to 1.1 in the logits) on those versions only."""
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None  # fixed-length continuations
    config = json.loads((path / "config.json").read_text())
    for layer in hf.model.layers:
        layer.mlp.experts.alpha = float(config.get("swiglu_alpha", 1.702))
        layer.mlp.experts.limit = float(config.get("swiglu_limit", 7.0))
    return hf


def check_logits(llm, hf, tol=1e-4):
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for i, (prompt, logits) in enumerate(zip(PROMPTS, ours)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        diff = (logits.float().cpu() - ref).abs().max(dim=-1).values  # [positions]
        assert diff.max().item() < tol, f"prompt {i}: max |logits - transformers'| per position {diff.tolist()}"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def greedy_ref(hf, prompt, n):
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ref[0, len(prompt):].tolist()


def test_config_reads_windows_sinks_yarn_and_experts(gpt_oss_ckpt):
    cfg = load_model_config(gpt_oss_ckpt)
    assert cfg.architecture == "GptOssForCausalLM"
    assert cfg.layer_windows == [WINDOW, None, WINDOW]  # transformers' default layer_types
    assert cfg.attention_sinks and cfg.router_logit_bias and cfg.qkv_bias and cfg.o_bias
    assert cfg.yarn is not None and cfg.yarn.factor == 32.0 and not cfg.yarn.truncate
    assert cfg.yarn.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert cfg.clamped_swiglu.limit == 1.0 and cfg.clamped_swiglu.alpha == pytest.approx(1.702)
    assert cfg.top_k == 4 and cfg.num_experts == 8 and cfg.norm_topk_prob


def test_yarn_frequencies_match_transformers(gpt_oss_ckpt):
    """Our YaRN inverse frequencies and cos / sin scale against transformers' rope initialiser,
    truncated and not."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moekv.layers.rotary import yarn_inv_freq
    from moekv.models.gpt_oss import yarn_from

    for truncate in (False, True):
        hf_cfg = tf.AutoConfig.from_pretrained(gpt_oss_ckpt)
        hf_cfg.rope_parameters = {**hf_cfg.rope_parameters, "truncate": truncate}
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        theta, yarn = yarn_from(hf_cfg.to_dict())
        assert yarn.truncate == truncate
        torch.testing.assert_close(yarn_inv_freq(hf_cfg.head_dim, theta, yarn), ref_inv.float(), rtol=1e-6, atol=0)
        assert yarn.attention_factor == pytest.approx(ref_scale)


def test_reference_experts_clamp_as_the_checkpoint_says(gpt_oss_ckpt):
    """transformers' experts (the parity tests' reference) compute what the checkpoint's experts with
    its swiglu_limit (1.0) and swiglu_alpha compute, whichever transformers is installed, on inputs
    the clamps bind on; at gpt-oss's default limit (7.0) the same experts give something else."""
    from moekv.models.loader import load_model
    from moekv.ops.reference import clamped_swiglu_moe_ref

    hf = hf_model(gpt_oss_ckpt)
    ours = load_model(gpt_oss_ckpt, torch.float32, torch.device("cpu"))
    act = load_model_config(gpt_oss_ckpt).clamped_swiglu
    assert act.limit == 1.0
    g = torch.Generator().manual_seed(0)
    x = 4 * torch.randn(6, ours.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(ours.config.num_experts, generator=g)[:4] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 4, generator=g), dim=-1)
    for hf_layer, layer in zip(hf.model.layers, ours.layers):
        m = layer.mlp
        with torch.no_grad():
            theirs = hf_layer.mlp.experts(x, ids, weights)
            want = clamped_swiglu_moe_ref(x, m.w13, m.w13_bias, m.w2, m.w2_bias, weights, ids, act.alpha, act.limit)
            other = clamped_swiglu_moe_ref(x, m.w13, m.w13_bias, m.w2, m.w2_bias, weights, ids, act.alpha, 7.0)
        torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)
        assert (other - want).abs().max().item() > 1e-1


def test_logits_match_transformers(gpt_oss_ckpt):
    """Prompt logits through the paged cache, chunked prefill (12-token budget) across the 8-token
    window, equal transformers' within fp32 tolerance."""
    llm = LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    check_logits(llm, hf_model(gpt_oss_ckpt))


@pytest.mark.parametrize("heads,kv_heads,experts,top_k", [(4, 1, 32, 4), (8, 8, 32, 8)],
                         ids=["mqa-32x4", "mha-32x8"])
def test_odd_shapes_match_transformers(tmp_path, heads, kv_heads, experts, top_k):
    """One KV head and as many KV heads as query heads; 32 experts, top-4 and top-8."""
    path = build_gpt_oss(tmp_path / "odd", seed=5, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         num_local_experts=experts, num_experts_per_tok=top_k)
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    check_logits(llm, hf_model(path))


def test_sinks_windows_and_biases_matter(gpt_oss_ckpt):
    """The parity above is not vacuous: without the sinks, with full attention in the sliding layers,
    or without the expert biases the logits move far beyond its tolerance."""
    llm = LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=128)
    base = llm.score([{"prompt_token_ids": PROMPTS[0]}])[0]
    layers = llm.engine.runner.model.layers
    changes = {"sinks": lambda layer: layer.self_attn.sinks.data.fill_(-1e4),
               "window": lambda layer: setattr(layer.self_attn, "sliding_window", None),
               "expert bias": lambda layer: layer.mlp.w2_bias.data.zero_()}
    for what, change in changes.items():
        saved = {i: (layer.self_attn.sinks.clone(), layer.self_attn.sliding_window, layer.mlp.w2_bias.clone())
                 for i, layer in enumerate(layers)}
        for layer in layers:
            change(layer)
        moved = (llm.score([{"prompt_token_ids": PROMPTS[0]}])[0] - base).abs().max().item()
        assert moved > 1e-2, what
        for i, layer in enumerate(layers):
            layer.self_attn.sinks.data.copy_(saved[i][0])
            layer.self_attn.sliding_window = saved[i][1]
            layer.mlp.w2_bias.data.copy_(saved[i][2])


def test_greedy_generation_matches_transformers(gpt_oss_ckpt):
    """24 greedy tokens per prompt in one batch (decode well past the 8-token window) equal transformers'."""
    hf = hf_model(gpt_oss_ckpt)
    llm = LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == greedy_ref(hf, prompt, 24)


def test_mxfp4_experts_match_transformers(gpt_oss_mxfp4_ckpt):
    """A checkpoint whose experts are MXFP4 blocks / scales loads (dequantized to the model's dtype)
    and scores and generates as transformers does with the dequantized weights."""
    names = load_file(gpt_oss_mxfp4_ckpt / "model.safetensors").keys()
    assert any(n.endswith("gate_up_proj_blocks") for n in names)
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    hf = hf_model(gpt_oss_mxfp4_ckpt.parent / gpt_oss_mxfp4_ckpt.name.removesuffix("_mxfp4"))
    llm = LLM(str(gpt_oss_mxfp4_ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    check_logits(llm, hf)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=12, temperature=0.0,
                                                                          ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy_ref(hf, PROMPTS[0], 12)


def test_mxfp4_experts_kept_quantized(gpt_oss_mxfp4_ckpt):
    """keep_quantized=True (the default on CUDA): the experts load as MXFP4 QuantizedWeights holding the
    checkpoint's bytes, gate and up rows reordered as the dequantizing load reorders them, and each MoE
    layer (its reference path here, the fused kernels on CUDA) computes what the dequantized one does."""
    from moekv.models.loader import load_model
    from moekv.models.quantize import weight_quantization
    from moekv.ops.quantized_weight import QuantizedWeight

    kept = load_model(gpt_oss_mxfp4_ckpt, torch.float32, torch.device("cpu"), keep_quantized=True)
    plain = load_model(gpt_oss_mxfp4_ckpt, torch.float32, torch.device("cpu"))
    assert weight_quantization(kept) == "mxfp4" and weight_quantization(plain) is None
    x = torch.randn(5, kept.layers[0].mlp.w13.shape[2], generator=torch.Generator().manual_seed(0))
    for a, b in zip(kept.layers, plain.layers):
        for name in ("w13", "w2"):
            w = getattr(a.mlp, name)
            assert isinstance(w, QuantizedWeight) and w.method == "mxfp4"
            assert torch.equal(w.dequantize(torch.float32), getattr(b.mlp, name))
        assert torch.allclose(a.mlp(x), b.mlp(x), rtol=1e-5, atol=1e-6)
    # the pair's halves land in one expert tensor: 4 bits a weight and a byte per 32
    w13 = kept.layers[0].mlp.w13
    assert w13.nbytes == w13.shape.numel() // 2 + w13.shape.numel() // 32


def test_mxfp4_missing_half_is_a_clear_error(gpt_oss_mxfp4_ckpt, tmp_path):
    from moekv.models.loader import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(gpt_oss_mxfp4_ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        LLM(str(broken), dtype="float32", max_model_len=64)


def test_dequantize_mxfp4_against_transformers_and_by_hand():
    """Our unpacking against transformers' (an independent implementation) on random bytes, and on
    bytes built by hand: low nibble first, E8M0 scales biased by 127."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 135, (3, 5, 4), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 5, 128]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 5]: transposed
    assert torch.equal(ours, ref.transpose(1, 2))
    by_hand = torch.zeros(1, 1, 16, dtype=torch.uint8)
    by_hand[0, 0, 0] = 0x7 | (0xA << 4)  # codes 7 (6.0) then 10 (-1.0)
    by_hand[0, 0, 1] = 0x1 | (0xF << 4)  # codes 1 (0.5) then 15 (-6.0)
    values = dequantize_mxfp4(by_hand, torch.tensor([[129]], dtype=torch.uint8), torch.bfloat16)[0]
    assert values[:4].tolist() == [24.0, -4.0, 2.0, -24.0] and not values[4:].any()
    assert FP4_VALUES[7] == 6.0 and FP4_VALUES[10] == -1.0


def test_quantize_mxfp4_round_trip():
    """quantize_mxfp4 (the test checkpoints' quantizer) returns the FP4 grid's nearest values: exact on
    weights already on the grid, within half a step elsewhere."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    scale = 2.0 ** torch.randint(-3, 3, (4, 2), generator=g).repeat_interleave(32, dim=1)  # one per group of 32
    on_grid = torch.tensor(FP4_VALUES)[codes] * scale
    on_grid[:, 0] = 6.0 * scale[:, 0]  # every group's largest magnitude sets its scale
    on_grid[:, 32] = -6.0 * scale[:, 32]
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(on_grid), torch.float32), on_grid)
    w = torch.randn(4, 64, generator=g)
    back = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    step = w.reshape(4, 2, 32).abs().amax(-1, keepdim=True) / 6.0 * 2  # the coarsest step of each group
    assert ((back - w).reshape(4, 2, 32).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4", "kivi2", "nuq2", "vq"])
def test_every_kv_format_runs(gpt_oss_ckpt, name):
    """Each compressed KV format serves gpt-oss on the CPU (reference paths with sinks and windows):
    generation runs, every page comes back, and the first greedy token (from the exact prefill)
    equals transformers'."""
    if format_class(name).needs_calibration:
        pytest.skip(f"{name} needs calibrated tables for the model (moekv calibrate), which a random model has not")
    hf = hf_model(gpt_oss_ckpt)
    llm = LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=128, **engine_kwargs_for(name))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == 20
        assert out.outputs[0].token_ids[0] == greedy_ref(hf, prompt, 1)[0]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_tiered_refuses_sliding_window_layers(gpt_oss_ckpt):
    """tiered's ranking keeps only a sequence's first and newest full pages for sure, so it refuses
    the sliding layers rather than demote a page their window still reads."""
    with pytest.raises(ValueError, match="kv_cache_dtype='tiered' does not serve sliding-window attention layers"):
        LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=128, **engine_kwargs_for("tiered"))


def test_unsupported_variants_are_clear_errors(gpt_oss_ckpt, tmp_path):
    base = json.loads((gpt_oss_ckpt / "config.json").read_text())

    def config_with(**changes):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **changes}))
        return folder

    cases = [({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
             ({"quantization_config": {"quant_method": "gptq"}}, "'gptq' is not supported"),
             ({"layer_types": ["chunked_attention", "full_attention", "full_attention"]}, "chunked_attention"),
             ({"layer_types": ["full_attention"]}, "one per layer"),
             ({"sliding_window": None}, "sliding_window is not set")]
    for changes, message in cases:
        with pytest.raises(UnsupportedModelError, match=message):
            load_model_config(config_with(**changes))
    with pytest.raises(ValueError, match="one device only"):
        LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=64, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="experts .biases, clamped SwiGLU. are not offloaded"):
        LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=64, expert_offload=True)
    with pytest.raises(ValueError, match="routing='hierarchical'"):
        LLM(str(gpt_oss_ckpt), dtype="float32", max_model_len=64, routing="hierarchical")


@pytest.fixture(scope="module")
def gpt_oss_hd64_ckpt(tmp_path_factory):
    """gpt-oss's own head_dim (64), for the decode kernels' shapes on the GPU."""
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "hd64", seed=4, head_dim=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs, the fused kernels and bf16 need a CUDA device")
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int4", "kivi2", "nuq2"])
def test_cuda_bf16_graphs_match_eager(gpt_oss_hd64_ckpt, name):
    """On CUDA in bf16: decode steps replayed from CUDA graphs (fused MoE epilogues, the decode kernel
    with sinks and windows) give the eager steps' greedy tokens; in fp32 on CUDA the logits match
    transformers' (the fused MoE's ieee fp32 path)."""
    from tests.test_cuda_graphs import _first_divergence_is_a_tie

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4, **engine_kwargs_for(name))
    ref = LLM(str(gpt_oss_hd64_ckpt), enforce_eager=True, **kwargs).generate(prompts, params)
    llm = LLM(str(gpt_oss_hd64_ckpt), **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.use_graphs
    out = llm.generate(prompts, params)
    assert llm.engine.runner.graphs is graphs, "the graph path failed and fell back to eager (see the log)"
    assert graphs.num_replays > 10
    for i, (a, b) in enumerate(zip(ref, out)):  # bf16: a first divergence may only be a near-tie
        ok, where = _first_divergence_is_a_tie(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                               b.outputs[0].token_ids, b.outputs[0].logprobs)
        assert ok, (f"{name}, prompt {i} (graphs against eager): {where}; eager {a.outputs[0].token_ids}, "
                    f"graphs {b.outputs[0].token_ids}")
    if name == "bf16":
        fp32 = LLM(str(gpt_oss_hd64_ckpt), dtype="float32", device="cuda", max_model_len=128,
                   max_num_batched_tokens=12)
        check_logits(fp32, hf_model(gpt_oss_hd64_ckpt), tol=1e-3)


@pytest.fixture(scope="module")
def gpt_oss_hd64_mxfp4_ckpt(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "hd64", seed=6, head_dim=64, mxfp4=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused MXFP4 kernels and CUDA graphs need a CUDA device")
def test_cuda_mxfp4_experts_stay_quantized(gpt_oss_hd64_mxfp4_ckpt):
    """On CUDA the MXFP4 experts load as QuantizedWeights (4.25 bits a weight) and the fused MXFP4
    kernels run them: fp32 logits match transformers' on the dequantized weights, and bf16 decode steps
    replayed from CUDA graphs give the eager steps' greedy tokens."""
    from moekv.ops.quantized_weight import QuantizedWeight
    from tests.test_cuda_graphs import _first_divergence_is_a_tie

    fp32 = LLM(str(gpt_oss_hd64_mxfp4_ckpt), dtype="float32", device="cuda", max_model_len=128,
               max_num_batched_tokens=12)
    w13 = fp32.engine.runner.model.layers[0].mlp.w13
    assert isinstance(w13, QuantizedWeight) and w13.method == "mxfp4" and w13.codes.is_cuda
    assert fp32.engine.runner.quantization == "mxfp4"
    check_logits(fp32, hf_model(gpt_oss_hd64_mxfp4_ckpt.parent / "hd64"), tol=1e-3)
    del fp32
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4)
    ref = LLM(str(gpt_oss_hd64_mxfp4_ckpt), enforce_eager=True, **kwargs).generate(prompts, params)
    llm = LLM(str(gpt_oss_hd64_mxfp4_ckpt), **kwargs)
    out = llm.generate(prompts, params)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 10
    for a, b in zip(ref, out):
        ok, where = _first_divergence_is_a_tie(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                               b.outputs[0].token_ids, b.outputs[0].logprobs)
        assert ok, where


def test_info_names_windows_sinks_and_tiered_refusal(gpt_oss_ckpt, capsys):
    import argparse

    from moekv.cli.info import add_info_parser

    parser = argparse.ArgumentParser()
    add_info_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["info", "--model", str(gpt_oss_ckpt)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "GptOssForCausalLM" in out
    assert f"sliding window {WINDOW} on 2 of 3 layers, a sink logit per head, YaRN RoPE (factor 32)" in out
    assert "tiered     n/a: does not serve sliding-window attention layers" in out
