"""Quantized weights through the engine, against transformers running the same weights dequantized:
quantize-on-load (quantization='fp8' / 'int4') and pre-quantized checkpoints in each accepted layout,
written here from their documented layouts (fp8 with 128x128 `weight_scale_inv` blocks;
compressed-tensors `pack-quantized` W4A16, symmetric and with packed zero points), with this file's
own packing and float64 dequantization; plus the refusals.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_quantized_checkpoints.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moekv import LLM
from moekv.ops.quantized_weight import QuantizedWeight
from tests.checkpoints import build_checkpoint, load_hf

PROMPTS = [[5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14], [9, 8, 7]]
# 128-row-aligned parts (q, k, v; gate, up) so fp8's 128x128 blocks tile the fused matrices
SHAPE = dict(hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=128)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Mixtral saved by transformers, and its weights by checkpoint module name."""
    path = build_checkpoint("mixtral", tmp_path_factory.mktemp("qbase") / "mixtral", seed=3, **SHAPE)
    hf = load_hf(path)
    return path, hf, hf.state_dict()


def _mixtral_modules(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """transformers' state dict -> Mixtral's released tensor names, one matrix per expert."""
    out = {}
    for name, t in state.items():
        if ".mlp.experts." not in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        gate_up, down = state[f"{prefix}.mlp.experts.gate_up_proj"], state[f"{prefix}.mlp.experts.down_proj"]
        I = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            expert = f"{prefix}.block_sparse_moe.experts.{e}"
            out[f"{expert}.w1.weight"], out[f"{expert}.w3.weight"] = gate_up[e, :I], gate_up[e, I:]
            out[f"{expert}.w2.weight"] = down[e]
    return out


def _quantized(name: str) -> bool:
    return name.endswith(".weight") and any(p in name for p in ("_proj.", ".experts.", "lm_head"))


def _fp8_blocks(w: torch.Tensor):
    """(e4m3 codes, fp32 weight_scale_inv [ceil(N/128), ceil(K/128)], float64 dequantized)."""
    N, K = w.shape
    amax = torch.zeros(-(-N // 128), -(-K // 128))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
    scale = amax / 448
    per_elem = scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    codes = (w.float() / per_elem).to(torch.float8_e4m3fn)
    return codes, scale, codes.double() * per_elem.double()


def _pack_along_last(signed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packing: value + 8, feature 8j + i in bits 4i of word j."""
    u = (signed.long() + 8).reshape(*signed.shape[:-1], -1, 8)
    words = sum(u[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _int4_groups(w: torch.Tensor, group: int, symmetric: bool):
    """(tensors of one module by suffix, float64 dequantized) in the pack-quantized layout."""
    N, K = w.shape
    g = w.double().reshape(N, K // group, group)
    if symmetric:
        scale = g.abs().amax(-1) / 7.5
        zero = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = (hi - lo) / 15
        zero = (-8 - lo / scale).round().clamp(-8, 7)
    scale = scale.to(torch.bfloat16)
    q = ((g / scale.double()[..., None]).round() + zero[..., None]).clamp(-8, 7)
    deq = ((q - zero[..., None]) * scale.double()[..., None]).reshape(N, K)
    parts = {"weight_packed": _pack_along_last(q.reshape(N, K)), "weight_scale": scale,
             "weight_shape": torch.tensor([N, K], dtype=torch.int32)}
    if not symmetric:
        parts["weight_zero_point"] = _pack_along_last(zero.T.contiguous()).T.contiguous()  # 8 rows per word
    return parts, deq


def _write(base_path: Path, out: Path, tensors: dict, quantization_config: dict) -> Path:
    out.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_path / f, out / f)
    config = json.loads((base_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _hf_with(hf, dequantized: dict[str, torch.Tensor]):
    """transformers' model with the dequantized matrices (by Mixtral's released names) put in place."""
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for name, w in dequantized.items():
        if ".block_sparse_moe.experts." in name:
            layer = name.split(".")[2]
            expert, which = int(name.split(".")[5]), name.split(".")[6]
            I = state[f"model.layers.{layer}.mlp.experts.down_proj"].shape[-1]
            if which == "w2":
                state[f"model.layers.{layer}.mlp.experts.down_proj"][expert] = w.float()
            else:
                rows = slice(0, I) if which == "w1" else slice(I, 2 * I)
                state[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert, rows] = w.float()
        else:
            state[name] = w.float()
    copy = type(hf)(hf.config).eval()
    copy.load_state_dict(state)
    return copy


def _assert_logits_match(llm: LLM, hf) -> None:
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["fp8-block", "int4-symmetric", "int4-zero-point"])
def test_prequantized_checkpoint_matches_transformers_dequantized(base, tmp_path, layout):
    path, hf, state = base
    modules = _mixtral_modules(state, hf.config.num_hidden_layers)
    tensors, dequantized = {}, {}
    for name, w in modules.items():
        if not _quantized(name):
            tensors[name] = w
            continue
        module = name[:-len(".weight")]
        if layout == "fp8-block":
            codes, scale, deq = _fp8_blocks(w)
            tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = codes, scale
        else:
            parts, deq = _int4_groups(w, 32, symmetric=layout == "int4-symmetric")
            tensors.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        dequantized[name] = deq
    if layout == "fp8-block":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": layout == "int4-symmetric", "strategy": "group",
                   "group_size": 32, "actorder": None, "dynamic": False}
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
              "ignore": ["re:.*block_sparse_moe.gate$"]}
    ckpt = _write(path, tmp_path / layout, tensors, qc)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.w13, QuantizedWeight) and isinstance(model.lm_head, QuantizedWeight)
    assert llm.engine.runner.quantization == ("fp8" if layout == "fp8-block" else "int4")
    _assert_logits_match(llm, _hf_with(hf, dequantized))


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_quantize_on_load_matches_transformers_dequantized(base, method):
    """The engine's own quantized weights, dequantized into transformers' model: the same logits."""
    path, hf, _ = base
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=12, quantization=method)
    model = llm.engine.runner.model
    dequantized = {"lm_head.weight": model.lm_head.dequantize()}
    for i, layer in enumerate(model.layers):
        attn, cfg = layer.self_attn, model.config
        qkv = attn.qkv_proj.dequantize()
        prefix = f"model.layers.{i}"
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        dequantized.update({f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
                            f"{prefix}.self_attn.v_proj.weight": v,
                            f"{prefix}.self_attn.o_proj.weight": attn.o_proj.dequantize()})
        w13, w2 = layer.mlp.w13.dequantize(), layer.mlp.w2.dequantize()
        I = w2.shape[-1]
        for e in range(w13.shape[0]):
            expert = f"{prefix}.block_sparse_moe.experts.{e}"
            dequantized.update({f"{expert}.w1.weight": w13[e, :I], f"{expert}.w3.weight": w13[e, I:],
                                f"{expert}.w2.weight": w2[e]})
    assert all(isinstance(m, QuantizedWeight) for m in (model.layers[0].self_attn.o_proj, model.layers[1].mlp.w2))
    _assert_logits_match(llm, _hf_with(hf, dequantized))
    # the weights did change: transformers' own 32-bit weights give other logits
    ours = llm.score([{"prompt_token_ids": PROMPTS[0]}])[0]
    with torch.no_grad():
        assert (ours - hf(torch.tensor([PROMPTS[0]])).logits[0]).abs().max().item() > 1e-4


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "group_size None"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, "float-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"}}}}, "actorder"),
])
def test_unsupported_quantization_config_is_refused(base, tmp_path, qc, match):
    path, hf, state = base
    ckpt = _write(path, tmp_path / "bad", _mixtral_modules(state, hf.config.num_hidden_layers), qc)
    with pytest.raises(ValueError, match=match) as err:
        LLM(str(ckpt), dtype="float32", max_model_len=64)
    assert "accepted" in str(err.value)


def test_quantization_option_is_checked():
    with pytest.raises(ValueError, match="accepted"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="expert_offload"):
        LLM(quantization="int4", expert_offload=True)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2+ep"])
def test_two_ranks_quantize_their_shards(tmp_path_factory, expert_parallel):
    """tensor_parallel_size=2 with int4: each rank quantizes its own rows. Where each rank's share of
    a K-cut weight (o_proj; w2 without expert parallelism) is whole 128-wide groups, the ranks hold
    exactly one process's groups, so the logits agree to float32 rounding."""
    path = build_checkpoint("mixtral", tmp_path_factory.mktemp("tp") / "mixtral", seed=5, hidden_size=128,
                            head_dim=64, num_key_value_heads=2, intermediate_size=256)
    engine = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=48,
                  quantization="int4")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = LLM(model=str(path), **engine)
    two = LLM(model=str(path), **engine, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              distributed_timeout=60)
    try:
        assert two.engine.runner.quantization == "int4"
        assert isinstance(two.engine.runner.model.layers[0].mlp.w2, QuantizedWeight)
        for ours, ref in zip(two.score(prompts), one.score(prompts)):
            assert (ours - ref).abs().max().item() < 1e-4
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_quantizing_while_reading_equals_quantizing_the_loaded_model(method):
    """load_model(quantization=...) quantizes each tensor as it is read; the result is what
    quantize_model gives the loaded 16-bit model, buffer for buffer."""
    from moekv.models.loader import load_model
    from moekv.models.quantize import quantize_model

    model = Path(__file__).resolve().parent.parent / "models" / "domain-moe"
    streamed = load_model(model, torch.bfloat16, torch.device("cpu"), quantization=method)
    after = quantize_model(load_model(model, torch.bfloat16, torch.device("cpu")), method)
    ours, want = dict(streamed.named_buffers()), dict(after.named_buffers())
    assert ours.keys() == want.keys() and any(".codes" in k for k in ours)
    for name, tensor in want.items():
        assert torch.equal(ours[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else ours[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in streamed.parameters())
