"""Pre-quantized checkpoints in the layouts that map onto moekv's weight kinds on load: compressed-tensors
`float-quantized` (fp8 weights, per channel, per tensor or 128x128 blocks), AWQ (GEMM packing) and
GPTQ (v1 and v2 zero points, symmetric and not, act-order with static groups). Each tiny checkpoint is
written here from the layout's documentation (this file's own packing: AWQ's nibble order
[0, 2, 4, 6, 1, 3, 5, 7] along the outputs, GPTQ's consecutive input features along K and zero points
along N), run by the engine, and compared with transformers running the same weights dequantized in
float64 (logits, greedy tokens), on a tiny Mixtral and (AWQ) a tiny Qwen3-MoE; plus the refusals. No
AWQ / GPTQ / compressed-tensors package is installed, so transformers cannot load these checkpoints
itself here. The GPU test (scripts/gpu/prequant_layouts.sh) loads them on CUDA in bf16.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_prequantized_layouts.py
"""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.models.prequantized import AWQ_ORDER, unpack_awq
from moekv.ops.quantized_weight import QuantizedWeight
from tests.checkpoints import build_checkpoint, load_hf
from tests.test_quantized_checkpoints import PROMPTS, SHAPE, _fp8_blocks, _hf_with, _mixtral_modules, _write

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ROUTER = "re:.*block_sparse_moe.gate$"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = build_checkpoint("mixtral", tmp_path_factory.mktemp("layouts") / "mixtral", seed=11, **SHAPE)
    hf = load_hf(path)
    return path, hf, _mixtral_modules(hf.state_dict(), hf.config.num_hidden_layers)


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...], nibble i from value i (bits 4i .. 4i + 3)."""
    words = sum(nibbles[..., i].long() << (4 * i) for i in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _asym_groups(w: torch.Tensor, group: int, symmetric: bool):
    """Round-to-nearest 4-bit groups along K: (codes [N, K] 0..15, fp16 scales [N, K / G], zeros
    [N, K / G] integers). Symmetric: GPTQ's zero 8 and scale 2 max|w| / 15."""
    N, K = w.shape
    g = w.double().reshape(N, K // group, group)
    if symmetric:
        scale = (2 * g.abs().amax(-1) / 15).to(torch.float16)
        zero = torch.full_like(scale, 8, dtype=torch.float64)
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = ((hi - lo) / 15).to(torch.float16)
        zero = (-lo / scale.double()).round().clamp(0, 15)
    q = ((g / scale.double()[..., None]).round() + zero[..., None]).clamp(0, 15)
    return q.reshape(N, K).long(), scale, zero.long()


def _dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """float64 (q - zero) * scale with [N, K / G] scales and zeros."""
    per = lambda t: t.double().repeat_interleave(group, dim=1)  # noqa: E731
    return (q.double() - per(zero)) * per(scale)


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] codes 0..15 -> AutoAWQ GEMM words [R, N / 8]: output feature 8j + AWQ_ORDER[i] in nibble i."""
    cols = codes.reshape(codes.shape[0], -1, 8)
    return _pack_words(torch.stack([cols[..., AWQ_ORDER[i]] for i in range(8)], dim=-1))


def test_awq_unpacking_inverts_awq_packing():
    codes = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(1))
    codes[0, :8] = torch.arange(8) + 8  # the top nibble's sign bit set, each position a distinct code
    assert torch.equal(unpack_awq(_pack_awq(codes)).long(), codes)


def _awq(w: torch.Tensor, group: int):
    """AutoAWQ GEMM: qweight [K, N / 8] and qzeros [K / G, N / 8] with output feature 8j + AWQ_ORDER[i]
    in nibble i of word j; scales fp16 [K / G, N]."""
    q, scale, zero = _asym_groups(w, group, symmetric=False)
    parts = {"qweight": _pack_awq(q.T), "qzeros": _pack_awq(zero.T), "scales": scale.T.contiguous()}
    return parts, _dequantized(q, scale, zero, group)


def _gptq(w: torch.Tensor, group: int, symmetric: bool, v1: bool, permuted_groups: bool = False):
    """GPTQ: qweight [K / 8, N] (input feature 8j + i in nibble i of word j), qzeros [K / G, N / 8]
    (output feature 8j + i in nibble i) holding zero - 1 in v1 ('gptq') checkpoints, scales fp16
    [K / G, N], g_idx [K]."""
    q, scale, zero = _asym_groups(w, group, symmetric)
    N, K = w.shape
    stored = (zero - 1) & 0xF if v1 else zero
    read_back = stored + 1 if v1 else stored  # what GPTQ's kernels subtract
    qweight = _pack_words(q.T.reshape(K // 8, 8, N).transpose(1, 2))
    qzeros = _pack_words(stored.T.reshape(K // group, N // 8, 8))
    g_idx = torch.arange(K, dtype=torch.int32) // group
    if permuted_groups:  # act-order without static groups: feature k's group is not k // G
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(0))]
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scale.T.contiguous(), "g_idx": g_idx}
    return parts, _dequantized(q, scale, read_back, group)


def _fp8(w: torch.Tensor, strategy: str):
    """compressed-tensors float-quantized: e4m3 weight, weight_scale [N, 1] / [1] / 128x128 blocks (bf16
    for channel and tensor, as llm-compressor saves a bf16 model's)."""
    if strategy == "block":
        codes, scale, deq = _fp8_blocks(w)
        return {"weight": codes, "weight_scale": scale}, deq
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)
    scale = (amax / 448).to(torch.bfloat16)
    codes = (w.double() / scale.double().reshape(-1, 1)).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.double() * scale.double().reshape(-1, 1)


LAYOUTS = {  # layout -> (quantization_config, how a module is written, lm_head quantized)
    "ct-fp8-channel": (dict(quant_method="compressed-tensors", format="float-quantized", ignore=[ROUTER],
                            config_groups={"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False}, "input_activations": {
                                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}),
                       lambda w: _fp8(w, "channel"), True),
    "ct-fp8-tensor": (dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head", ROUTER],
                           config_groups={"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                               "dynamic": False}, "input_activations": None}}),
                      lambda w: _fp8(w, "tensor"), False),
    "ct-fp8-block": (dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head", ROUTER],
                          config_groups={"group_0": {"targets": ["Linear"], "weights": {
                              "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                              "symmetric": True, "dynamic": False}, "input_activations": {
                              "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                              "dynamic": True}}}),
                     lambda w: _fp8(w, "block"), False),
    # one layer's attention left 16-bit, as the config's modules_to_not_convert says
    "awq": (dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm",
                 modules_to_not_convert=["gate", "lm_head", "model.layers.1.self_attn"]), lambda w: _awq(w, 32), False),
    "gptq-sym": (dict(quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False,
                      checkpoint_format="gptq", lm_head=False), lambda w: _gptq(w, 32, True, True), False),
    "gptq-zero-points": (dict(quant_method="gptq", bits=4, group_size=32, sym=False, desc_act=False,
                              checkpoint_format="gptq", lm_head=True), lambda w: _gptq(w, 32, False, True), True),
    "gptq-v2-static-groups": (dict(quant_method="gptq", bits=4, group_size=128, sym=False, desc_act=True,
                                   static_groups=True, checkpoint_format="gptq_v2"),
                              lambda w: _gptq(w, 128, False, False), False),
}


def _quantized_module(name: str, lm_head: bool, left_alone: tuple[str, ...] = ()) -> bool:
    if any(name.startswith(prefix + ".") for prefix in left_alone):
        return False
    return name.endswith(".weight") and (any(p in name for p in ("_proj.", ".experts.")) or
                                         lm_head and name == "lm_head.weight")


def _checkpoint(base, out, layout: str, write=None, **config):
    """The base model's weights in `layout` (write: replaces how a module is written; config: fields
    of its quantization_config replaced) -> (checkpoint folder, float64 dequantized matrices by name)."""
    path, _, modules = base
    qc, write_default, lm_head = LAYOUTS[layout]
    qc = {**qc, **config}
    tensors, dequantized = {}, {}
    for name, w in modules.items():
        if not _quantized_module(name, lm_head, tuple(e for e in qc.get("modules_to_not_convert", ()) if "." in e)):
            tensors[name] = w
            continue
        parts, dequantized[name] = (write or write_default)(w)
        tensors.update({f"{name[:-len('.weight')]}.{suffix}": t for suffix, t in parts.items()})
    return _write(path, out, tensors, qc), dequantized


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_transformers_dequantized(base, tmp_path, layout):
    ckpt, dequantized = _checkpoint(base, tmp_path / layout, layout)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    model = llm.engine.runner.model
    lm_head = LAYOUTS[layout][2]
    assert all(isinstance(m, QuantizedWeight) for m in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.w13,
                                                        model.layers[1].mlp.w2, model.layers[0].self_attn.o_proj))
    assert isinstance(model.layers[1].self_attn.qkv_proj, QuantizedWeight) == (layout != "awq")
    assert isinstance(model.lm_head, QuantizedWeight) == lm_head
    assert isinstance(model.layers[0].mlp.gate, torch.nn.Parameter)  # the router stays 16-bit
    assert llm.engine.runner.quantization == ("fp8" if layout.startswith("ct-fp8") else "int4")
    if layout == "gptq-sym":  # symmetric GPTQ loads without stored zero points (the implicit 8)
        assert model.layers[0].mlp.w13.zeros is None
    hf = _hf_with(base[1], dequantized)
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (logits - ref).abs().max().item() < 1e-4
    # the checkpoint's weights, not the 32-bit ones it was made from
    with torch.no_grad():
        assert (ours[0] - base[1](torch.tensor([PROMPTS[0]])).logits[0]).abs().max().item() > 1e-3
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    for prompt, got in zip(PROMPTS, tokens):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                               pad_token_id=hf.config.pad_token_id)[0, len(prompt):].tolist()
        assert list(got) == want


def test_awq_and_gptq_scales_stay_fp16_in_a_bf16_model(base, tmp_path):
    """bf16 scales would round AWQ / GPTQ's fp16 ones (3 fewer mantissa bits): they are kept as stored."""
    from moekv.models.loader import load_model

    ckpt, _ = _checkpoint(base, tmp_path / "awq", "awq")
    model = load_model(ckpt, torch.bfloat16, torch.device("cpu"))
    w13 = model.layers[0].mlp.w13
    assert w13.scales.dtype == torch.float16 and w13.zeros.dtype == torch.float16
    assert torch.equal(w13.scales[0, :4].T.contiguous(),  # expert 0's w1 rows 0..3, as the checkpoint stores them
                       _awq(base[2]["model.layers.0.block_sparse_moe.experts.0.w1.weight"], 32)[0]["scales"][:, :4])


def _gptq_with_zero(w):
    parts, deq = _gptq(w, 32, True, True)
    parts["qzeros"] = parts["qzeros"] ^ 1  # zero points 7 -> 6 and back: no longer all 8
    return parts, deq


@pytest.mark.parametrize("layout,write,config,match", [
    ("gptq-v2-static-groups", lambda w: _gptq(w, 32, False, False, permuted_groups=True), {"group_size": 32},
     "desc_act"),
    ("gptq-sym", lambda w: _gptq(w, 32, True, True, permuted_groups=True), {}, "not k // group_size"),
    ("gptq-sym", _gptq_with_zero, {}, "sym true"),
    ("awq", lambda w: _awq(w, 64), {}, "shape"),  # the config says groups of 32
])
def test_checkpoint_that_contradicts_its_config_is_refused(base, tmp_path, layout, write, config, match):
    ckpt, _ = _checkpoint(base, tmp_path / "bad", layout, write, **config)
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), dtype="float32", max_model_len=64)


@pytest.mark.parametrize("layout,config,match", [
    ("awq", {"modules_to_not_convert": ["gate", "model.layers.1"]}, r"leaves model.layers.1.\S+ unquantized"),
    ("gptq-sym", {"lm_head": False}, "leaves lm_head unquantized"),
    ("ct-fp8-channel", {"ignore": ["lm_head", ROUTER]}, "leaves lm_head unquantized"),
])
def test_quantized_module_the_config_leaves_alone_is_refused(base, tmp_path, layout, config, match):
    """AWQ's modules_to_not_convert, GPTQ's lm_head flag and compressed-tensors' ignore are honoured: a
    module they name must be stored 16-bit (the LM head is quantized here)."""
    path, _, modules = base
    qc, write, _ = LAYOUTS[layout]
    tensors = {}
    for name, w in modules.items():
        if _quantized_module(name, True):
            tensors.update({f"{name[:-len('.weight')]}.{s}": t for s, t in write(w)[0].items()})
        else:
            tensors[name] = w
    ckpt = _write(path, tmp_path / "ignored", tensors, {**qc, **config})
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), dtype="float32", max_model_len=64)


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "awq bits 3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False}, "zero_point"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100, "version": "gemm"}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": FP8_WEIGHTS, "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "dynamic": False}}}}, "input_activations"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": dict(FP8_WEIGHTS, strategy="block", block_structure=[64, 64])}}}, "block_structure"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": dict(FP8_WEIGHTS, num_bits=4)}}}, "8-bit float"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
])
def test_unsupported_quantization_config_is_refused(base, tmp_path, qc, match):
    path, _, modules = base
    ckpt = _write(path, tmp_path / "bad", modules, qc)
    with pytest.raises(ValueError, match=match) as err:
        LLM(str(ckpt), dtype="float32", max_model_len=64)
    assert "accepted" in str(err.value) and "awq bits 4, version gemm" in str(err.value)


def test_awq_qwen3_moe_matches_transformers_dequantized(tmp_path):
    """A Qwen3-MoE (q/k norms, a router named mlp.gate beside experts' gate_proj): AWQ's
    modules_to_not_convert ["gate"] leaves the router alone and not the experts' gate_proj."""
    path = build_checkpoint("qwen3_moe", tmp_path / "qwen3", seed=4, hidden_size=128, head_dim=32,
                            num_key_value_heads=4, moe_intermediate_size=64)
    hf = load_hf(path)
    state = hf.state_dict()
    tensors, dequantized = {}, {}
    for name, t in state.items():
        if ".mlp.experts." in name:
            continue
        if "_proj." in name:
            parts, dequantized[name] = _awq(t, 32)
            tensors.update({f"{name[:-len('.weight')]}.{s}": p for s, p in parts.items()})
        else:
            tensors[name] = t
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
        I = down.shape[-1]
        for e in range(gate_up.shape[0]):
            for which, w in (("gate_proj", gate_up[e, :I]), ("up_proj", gate_up[e, I:]), ("down_proj", down[e])):
                parts, deq = _awq(w, 32)
                tensors.update({f"{prefix}.{e}.{which}.{s}": p for s, p in parts.items()})
                dequantized[(layer, e, which)] = deq
    qc = dict(LAYOUTS["awq"][0], modules_to_not_convert=["gate"])
    ckpt = _write(path, tmp_path / "awq", tensors, qc)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.w13, QuantizedWeight) and isinstance(model.layers[0].mlp.gate,
                                                                               torch.nn.Parameter)
    ref_state = {k: v.clone() for k, v in state.items()}
    for key, w in dequantized.items():
        if isinstance(key, str):
            ref_state[key] = w.float()
            continue
        layer, e, which = key
        prefix = f"model.layers.{layer}.mlp.experts"
        I = ref_state[f"{prefix}.down_proj"].shape[-1]
        if which == "down_proj":
            ref_state[f"{prefix}.down_proj"][e] = w.float()
        else:
            ref_state[f"{prefix}.gate_up_proj"][e, slice(0, I) if which == "gate_proj" else slice(I, 2 * I)] = w.float()
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(ref_state)
    for prompt, logits in zip(PROMPTS, llm.score([{"prompt_token_ids": p} for p in PROMPTS])):
        with torch.no_grad():
            assert (logits - ref(torch.tensor([prompt])).logits[0]).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["awq", "gptq-sym", "gptq-zero-points", "ct-fp8-tensor", "ct-fp8-block"])
def test_layout_on_cuda_matches_the_cpu_engine(base, tmp_path, layout):
    """Converted on the GPU (to_moekv_layout runs on the weight's device) and read by the quantized
    kernels in bf16, AWQ / GPTQ's scales fp16: the CPU engine's fp32 logits within 3% of their range."""
    ckpt, _ = _checkpoint(base, tmp_path / layout, layout)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(str(ckpt), dtype="float32", max_model_len=128).score(prompts)
    llm = LLM(str(ckpt), dtype="bfloat16", device="cuda", max_model_len=128)
    w13 = llm.engine.runner.model.layers[0].mlp.w13
    assert w13.codes.is_cuda and (w13.scales.dtype == torch.float16) == layout.startswith(("awq", "gptq"))
    for got, want in zip(llm.score(prompts), ref):
        err = (got.float().cpu() - want).abs().max().item()
        assert err < 0.03 * want.abs().max().item(), f"{layout}: {err} against a range of {want.abs().max()}"
