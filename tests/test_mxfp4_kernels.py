"""MXFP4 experts (gpt-oss's checkpoint layout kept in memory: QuantizedWeight "mxfp4") through the
quantized fused-MoE kernels (ops/fused_moe_quant.py) against the dequantized weights' references in
float64: fused_moe_ref, and with gpt-oss's expert biases and clamped SwiGLU clamped_swiglu_moe_ref.

Without CUDA the kernels run under TRITON_INTERPRET=1 at small shapes; the `gpu` tests take
gpt-oss-20b's expert shape (E=32, H=I=2880, top-4) in bf16, against the bf16 kernel on the
dequantized weights and fp32 math, and CUDA-graph capture.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_mxfp4_kernels.py
    python -m pytest -q -m gpu tests/test_mxfp4_kernels.py          # on the GPU machine
"""
from __future__ import annotations

import pytest
import torch

from moekv.engine.cuda_graphs import capture_after_warmup  # noqa: E402
from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# isort: split

from moekv.models.mxfp4 import FP4_VALUES, dequantize_mxfp4, empty_mxfp4, mxfp4_weight, quantize_mxfp4  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight  # noqa: E402
from moekv.ops.reference import clamped_swiglu_moe_ref, fused_moe_ref  # noqa: E402
from tests.test_quant_kernels import assert_quant_linear_near_fp32  # noqa: E402

_, fm, _, fq, ql = kernel_modules("moekv.ops.dense_gemv", "moekv.ops.fused_moe", "moekv.ops.quant_tiles",
                                  "moekv.ops.fused_moe_quant", "moekv.ops.quant_linear")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALPHA, LIMIT = 1.702, 0.7  # a limit the random pre-activations cross, so both clamps bind


def random_pair(shape: tuple[int, ...], g: torch.Generator, low: int = 118, high: int = 131):
    """Random MXFP4 bytes of a [..., N, K] weight on g's device: every code equally likely, scale
    exponents low .. high - 1 (default 2^-9 .. 2^3)."""
    *prefix, N, K = shape
    blocks = torch.randint(0, 256, (*prefix, N, K // 32, 16), dtype=torch.uint8, generator=g, device=g.device)
    scales = torch.randint(low, high, (*prefix, N, K // 32), dtype=torch.uint8, generator=g, device=g.device)
    return blocks, scales


def test_layout_matches_the_checkpoint_dequantizer():
    """QuantizedWeight "mxfp4" (the bytes viewed as int32) dequantizes to what models/mxfp4.py's
    dequantizer (checked against transformers' in test_gpt_oss.py) gives, scales 0 and 240 included."""
    g = torch.Generator().manual_seed(0)
    blocks, scales = random_pair((3, 5, 96), g)
    scales[0, 0, 0], scales[0, 1, 1] = 0, 240
    qw = mxfp4_weight(blocks, scales)
    assert qw.shape == (3, 5, 96) and qw.codes.shape == (3, 5, 12) and qw.codes.dtype == torch.int32
    assert qw.nbytes == blocks.numel() + scales.numel()
    ref = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(qw.dequantize(torch.float32), ref)
    assert torch.equal(qw[1].dequantize(torch.float32), ref[1])
    by_hand = torch.zeros(1, 1, 16, dtype=torch.uint8)
    by_hand[0, 0, 0] = 0x7 | (0xA << 4)  # feature 0: code 7 (6.0), feature 1: code 10 (-1.0)
    assert mxfp4_weight(by_hand, torch.tensor([[128]], dtype=torch.uint8)).dequantize()[0, :3].tolist() == [12.0, -2.0,
                                                                                                           0.0]


def test_mxfp4_weight_refuses_what_the_kernels_cannot_read():
    g = torch.Generator().manual_seed(1)
    blocks, scales = random_pair((4, 64), g)
    with pytest.raises(ValueError, match="beyond the kernels' range"):
        mxfp4_weight(blocks, torch.full_like(scales, 241))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_weight(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="mxfp4 weights hold int32 codes"):
        QuantizedWeight("mxfp4", (4, 64), torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 2), (1, 32))
    assert empty_mxfp4((2, 8, 64), "cpu").scales.shape == (2, 8, 2)


def test_every_code_and_scale_through_the_gemv():
    """Each of the 16 E2M1 codes (the subnormal 0.5 and -0 included) at scales from 2^-126 to 2^113,
    one per row, through the projection GEMV (the fp16 placement of the codes, the scale's 2^14)."""
    K = 64
    codes = torch.arange(16).repeat(K // 16)  # [K]
    exps = torch.tensor([1, 100, 120, 127, 140, 240], dtype=torch.uint8)
    pairs = codes.reshape(K // 2, 2)
    row = (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).reshape(K // 32, 16)
    blocks = row.expand(len(exps), -1, -1).contiguous()  # [N, K / 32, 16]: the same codes in every row
    scales = exps[:, None].expand(-1, K // 32).contiguous()  # a scale per row
    qw = mxfp4_weight(blocks, scales).to(DEVICE)
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)[codes]
    assert torch.equal(qw.dequantize(torch.float64)[3].cpu(), values)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = ql.quant_gemv(x, qw, shape=ql.QuantGemvShape(block_n=2, block_k=32)).double()
    ref = x.double() @ qw.dequantize(torch.float64).T  # [2, N]
    row_scale = (x.double().abs() @ qw.dequantize(torch.float64).abs().T)
    assert ((out - ref).abs() <= 1e-6 * row_scale).all()


def moe_case(T, E, k, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    q13 = mxfp4_weight(*random_pair((E, 2 * I, H), g)).to(DEVICE)
    q2 = mxfp4_weight(*random_pair((E, H, I), g)).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE)
    b13 = torch.randn(E, 2 * I, generator=g).to(DEVICE)
    b2 = torch.randn(E, H, generator=g).to(DEVICE)
    x = (torch.randn(T, H, generator=g) / 16).to(DEVICE)  # pre-activations of a few units: the clamps bind
    return x, q13, b13, q2, b2, weights, ids


GEMV = {"gemv-tile-scales": fq.QuantGemvConfig(block_n=8, block_k=32, num_splits=2),  # one scale a row and tile
        "gemv-group-scales": fq.QuantGemvConfig(block_n=8, block_k=64, num_splits=2)}  # two groups a tile
GEMM = {"gemm-tile-scales": fm.GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2),
        "gemm-element-scales": fm.GemmConfig(block_m=16, block_n=16, block_k=64, group_m=1, num_warps=4,
                                             num_stages=2)}


# the interpreter takes 5-20 s a case: the GEMV's group-scale case and the GEMMs' (gemm, gemm_swap) element-scale
# cases run in the fast suite (one per path and scale reading), the other tile-scale ones in the slow one
SLOW_CASES = {"gemv-tile-scales", "gemm-tile-scales"}


@pytest.mark.parametrize("name,path,config",
                         [pytest.param(n, path, c, id=n, marks=[pytest.mark.slow] if n in SLOW_CASES else [])
                          for path, table in (("gemv", GEMV), ("gemm", GEMM)) for n, c in table.items()]
                         + [pytest.param("swap-" + n, "gemm_swap", c, id="swap-" + n,
                                         marks=[pytest.mark.slow] if n in SLOW_CASES else [])
                            for n, c in GEMM.items()])
def test_fused_moe_mxfp4_matches_reference(name, path, config):
    """H = 96 (a partial last K tile at 64), I = 40 would not be whole groups: I = 64; T = 3, 6 experts, top-2."""
    x, q13, b13, q2, b2, weights, ids = moe_case(3 if path == "gemv" else 5, 6, 2, 96, 64)
    d13, d2 = q13.dequantize(torch.float64), q2.dequantize(torch.float64)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, config=config)
    ref = fused_moe_ref(x.double(), d13, d2, weights.double(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, config=config, biases=(b13, b2),
                             clamped_swiglu=(ALPHA, LIMIT))
    ref_oss = clamped_swiglu_moe_ref(x.double(), d13, b13.double(), d2, b2.double(), weights.double(), ids,
                                     ALPHA, LIMIT)
    assert (out.double() - ref_oss).abs().max().item() <= 1e-5 * max(1.0, ref_oss.abs().max().item())
    assert (ref_oss - ref).abs().max().item() > 1e-1  # the epilogues change the answer: the check above is not vacuous


@pytest.mark.parametrize("P", [2, 4])
def test_run_gemv_mxfp4_with_gpt_oss_epilogue(P):
    """The run GEMV (path 'runs') on MXFP4 experts, with and without gpt-oss's biases and clamped SwiGLU:
    T = 6 over 4 experts, top-2 (runs longer than P), groups of 32 inside 64-wide K tiles."""
    x, q13, b13, q2, b2, weights, ids = moe_case(6, 4, 2, 96, 64, seed=5)
    d13, d2 = q13.dequantize(torch.float64), q2.dequantize(torch.float64)
    config = fq.QuantGemvConfig(block_n=8, block_k=64, num_splits=2, run_pairs=P)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="runs", config=config)
    ref = fused_moe_ref(x.double(), d13, d2, weights.double(), ids)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="runs", config=config, biases=(b13, b2),
                             clamped_swiglu=(ALPHA, LIMIT))
    ref_oss = clamped_swiglu_moe_ref(x.double(), d13, b13.double(), d2, b2.double(), weights.double(), ids,
                                     ALPHA, LIMIT)
    assert (out.double() - ref_oss).abs().max().item() <= 1e-5 * max(1.0, ref_oss.abs().max().item())
    assert (ref_oss - ref).abs().max().item() > 1e-1  # the epilogues change the answer


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_epilogues_with_fp8_and_int4_experts(method):
    """The biases and clamped SwiGLU are the quantized kernels' epilogues for every weight kind
    (gpt-oss with quantization='fp8' / 'int4' on CUDA); fused_experts passes them through."""
    from moekv.models.quantize import quantize_stacked

    x, q13, b13, q2, b2, weights, ids = moe_case(3, 6, 2, 64, 32, seed=3)
    w13, w2 = (quantize_stacked(q.dequantize(torch.float32), method) for q in (q13, q2))
    ref = clamped_swiglu_moe_ref(x.double(), w13.dequantize(torch.float64), b13.double(), w2.dequantize(torch.float64),
                                 b2.double(), weights.double(), ids, ALPHA, LIMIT)
    runs = fq.QuantGemvConfig(block_n=8, block_k=32, num_splits=2, run_pairs=2)
    for path, config in (("gemv", GEMV["gemv-tile-scales"]), ("gemm", GEMM["gemm-tile-scales"]), ("runs", runs)):
        out = fq.fused_moe_quant(x, w13, w2, weights, ids, path=path, config=config, biases=(b13, b2),
                                 clamped_swiglu=(ALPHA, LIMIT))
        assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), path
    # the reference path of a quantized layer on the CPU takes QuantizedWeights too
    assert torch.allclose(clamped_swiglu_moe_ref(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT).double(), ref,
                          atol=1e-4)


def test_quantized_quantizer_round_trip_loads_as_mxfp4():
    """quantize_mxfp4's bytes (the test checkpoints') build a weight that dequantizes to them."""
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(mxfp4_weight(blocks, scales).dequantize(), dequantize_mxfp4(blocks, scales, torch.float32))


# -- compiled, gpt-oss-20b's expert shape -----------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
E20, H20, I20, K20 = 32, 2880, 2880, 4


@pytest.fixture(scope="module")
def gpt_oss_20b_experts():
    """gpt-oss-20b-shaped MXFP4 experts (random codes, scales 2^-8 .. 2^-6: weights of about 0.02),
    their biases, and the same experts dequantized to bf16 (the dequantize-on-load path)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q13 = mxfp4_weight(*random_pair((E20, 2 * I20, H20), g, 119, 122))
    q2 = mxfp4_weight(*random_pair((E20, H20, I20), g, 119, 122))
    b13 = (torch.randn(E20, 2 * I20, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E20, H20, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    return q13, q2, b13, b2, q13.dequantize(torch.bfloat16), q2.dequantize(torch.bfloat16)


def _route(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H20, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = torch.randn(T, E20, device="cuda", generator=g).topk(K20)
    return x, torch.softmax(weights, -1), ids


@pytest.mark.parametrize("path", [None, "gemv", "gemm", "gemm_swap"])
@pytest.mark.parametrize("T", [1, 4, 8])
def test_gpu_gpt_oss_20b_shape(gpt_oss_20b_experts, T, path):
    """bf16 activations, biases and the clamped SwiGLU (gpt-oss's limit 7): the MXFP4 kernel within
    1.5x the error of the bf16 kernel on the dequantized weights (the dequantize-on-load path), both
    against fp32 math on those weights."""
    q13, q2, b13, b2, d13, d2 = gpt_oss_20b_experts
    if path == "gemv" and T * K20 > fq.GEMV_MAX_PAIRS:
        pytest.skip("the GEMV path is for T*k <= GEMV_MAX_PAIRS")
    x, weights, ids = _route(T, T)
    epilogue = dict(biases=(b13, b2), clamped_swiglu=(1.702, 7.0))
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, **epilogue).float()
    bf16 = fm.fused_moe(x, d13, d2, weights, ids, path="gemm" if path == "gemm_swap" else path, **epilogue).float()
    oracle = clamped_swiglu_moe_ref(x.float(), d13.float(), b13.float(), d2.float(), b2.float(), weights, ids,
                                    1.702, 7.0)
    scale = oracle.abs().max().item()
    err, err_bf16 = (out - oracle).abs().max().item(), (bf16 - oracle).abs().max().item()
    assert err <= max(1.5 * err_bf16, 1e-2 * scale), (err, err_bf16, scale)


@pytest.mark.parametrize("T", [1, 8])
def test_gpu_gpt_oss_20b_graph_capture(gpt_oss_20b_experts, T):
    """No host sync: the MXFP4 step captures, and a replay with new routing gives the eager answer."""
    q13, q2, b13, b2, _, _ = gpt_oss_20b_experts
    x, weights, ids = _route(T, 10 + T)

    def step():
        return fq.fused_experts(x, q13, q2, weights, ids, biases=(b13, b2), clamped_swiglu=(1.702, 7.0))

    graph, out = capture_after_warmup(step)
    new_x, new_w, new_ids = _route(T, 20 + T)
    x.copy_(new_x)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


def test_gpu_projection_gemv_reads_mxfp4():
    """The projection GEMV (ops/quant_linear.py) on an MXFP4 [2880, 2880] matrix against fp32 math."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(5)
    qw = mxfp4_weight(*random_pair((H20, H20), g, 119, 122))
    x = torch.randn(1, H20, device="cuda", generator=g).to(torch.bfloat16)
    assert_quant_linear_near_fp32(ql, x, qw)


for _mark in gpu:
    test_gpu_gpt_oss_20b_shape = _mark(test_gpu_gpt_oss_20b_shape)
    test_gpu_gpt_oss_20b_graph_capture = _mark(test_gpu_gpt_oss_20b_graph_capture)
    test_gpu_projection_gemv_reads_mxfp4 = _mark(test_gpu_projection_gemv_reads_mxfp4)
