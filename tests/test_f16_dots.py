"""The int4 GEMVs' dot in packed halves (quant_tiles.int4_f16_dots, the run GEMV's run_f16_dots): its numpy emulation
against float64 (the error bound reference.f16_error_bound, and int4's own error), the launchers' choice, and on the
GPU the kernels (pair, run and projection GEMVs) against the dequantized references and against the emulation.

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

import triton.language as tl  # noqa: E402

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
    for asm, word in ((qt._WORD_DOT_F16.value, "$1"), (qt._WORD_DECODE_F16.value, "$4")):
        for const, meaning in ((0x6400, 1024.0), (0x6408, 1032.0), (0x2C00, 1 / 16), (0xD480, -72.0)):
            assert f"0x{const:04X}{const:04X}" in asm
            assert float(np.uint16(const).view(np.float16)) == meaning
        assert "0x000F000F" in asm and "0x00F000F0" in asm and f"shr.u32 w8, {word}, 8;" in asm
    # the run GEMV's two statements are the pair GEMV's one, cut after the decode
    fused = qt._WORD_DOT_F16.value.splitlines()
    parts = qt._WORD_DECODE_F16.value.splitlines()[2:-1] + qt._HALVES_DOT_F16.value.splitlines()[4:-1]
    assert len(fused) == len(parts) + 6 and [line.split()[0] for line in fused[5:-1]] == [
        line.split()[0] for line in parts]


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
    assert not qt.use_f16_dots(True, "int4", "cuda", 4, 96, 32)  # groups of part of a word
    for default in (False, True):
        monkeypatch.setattr(qt, "F16_DOTS_DEFAULT", default)
        assert qt.use_f16_dots(None, "int4", "cuda", 128, 4096, 1024) == default
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not qt.use_f16_dots(True, "int4", "cuda", 128, 4096, 1024)


@pytest.mark.parametrize("path", ["gemv", "runs"])
def test_interpreter_keeps_fp32_dots(path):
    """Asked for packed halves under the interpreter (the CPU suite), the GEMVs (pair and run) run their fp32 dots:
    the same output as without the request."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without CUDA (tests/triton_kernels.py)")
    g = torch.Generator().manual_seed(0)
    w13 = quantize_int4(torch.randn(4, 32, 64, generator=g) / 8, 16, zero_point=True)
    w2 = quantize_int4(torch.randn(4, 64, 16, generator=g) / 4, 16, zero_point=True)
    x = torch.randn(3, 64, generator=g)
    weights, ids = torch.softmax(torch.randn(3, 4, generator=g), -1).topk(2)
    cfg = fq.QuantGemvConfig(block_n=4, block_k=32, run_pairs=2)
    on = fq.fused_moe_quant(x, w13, w2, weights, ids, path=path, config=dataclasses.replace(cfg, f16_dots=True))
    off = fq.fused_moe_quant(x, w13, w2, weights, ids, path=path, config=cfg)
    assert torch.equal(on, off)
    ref = fused_moe_ref(x.double(), w13.dequantize(torch.float64), w2.dequantize(torch.float64), weights.double(), ids)
    assert (on.double() - ref).abs().max().item() < 1e-5


# The packed-half PTX in plain Triton, for the interpreter (which cannot run inline asm): each f16x2 register's halves
# taken apart and computed in fp16 as the PTX does (a product or a fused multiply-add rounded to fp16 once: fp16
# operands' products are exact in fp32, and the add's double rounding through fp32 is harmless here), so the
# kernels' plumbing (pairs, planes, scales, chunks, masks) runs on the CPU.
@triton.jit
def _halves_of(r):
    lo = (r & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = ((r >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _emulated_pack(lo, hi):
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo_bits | (hi_bits << 16)


@triton.jit
def _emulated_centre(r, ODD: tl.constexpr):
    lo, hi = _halves_of((r & (0x00F000F0 if ODD else 0x000F000F)) | 0x64006400)
    if ODD:
        return _emulated_pack(lo.to(tl.float32) / 16 - 72.0, hi.to(tl.float32) / 16 - 72.0)
    else:
        return _emulated_pack(lo.to(tl.float32) - 1032.0, hi.to(tl.float32) - 1032.0)


@triton.jit
def _emulated_word_halves(words):
    shifted = words >> 8
    return (_emulated_centre(words, False), _emulated_centre(words, True), _emulated_centre(shifted, False),
            _emulated_centre(shifted, True))


@triton.jit
def _emulated_fma(a, h, acc):
    return (a.to(tl.float32) * h.to(tl.float32) + acc.to(tl.float32)).to(tl.float16)


@triton.jit
def _emulated_halves_dots(a0, a1, a2, a3, h0, h1, h2, h3):
    a0l, a0h = _halves_of(a0)
    a1l, a1h = _halves_of(a1)
    a2l, a2h = _halves_of(a2)
    a3l, a3h = _halves_of(a3)
    h0l, h0h = _halves_of(h0)
    h1l, h1h = _halves_of(h1)
    h2l, h2h = _halves_of(h2)
    h3l, h3h = _halves_of(h3)
    lo = (a0l.to(tl.float32) * h0l.to(tl.float32)).to(tl.float16)
    hi = (a0h.to(tl.float32) * h0h.to(tl.float32)).to(tl.float16)
    lo = _emulated_fma(a3l, h3l, _emulated_fma(a2l, h2l, _emulated_fma(a1l, h1l, lo)))
    hi = _emulated_fma(a3h, h3h, _emulated_fma(a2h, h2h, _emulated_fma(a1h, h1h, hi)))
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _emulated_word_dots(words, h0, h1, h2, h3):
    a0, a1, a2, a3 = _emulated_word_halves(words)
    return _emulated_halves_dots(a0, a1, a2, a3, h0, h1, h2, h3)


@pytest.mark.parametrize("zero_point", [False, True])
def test_interpreter_emulated_f16_dots(monkeypatch, zero_point):
    """The GEMVs' packed-half path under the interpreter, its PTX replaced by the plain-Triton emulation above: the
    pair GEMV within 1e-2 of the float64 reference (each token's error over its outputs' range: fp16 halves) but
    not within 1e-5, as the fp32 dots are, so the packed-half path ran; the run GEMV at P = 2 and 4 the pair GEMV's
    output to fp32's summation order (1e-5), its pairs' arithmetic the same. 5 tokens over 4 experts at top-2,
    every token on expert 0: a run longer than P, padded slots; w13's K = 96 in 32-wide steps, groups of 16 (two a
    step), w2's K = 24 (a step cut short, one group); one token's activations 10x the others' (each pair's own
    scale)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without CUDA (tests/triton_kernels.py)")
    for name, emulation in (("_pack_f16x2", _emulated_pack), ("_word_dots", _emulated_word_dots),
                            ("_word_halves", _emulated_word_halves), ("_halves_dots", _emulated_halves_dots)):
        monkeypatch.setattr(qt, name, emulation)
    monkeypatch.setattr(fq, "use_f16_dots", lambda setting, method, *rest: bool(setting) and method == "int4")
    g = torch.Generator().manual_seed(int(zero_point))
    w13 = quantize_int4(torch.randn(4, 2 * 24, 96, generator=g) / 10, 16, zero_point=zero_point)
    w2 = quantize_int4(torch.randn(4, 96, 24, generator=g) / 5, 32, zero_point=zero_point)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16).float()
    x[3] *= 10
    logits = torch.randn(5, 4, generator=g)
    logits[:, 0] += 10
    weights, ids = torch.softmax(logits, -1).topk(2)
    ref = fused_moe_ref(x.double(), w13.dequantize(torch.float64), w2.dequantize(torch.float64), weights.double(), ids)
    rel = ref.abs().amax(-1, keepdim=True)  # each token's own range

    def error(out):
        return ((out.double() - ref).abs() / rel).max().item()

    cfg = fq.QuantGemvConfig(block_n=8, block_k=32)
    assert error(fq.fused_moe_quant(x, w13, w2, weights, ids, path="gemv", config=cfg)) < 1e-5
    pair = fq.fused_moe_quant(x, w13, w2, weights, ids, path="gemv", config=dataclasses.replace(cfg, f16_dots=True))
    assert 1e-5 < error(pair) < 1e-2
    for P in (2, 4):
        runs = fq.fused_moe_quant(x, w13, w2, weights, ids, path="runs",
                                  config=dataclasses.replace(cfg, f16_dots=True, run_pairs=P))
        assert ((runs - pair).abs() / rel).max().item() < 1e-5, P


class _Launches:
    """Stands in for a Triton kernel: `kernel[grid](*args, **constexprs)` records the constexprs, launches nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("f16_dots", [True, False, None])
def test_run_launcher_passes_the_switch(monkeypatch, f16_dots):
    """path 'runs': each run GEMV gets F16_DOTS as use_f16_dots decides it from the config's f16_dots and its own
    weight (method, group, K, tile), and CHUNKS counted for that form (run_chunks: at least a word a chunk with
    packed halves). use_f16_dots is replaced by one that ignores the device, so the choice shows on the CPU."""
    asked = []

    def decide(setting, method, device_type, scale_k, K, block_k):
        asked.append((setting, method, scale_k, K, block_k))
        return bool(setting) and K == 64  # on for w13 only (K = H = 64): the kernels must not share one answer

    gate_up, down = _Launches(), _Launches()
    monkeypatch.setattr(fq, "use_f16_dots", decide)
    monkeypatch.setattr(fq, "_qgate_up_runs_kernel", gate_up)
    monkeypatch.setattr(fq, "_qdown_runs_kernel", down)
    g = torch.Generator().manual_seed(0)
    w13 = quantize_int4(torch.randn(4, 2 * 96, 64, generator=g), 16, zero_point=True)
    w2 = quantize_int4(torch.randn(4, 64, 96, generator=g), 32, zero_point=True)
    x = torch.randn(3, 64, generator=g)
    weights, ids = torch.softmax(torch.randn(3, 4, generator=g), -1).topk(2)
    cfg = fq.QuantGemvConfig(block_n=4, block_k=32, run_pairs=2, f16_dots=f16_dots)
    fq.fused_moe_quant(x, w13, w2, weights, ids, path="runs", config=cfg)
    assert asked == [(f16_dots, "int4", 16, 64, 32), (f16_dots, "int4", 32, 96, 32)]
    (kw13,), (kw2,) = gate_up.calls, down.calls
    assert kw13["F16_DOTS"] is bool(f16_dots) and kw2["F16_DOTS"] is False
    assert kw13["CHUNKS"] == qt.run_chunks(16, 64, 32, bool(f16_dots)) and kw2["CHUNKS"] == qt.run_chunks(32, 96, 32)


def test_run_chunks_hold_whole_words():
    """The run GEMV's chunks: a lane's share of a 1024-wide tile within a group either way; at narrow tiles the
    fp32 dot's chunks may be a column, the packed-half dot's a word at the least; one chunk where a group spans
    the tile."""
    assert qt.run_chunks(128, 4096, 1024) == qt.run_chunks(128, 4096, 1024, True) == 32
    assert qt.run_chunks(16, 64, 32) == 32 and qt.run_chunks(16, 64, 32, True) == 4
    assert qt.run_chunks(4096, 4096, 1024, True) == qt.run_chunks(128, 4096, 64, True) == 1


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
    _check_f16_dots(x, q13, q2, weights / weights.sum(-1, keepdim=True), ids, epilogue, "gemv",
                    fq.default_quant_gemv(q13))


def _check_f16_dots(x, q13, q2, weights, ids, epilogue, path, cfg):
    """fused_moe_quant on path with cfg's f16_dots on, against fp32 math on the dequantized weights: within the fp32
    dots' error plus 1e-3 of the output's range, and not equal to the fp32 dots' output."""
    f16 = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, config=dataclasses.replace(cfg, f16_dots=True),
                             **epilogue).float()
    fp32 = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, config=dataclasses.replace(cfg, f16_dots=False),
                              **epilogue).float()
    oracle = _moe_ref(x, q13, q2, weights, ids, epilogue)
    scale = oracle.abs().max().item()
    err, err_fp32 = (f16 - oracle).abs().max().item(), (fp32 - oracle).abs().max().item()
    assert err <= 1.5 * err_fp32 + 1e-3 * scale, (err, err_fp32, scale)
    assert not torch.equal(f16, fp32)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("outliers", [False, True])
def test_gpu_moe_runs_f16_dots(int4_experts, P, outliers):
    """The run GEMV with packed-half dots, P = 2 and 4 pairs a program, against fp32 math on the dequantized weights,
    as test_gpu_moe_gemv_f16_dots: 8 tokens routed mostly to 3 experts (runs longer than P, split over programs,
    and padded slots), activations with outliers (|x| to 5,000) in some tokens only, so each pair's own scale
    matters. And it is the packed-half path: its output differs from the fp32 dots'."""
    shape, q13, q2, epilogue = int4_experts
    E, H, I, k, _ = MOE_SHAPES[shape]
    T = 8
    torch.manual_seed(P)
    x = torch.randn(T, H, device="cuda")
    if outliers:
        x[::3, torch.randperm(H)[:8]] = 5000.0 * torch.sign(torch.randn(3, 8, device="cuda"))
    x = x.to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    logits[:, :3] += 4.0
    weights, ids = torch.softmax(logits, -1).topk(k)
    assert torch.bincount(ids.flatten()).max().item() > P  # a run longer than P
    _check_f16_dots(x, q13, q2, weights / weights.sum(-1, keepdim=True), ids, epilogue, "runs",
                    dataclasses.replace(fq.default_quant_gemv(q13), run_pairs=P))


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
    emulated = int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 128, min(shape.block_k, triton.next_power_of_2(K)))
    exact = linear_ref(x.double()[None], q.dequantize(torch.float64))[0]
    bound = f16_error_bound(q.codes, q.scales, x, 128)
    out = ql.quant_gemv(x[None].cuda(), q.to("cuda"), shape=shape)[0].double().cpu()  # (nn.Module.to moves q itself)
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
    test_gpu_moe_runs_f16_dots = _mark(test_gpu_moe_runs_f16_dots)
    test_gpu_projection_gemv_matches_emulation = _mark(test_gpu_projection_gemv_matches_emulation)
    test_gpu_projection_gemv_attention_shape = _mark(test_gpu_projection_gemv_attention_shape)
