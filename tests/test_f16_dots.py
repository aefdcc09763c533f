"""The int4 GEMVs' dot in packed halves (quant_tiles.int4_f16_dots): its numpy emulation against float64 (the error
bound reference.f16_error_bound, and int4's own error), the launchers' choice, and on the GPU the kernels against
the dequantized references and against the emulation.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_f16_dots.py
    python -m pytest -q -m gpu tests/test_f16_dots.py          # on the GPU machine
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.triton_kernels import kernel_modules, triton  # noqa: F401 (before any kernel import)

# isort: split

from moekv.ops.quantized_weight import QuantizedWeight, pack_int4, quantize_int4  # noqa: E402
from moekv.ops.reference import (  # noqa: E402
    clamped_swiglu_moe_ref,
    f16_error_bound,
    fused_moe_ref,
    int4_f16_dots_ref,
    linear_ref,
)

qt, fq, ql = kernel_modules("moekv.ops.quant_tiles", "moekv.ops.fused_moe_quant", "moekv.ops.quant_linear")


def _activations(kind: str, K: int, g: torch.Generator) -> torch.Tensor:
    """bf16-valued fp32 activations: a normed hidden state with a few large channels, a SwiGLU output, or SwiGLU
    outputs with 16 features of |x| in 1,000-5,000 (down projections' outliers)."""
    if kind == "hidden":
        x = torch.randn(K, generator=g)
        x[torch.randperm(K, generator=g)[:8]] *= 30
    else:
        x = F.silu(torch.randn(K, generator=g)) * torch.randn(K, generator=g)
        if kind == "outliers":
            idx = torch.randperm(K, generator=g)[:16]
            x[idx] = (torch.rand(16, generator=g) * 4000 + 1000) * torch.sign(torch.randn(16, generator=g))
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("kind,K", [("hidden", 4096), ("swiglu", 14336), ("outliers", 14336), ("swiglu", 2880)])
@pytest.mark.parametrize("zero_point", [False, True])
def test_emulation_within_bound_and_far_below_int4(kind, K, zero_point):
    """Mixtral-shaped rows (and gpt-oss's 2880, whose last K step and group are cut): the packed-half dot's error
    against float64 stays within its bound, and its rms is below 1% of int4's own (the dequantized weights against
    the unquantized ones)."""
    g = torch.Generator().manual_seed(K + zero_point)
    w = torch.randn(32, K, generator=g) / K ** 0.5
    x = _activations(kind, K, g)
    q = quantize_int4(w, 128, zero_point=zero_point)
    exact = q.dequantize(torch.float64) @ x.double()
    f16 = int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 128, 1024)
    err = (f16 - exact).abs()
    assert (err <= f16_error_bound(q.codes, q.scales, x, 128)).all()
    int4_err = (exact - w.double() @ x.double()).pow(2).mean().sqrt()
    assert err.pow(2).mean().sqrt() < 1e-2 * int4_err


def test_emulation_decodes_every_code_at_every_nibble():
    """Every code at each of a word's 8 nibble positions, with small integer activations (every product and sum
    exact in fp16): the emulation gives the dequantized dot exactly, so its nibble pairs (i, i + 4), magic halves
    and centring are right; and the kernel's PTX carries the same constants."""
    N, K = 16, 256
    codes = (torch.arange(N)[:, None] * 3 + torch.arange(K)[None, :]) % 16
    scales = torch.full((N, K // 32), 0.5)
    zeros = torch.randint(0, 16, scales.shape, generator=torch.Generator().manual_seed(0)).float()
    q = QuantizedWeight("int4", (N, K), pack_int4(codes), scales, (1, 32), zeros)
    x = torch.randint(-3, 4, (K,), generator=torch.Generator().manual_seed(1)).float()
    exact = q.dequantize(torch.float64) @ x.double()
    assert torch.equal(int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 32, 128), exact)
    asm = qt._WORD_DOT_F16.value
    for const, meaning in ((0x6400, 1024.0), (0x6408, 1032.0), (0x2C00, 1 / 16), (0xD480, -72.0)):
        assert f"0x{const:04X}{const:04X}" in asm
        assert float(np.uint16(const).view(np.float16)) == meaning
    assert "0x000F000F" in asm and "0x00F000F0" in asm and "shr.u32 w8, $1, 8;" in asm


def test_emulation_range_extremes():
    """Activations from 1e-8 to 6e4 in one K step (beyond fp16's range unscaled): finite, within the bound."""
    g = torch.Generator().manual_seed(2)
    K = 2048
    x = (torch.randn(K, generator=g) * 10.0 ** torch.randint(-8, 4, (K,), generator=g)).to(torch.bfloat16).float()
    x[5] = 60000.0
    q = quantize_int4(torch.randn(8, K, generator=g), 128, zero_point=True)
    f16 = int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 128, 1024)
    exact = q.dequantize(torch.float64) @ x.double()
    assert torch.isfinite(f16).all()
    assert ((f16 - exact).abs() <= f16_error_bound(q.codes, q.scales, x, 128)).all()


def test_use_f16_dots(monkeypatch):
    """On for int4 on CUDA where asked (or by F16_DOTS_DEFAULT), with scales read per tile or per group; off
    for the other methods, the CPU, per-element scales and the interpreter, which cannot run inline PTX."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert qt.use_f16_dots(True, "int4", "cuda", 128, 4096, 1024)
    assert qt.use_f16_dots(True, "int4", "cuda", 4096, 4096, 1024)  # one group a tile
    assert not qt.use_f16_dots(False, "int4", "cuda", 128, 4096, 1024)
    assert not qt.use_f16_dots(True, "fp8", "cuda", 4096, 4096, 1024)
    assert not qt.use_f16_dots(True, "mxfp4", "cuda", 32, 2880, 1024)
    assert not qt.use_f16_dots(True, "int4", "cpu", 128, 4096, 1024)
    assert not qt.use_f16_dots(True, "int4", "cuda", 24, 96, 32)  # per-element scales
    for default in (False, True):
        monkeypatch.setattr(qt, "F16_DOTS_DEFAULT", default)
        assert qt.use_f16_dots(None, "int4", "cuda", 128, 4096, 1024) == default
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not qt.use_f16_dots(True, "int4", "cuda", 128, 4096, 1024)


def test_interpreter_keeps_fp32_dots():
    """Asked for packed halves under the interpreter (the CPU suite), the GEMVs run their fp32 dots: the same
    output as without the request."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without CUDA (tests/triton_kernels.py)")
    g = torch.Generator().manual_seed(0)
    w13 = quantize_int4(torch.randn(4, 32, 64, generator=g) / 8, 16, zero_point=True)
    w2 = quantize_int4(torch.randn(4, 64, 16, generator=g) / 4, 16, zero_point=True)
    x = torch.randn(2, 64, generator=g)
    weights, ids = torch.softmax(torch.randn(2, 4, generator=g), -1).topk(2)
    cfg = fq.QuantGemvConfig(block_n=4, block_k=32)
    on = fq.fused_moe_quant(x, w13, w2, weights, ids, path="gemv", config=dataclasses.replace(cfg, f16_dots=True))
    off = fq.fused_moe_quant(x, w13, w2, weights, ids, path="gemv", config=cfg)
    assert torch.equal(on, off)
    ref = fused_moe_ref(x.double(), w13.dequantize(torch.float64), w2.dequantize(torch.float64), weights.double(), ids)
    assert (on.double() - ref).abs().max().item() < 1e-5


# -- compiled ----------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# (E, H, I, top-k, gpt-oss's epilogues)
MOE_SHAPES = {"mixtral-8x7b": (8, 4096, 14336, 2, False), "gpt-oss-20b": (32, 2880, 2880, 4, True)}


@pytest.fixture(scope="module", params=[(shape, zp) for shape in MOE_SHAPES for zp in (False, True)],
                ids=lambda p: f"{p[0]}-{'zp' if p[1] else 'sym'}")
def int4_experts(request):
    shape, zero_point = request.param
    E, H, I, k, oss = MOE_SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    q13, q2 = quantize_int4(w13, zero_point=zero_point), quantize_int4(w2, zero_point=zero_point)
    epilogue = {}
    if oss:
        b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        epilogue = dict(biases=(b13, b2), clamped_swiglu=(1.702, 7.0))
    return shape, q13, q2, epilogue


def _moe_ref(x, q13, q2, weights, ids, epilogue):
    """fp32 math on the dequantized weights of the experts used (memory)."""
    used = ids.unique()
    remap = torch.full((q13.shape[0],), -1, dtype=ids.dtype, device="cuda")
    remap[used] = torch.arange(used.numel(), device="cuda")
    w13 = torch.stack([q13[e].dequantize() for e in used.tolist()])
    w2 = torch.stack([q2[e].dequantize() for e in used.tolist()])
    if epilogue:
        b13, b2 = epilogue["biases"]
        return clamped_swiglu_moe_ref(x.float(), w13, b13[used].float(), w2, b2[used].float(), weights.float(),
                                      remap[ids], *epilogue["clamped_swiglu"])
    return fused_moe_ref(x.float(), w13, w2, weights.float(), remap[ids])


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("outliers", [False, True])
def test_gpu_moe_gemv_f16_dots(int4_experts, T, outliers):
    """The pair GEMV with packed-half dots against fp32 math on the dequantized weights: within the fp32 dots'
    error (bf16 rounding of h and of the output) plus 1e-3 of the output's range; activations with outliers
    (|x| to 5,000) too. And it is the packed-half path: its output differs from the fp32 dots'."""
    shape, q13, q2, epilogue = int4_experts
    E, H, I, k, _ = MOE_SHAPES[shape]
    torch.manual_seed(T)
    x = torch.randn(T, H, device="cuda")
    if outliers:
        x[:, torch.randperm(H)[:8]] = 3000.0 * torch.sign(torch.randn(T, 8, device="cuda"))
    x = x.to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, E, device="cuda"), -1).topk(k)
    weights = weights / weights.sum(-1, keepdim=True)
    cfg = fq.default_quant_gemv(q13)
    f16 = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemv", config=dataclasses.replace(cfg, f16_dots=True),
                             **epilogue).float()
    fp32 = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemv", config=dataclasses.replace(cfg, f16_dots=False),
                              **epilogue).float()
    oracle = _moe_ref(x, q13, q2, weights, ids, epilogue)
    scale = oracle.abs().max().item()
    err, err_fp32 = (f16 - oracle).abs().max().item(), (fp32 - oracle).abs().max().item()
    assert err <= 1.5 * err_fp32 + 1e-3 * scale, (err, err_fp32, scale)
    assert not torch.equal(f16, fp32)


@pytest.mark.parametrize("K,kind", [(4096, "hidden"), (14336, "outliers"), (2880, "swiglu")])
@pytest.mark.parametrize("zero_point", [False, True])
def test_gpu_projection_gemv_matches_emulation(K, kind, zero_point):
    """The projection GEMV (fp32 activations holding bf16 values, fp32 out) with packed-half dots against the
    numpy emulation of its arithmetic (the same up to fp32's summation order) and within the float64 bound."""
    g = torch.Generator().manual_seed(K)
    w = torch.randn(256, K, generator=g) / K ** 0.5
    q = quantize_int4(w, 128, zero_point=zero_point)
    x = _activations(kind, K, g)
    shape = dataclasses.replace(ql.SHAPE_OF_METHOD["int4"], f16_dots=True)
    out = ql.quant_gemv(x[None].cuda(), q.to("cuda"), shape=shape)[0].double().cpu()
    emulated = int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 128, min(shape.block_k, triton.next_power_of_2(K)))
    exact = linear_ref(x.double()[None], q.dequantize(torch.float64))[0]
    bound = f16_error_bound(q.codes, q.scales, x, 128)
    assert ((out - exact).abs() <= bound + 1e-6 * exact.abs().max()).all()
    assert (out - emulated).abs().max().item() <= 1e-5 * exact.abs().max().item()


@pytest.mark.parametrize("T", [1, 4])
def test_gpu_projection_gemv_attention_shape(T):
    """Mixtral's qkv projection [6144, 4096] with bf16 activations: packed-half dots within the fp32 dots' error."""
    w = (torch.randn(6144, 4096, device="cuda") * 4096 ** -0.5).to(torch.bfloat16)
    q = quantize_int4(w, zero_point=True)
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    oracle = x.float() @ q.dequantize().T
    outs = {f16: ql.quant_gemv(x, q, shape=dataclasses.replace(ql.SHAPE_OF_METHOD["int4"], f16_dots=f16)).float()
            for f16 in (False, True)}
    err, err_fp32 = ((outs[f] - oracle).abs().max().item() for f in (True, False))
    assert err <= 1.5 * err_fp32 + 1e-3 * oracle.abs().max().item(), (err, err_fp32)


for _mark in gpu:
    test_gpu_moe_gemv_f16_dots = _mark(test_gpu_moe_gemv_f16_dots)
    test_gpu_projection_gemv_matches_emulation = _mark(test_gpu_projection_gemv_matches_emulation)
    test_gpu_projection_gemv_attention_shape = _mark(test_gpu_projection_gemv_attention_shape)
