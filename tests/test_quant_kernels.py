"""Quantized-weight kernels (ops/fused_moe_quant.py, ops/quant_linear.py) against their references
(the dequantized weights through fused_moe_ref / F.linear, float64).

Without CUDA they run under TRITON_INTERPRET=1 at small shapes; the `gpu` tests add the
Mixtral-8x7B shapes in bf16 and CUDA-graph capture.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_quant_kernels.py
    python -m pytest -q -m gpu tests/test_quant_kernels.py          # on the GPU machine
"""
from __future__ import annotations

import pytest
import torch

from moekv.engine.cuda_graphs import capture_after_warmup  # noqa: E402
from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# isort: split

from moekv.models.quantize import quantize_stacked  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight, pack_int4, quantize_fp8, quantize_int4  # noqa: E402
from moekv.ops.reference import clamped_swiglu_moe_ref, fused_moe_ref, linear_ref  # noqa: E402

_, fm, _, fq, ql = kernel_modules("moekv.ops.dense_gemv", "moekv.ops.fused_moe", "moekv.ops.quant_tiles",
                                  "moekv.ops.fused_moe_quant", "moekv.ops.quant_linear")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUANTIZERS = {
    "fp8-channel": lambda w: quantize_fp8(w),
    "fp8-block": lambda w: quantize_fp8(w, (16, 32)),
    "int4-sym": lambda w: quantize_int4(w, 32),
    "int4-zp": lambda w: quantize_int4(w, 16, zero_point=True),
    "int4-g24": lambda w: quantize_int4(w, 24, zero_point=True),  # groups that neither divide nor span K tiles
}



def assert_quant_linear_near_fp32(ql, x: torch.Tensor, qw: QuantizedWeight) -> None:
    """ql.quant_linear(x, qw) against fp32 math on the dequantized weight: within 1.5x the plain-PyTorch
    reference's own error (or 1% of the output's range)."""
    out = ql.quant_linear(x, qw).float()
    oracle = x.float() @ qw.dequantize().T
    ref = linear_ref(x, qw).float()
    err, err_ref = (out - oracle).abs().max().item(), (ref - oracle).abs().max().item()
    assert err <= max(1.5 * err_ref, 1e-2 * oracle.abs().max().item()), (err, err_ref)

def _moe_case(T, E, k, H, I, quantizer, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    x = torch.randn(T, H, generator=g)
    q13, q2 = (QUANTIZERS[quantizer](w).to(DEVICE) for w in (w13, w2))
    return x.to(DEVICE), q13, q2, weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("path,T", [("gemv", 3), ("gemm", 5), ("gemm_swap", 5)])
def test_fused_moe_quant_matches_reference(quantizer, path, T):
    """H = 64 with 32-wide K tiles (several int4 groups per tile and a group spanning tiles);
    I = 40: a partial n-block and (down projection) a partial K tile and group."""
    x, q13, q2, weights, ids = _moe_case(T, 6, 2, 64, 40, quantizer)
    config = (fq.QuantGemvConfig(block_n=8, block_k=32, num_splits=2) if path == "gemv"
              else fm.GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2))
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path, config=config)
    ref = fused_moe_ref(x.double(), q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights.double(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("quantizer", ["int4-sym", "int4-zp", "fp8-channel"])
def test_swap_gemm_ragged_and_empty_experts(quantizer):
    """path 'gemm_swap' (the weight tile as the MMA's A operand, the pairs as its N) on a ragged load: every
    token's first slot on expert 1 (18 pairs: two 16-pair blocks, the second mostly padding), the second slot
    on experts 0, 2 and 3, experts 4 and 5 empty; against the float64 reference, with gpt-oss's biases and
    clamped SwiGLU and without, and equal to path 'gemm' up to the order of its sums. int4-sym reads one scale
    a row and tile, int4-zp (groups of 16 in 32-wide tiles) one per element."""
    g = torch.Generator().manual_seed(7)
    T, E, H, I = 18, 6, 64, 40
    ids = torch.stack([torch.ones(T, dtype=torch.int64), torch.tensor([0, 2, 3])[torch.arange(T) % 3]], 1)
    assert ids.reshape(-1).bincount(minlength=E).tolist() == [6, 18, 6, 6, 0, 0]
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    q13, q2 = (QUANTIZERS[quantizer](w).to(DEVICE) for w in (w13, w2))
    x = torch.randn(T, H, generator=g).to(DEVICE)
    weights = torch.softmax(torch.randn(T, 2, generator=g), -1).to(DEVICE)
    b13, b2 = torch.randn(E, 2 * I, generator=g).to(DEVICE), torch.randn(E, H, generator=g).to(DEVICE)
    ids = ids.to(DEVICE)
    d13, d2 = q13.dequantize(torch.float64), q2.dequantize(torch.float64)
    config = fm.GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemm_swap", config=config)
    ref = fused_moe_ref(x.double(), d13, d2, weights.double(), ids)
    assert (out.double() - ref).abs().max().item() < 1e-5
    unswapped = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemm", config=config)
    assert torch.allclose(out, unswapped, rtol=0, atol=1e-5)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemm_swap", config=config, biases=(b13, b2),
                             clamped_swiglu=(1.702, 7.0))
    ref_oss = clamped_swiglu_moe_ref(x.double(), d13, b13.double(), d2, b2.double(), weights.double(), ids, 1.702, 7.0)
    assert (out.double() - ref_oss).abs().max().item() < 1e-5 * max(1.0, ref_oss.abs().max().item())
    assert (ref_oss - ref).abs().max().item() > 1e-1  # the epilogue changes the answer


def test_default_swap_config_by_rows():
    """gemm_swap's launch: the pairs a block (the MMA's N) grow with the pairs an expert, so that an expert's
    usual load takes one block; the weight rows a block fill the warp groups' 64-row MMAs."""
    configs = [fq.default_swap_config(rows * 8, 8) for rows in (2, 12, 16, 24, 32, 64, 200)]
    assert [c.block_m for c in configs] == [16, 16, 32, 32, 64, 64, 64]
    assert all(c.block_n % (16 * c.num_warps) == 0 for c in configs)


def _routing(T, E, k, kind, g):
    """topk_ids [T, k]: "random" (distinct experts a token, repeats across tokens), "one" (every pair on
    expert E - 1, k = 1), "long" (slot 0 of every token on expert 1: a run longer than P = 2 or 4)."""
    if kind == "one":
        return torch.full((T, 1), E - 1, dtype=torch.int64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "long":
        ids[:, 0] = 1
        ids[:, 1:] = torch.where(ids[:, 1:] == 1, 0, ids[:, 1:])
    return ids


@pytest.mark.parametrize("topk,E,P", [(1, 4, 2), (2, 8, 2), (2, 8, 4), (3, 6, 4), (2, 3, 8), (2, 8, 16)])
@pytest.mark.parametrize("T", [1, 5, 16, 64])
def test_moe_align_small_is_moe_align_block_size(topk, E, P, T):
    """The one-program sort gives moe_align_block_size's sorted_ids and block experts element for element
    (runs padded to P, the sentinel M, -1 past the padded length), for random routing and every pair on one
    expert; more than ALIGN_MAX_PAIRS pairs are refused."""
    g = torch.Generator().manual_seed(T * 100 + E)
    if T * topk > fm.ALIGN_MAX_PAIRS:
        with pytest.raises(ValueError, match="at most"):
            fm.moe_align_small(_routing(T, E, topk, "random", g), E, P)
        return
    for kind in ("random", "one"):
        ids = _routing(T, E, topk, kind, g).to(DEVICE)
        sorted_ids, block_expert, _ = fm.moe_align_block_size(ids, E, P)
        small_ids, small_expert = fm.moe_align_small(ids, E, P)
        assert torch.equal(sorted_ids, small_ids) and torch.equal(block_expert, small_expert), kind


RUN_CASES = [  # (quantizer, T, k, routing, P): tiles 8 x 32 at H = 64, I = 40 (partial n-block, K tile, group)
    ("int4-zp", 1, 2, "random", 2),
    ("int4-zp", 8, 2, "random", 2),  # 16 pairs over 6 experts: runs of up to ~6 split over programs
    ("int4-sym", 5, 2, "long", 4),  # a run of 5 > P
    ("int4-g24", 3, 2, "random", 4),  # groups that neither divide nor span the K tiles: per-element scales
    ("fp8-channel", 6, 2, "long", 2),
    ("fp8-block", 4, 2, "random", 2),
    ("int4-zp", 7, 1, "one", 4),  # every pair on one expert
    ("int4-zp", 2, 2, "random", 8),
]


@pytest.mark.parametrize("quantizer,T,k,routing,P", RUN_CASES)
def test_run_gemv_matches_reference(quantizer, T, k, routing, P):
    """path 'runs' against the float64 reference on the dequantized weights: repeated experts, runs longer
    than P (several programs a run), every pair on one expert, each scale reading."""
    g = torch.Generator().manual_seed(T * 10 + k)
    E, H, I = 6, 64, 40
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = _routing(T, E, k, routing, g)
    weights = torch.softmax(torch.randn(T, ids.shape[1], generator=g), -1)
    x = torch.randn(T, H, generator=g)
    q13, q2 = (QUANTIZERS[quantizer](w).to(DEVICE) for w in (w13, w2))
    x, weights, ids = x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    config = fq.QuantGemvConfig(block_n=8, block_k=32, num_splits=2, run_pairs=P)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="runs", config=config)
    ref = fused_moe_ref(x.double(), q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights.double(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_run_gemv_decodes_every_int4_code_at_default_tiles():
    """The run GEMV at its default tiles (16 x 1024: one K step past K, masked; groups of 32 inside the tile,
    scaled a chunk at a time) decodes each nibble position's 16 codes exactly, for 2 and 4 pairs a program."""
    x, q13, q2, weights, ids, ref = _every_code_case(E=3, T=5, seed=4)
    for P in (2, 4):
        out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="runs", config=fq.QuantGemvConfig(16, run_pairs=P))
        assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), P


def test_default_path_and_run_pairs():
    """path=None: the pair GEMV while pairs share few experts; where runs average two pairs (Mixtral's T=8)
    int4 takes the run GEMV and fp8 / mxfp4 the grouped GEMM, as bf16 does; past GEMV_MAX_PAIRS the GEMM
    (int4 its transposed form). P the mean run rounded up, 2 to 4."""
    assert [fq.default_path(2 * T, 8, "int4") for T in (1, 2, 4, 8, 16)] == [
        "gemv", "gemv", "gemv", "runs", "gemm_swap"]
    assert [fq.default_path(2 * T, 8, "fp8") for T in (1, 2, 4, 8, 16)] == ["gemv", "gemv", "gemv", "gemm", "gemm"]
    assert [fm.default_path(2 * T, 8) for T in (1, 2, 4, 8, 16)] == ["gemv", "gemv", "gemv", "gemm", "gemm"]
    assert fq.mean_run(16, 8) == 2.0
    assert fq.default_path(16, 32, "mxfp4") == "gemv"  # gpt-oss-20b at T=4: 16 pairs over 32 experts
    assert [fq.default_run_pairs(M, 8) for M in (2, 16, 32, 64, 128)] == [2, 2, 4, 4, 4]
    x, q13, q2, weights, ids = _moe_case(2, 4, 2, 32, 16, "int4-sym")
    with pytest.raises(ValueError, match="power of 2"):
        fq.fused_moe_quant(x, q13, q2, weights, ids, path="runs", config=fq.QuantGemvConfig(run_pairs=3))


def _every_code_int4(E, N, K, group, seed):
    """int4 weights whose codes take all 16 values at each of a word's 8 nibble positions (code (n + k + e) % 16),
    with random scales and zero points in groups of `group`."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.arange(N)[:, None] + torch.arange(K)[None, :] + torch.arange(E)[:, None, None]) % 16
    scales = torch.rand(E, N, -(-K // group), generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, scales.shape, generator=g).float()
    return QuantizedWeight("int4", (E, N, K), pack_int4(codes), scales, (1, group), zeros).to(DEVICE)


def _every_code_case(E, T, seed, H=64, I=40, k=2):
    """A top-k MoE case on _every_code_int4 experts (every code at every nibble position, gate/up and down):
    x, w13, w2, topk weights, ids, and the float64 reference output."""
    q13, q2 = _every_code_int4(E, 2 * I, H, 32, 1), _every_code_int4(E, H, I, 32, 2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE)
    ref = fused_moe_ref(x.double(), q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights.double(), ids)
    return x, q13, q2, weights, ids, ref


def test_int4_gemv_default_tiles_decode_every_code():
    """The default packed GEMV tiles (16 x 1024: one K step past K, masked) decode each nibble position's
    16 codes exactly (the planes' float trick and their joins' order), gate/up and down."""
    assert fq.default_quant_gemv(_every_code_int4(1, 8, 64, 32, 0)) == fq.DEFAULT_PACKED_GEMV
    x, q13, q2, weights, ids, ref = _every_code_case(E=4, T=3, seed=3)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path="gemv")
    assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


def test_gemv_scale_modes_cover_the_layouts():
    """With 32-wide K tiles the GEMV cases above read scales per tile (per channel, fp8 blocks, int4
    groups of 32), per group (int4 groups of 16) and per element (groups of 24)."""
    qt = kernel_modules("moekv.ops.quant_tiles")[0]
    assert qt.scale_mode(64, 64, 32) == qt.scale_mode(40, 40, 32) == qt.scale_mode(32, 64, 32) == qt.SCALES_PER_TILE
    assert qt.scale_mode(16, 64, 32) == qt.SCALES_PER_GROUP
    assert qt.scale_mode(24, 64, 32) == qt.SCALES_PER_ELEMENT
    assert qt.scale_mode(128, 4096, 1024) == qt.SCALES_PER_GROUP  # int4 at Mixtral's default GEMV tiles
    assert qt.scale_mode(4096, 4096, 1024) == qt.SCALES_PER_TILE  # fp8 per channel


def test_fused_experts_dispatch_and_mismatch():
    x, q13, q2, weights, ids = _moe_case(2, 4, 2, 32, 16, "int4-sym")
    assert torch.equal(fq.fused_experts(x, q13, q2, weights, ids), fq.fused_moe_quant(x, q13, q2, weights, ids))
    with pytest.raises(ValueError, match="both be quantized"):
        fq.fused_experts(x, q13, q2.dequantize(), weights, ids)
    with pytest.raises(ValueError, match="shapes do not match"):
        fq.fused_moe_quant(x[:, :16], q13, q2, weights, ids)


@pytest.mark.parametrize("quantizer", ["fp8-block", "int4-zp", "int4-g24"])
@pytest.mark.parametrize("T", [1, 3])
def test_quant_gemv_and_gemm_match_reference(quantizer, T):
    g = torch.Generator().manual_seed(T)
    w = QUANTIZERS[quantizer](torch.randn(36, 96, generator=g)).to(DEVICE)
    x, bias = torch.randn(T, 96, generator=g).to(DEVICE), torch.randn(36, generator=g).to(DEVICE)
    ref = linear_ref(x.double(), w.dequantize(torch.float64), bias.double())
    out = ql.quant_gemv(x, w, bias, ql.QuantGemvShape(block_n=4, block_k=32))
    assert (out.double() - ref).abs().max().item() < 1e-5
    gemm = fq.quant_gemm(x, w, fm.GemmConfig(16, 16, 32, 1, 4, 2)) + bias
    assert (gemm.double() - ref).abs().max().item() < 1e-5


def test_quant_linear_on_cpu_is_the_reference():
    w = quantize_int4(torch.randn(8, 32), 16)
    x = torch.randn(2, 32)
    assert torch.equal(ql.quant_linear(x, w), linear_ref(x, w))
    with pytest.raises(ValueError, match="do not match"):
        ql.quant_gemv(torch.randn(1, 16), w)


# -- compiled, Mixtral-8x7B shapes ------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["fp8", "int4"])
def mixtral_quant(request):
    E, H, I = 8, 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    return quantize_stacked(w13, request.param), quantize_stacked(w2, request.param)  # quantize-on-load's layouts


def _oracle(x, q13, q2, weights, ids):
    """fp32 math on the dequantized weights of the experts used only (memory)."""
    used = ids.unique()
    remap = torch.full((8,), -1, dtype=ids.dtype, device="cuda")
    remap[used] = torch.arange(used.numel(), device="cuda")
    w13 = torch.stack([q13[e].dequantize() for e in used.tolist()])
    w2 = torch.stack([q2[e].dequantize() for e in used.tolist()])
    return fused_moe_ref(x.float(), w13, w2, weights.float(), remap[ids])


@pytest.mark.parametrize("path", [None, "gemm", "gemm_swap", "gemv", "runs"])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_mixtral_shapes(mixtral_quant, T, path):
    """bf16 activations: the kernel within 1.5x the bf16 reference's error against fp32 math (the run
    GEMV at T = 64 with 128 pairs, ALIGN_MAX_PAIRS)."""
    q13, q2 = mixtral_quant
    if path == "gemv" and T * 2 > fq.GEMV_MAX_PAIRS:
        pytest.skip("the GEMV path is for T*k <= GEMV_MAX_PAIRS")
    torch.manual_seed(T)
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    weights = weights / weights.sum(-1, keepdim=True)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, path=path).float()
    ref = fused_moe_ref(x, q13, q2, weights, ids).float()
    oracle = _oracle(x, q13, q2, weights, ids)
    scale = oracle.abs().max().item()
    err, err_ref = (out - oracle).abs().max().item(), (ref - oracle).abs().max().item()
    assert err <= max(1.5 * err_ref, 1e-2 * scale), (err, err_ref, scale)


@pytest.mark.parametrize("T,path", [(1, None), (64, None), (8, "runs"), (8, "gemv"), (64, "gemm_swap")])
def test_gpu_cuda_graph_capture(mixtral_quant, T, path):
    """No host sync: the step captures, and a replay with new routing gives the eager answer (the run
    GEMV's sort included)."""
    q13, q2 = mixtral_quant
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    graph, out = capture_after_warmup(lambda: fq.fused_moe_quant(x, q13, q2, weights, ids, path=path))
    new_w, new_ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fq.fused_moe_quant(x, q13, q2, weights, ids, path=path))


@pytest.mark.parametrize("method", ["fp8", "int4"])
@pytest.mark.parametrize("T", [1, 4, 100])
def test_gpu_quant_linear_attention_shapes(method, T):
    """Mixtral-8x7B's qkv projection [6144, 4096]: GEMV (T <= 16) and GEMM against fp32 math."""
    w = (torch.randn(6144, 4096, device="cuda") * 4096 ** -0.5).to(torch.bfloat16)
    qw = quantize_fp8(w) if method == "fp8" else quantize_int4(w, zero_point=True)
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    assert_quant_linear_near_fp32(ql, x, qw)


for _mark in gpu:
    test_gpu_mixtral_shapes = _mark(test_gpu_mixtral_shapes)
    test_gpu_cuda_graph_capture = _mark(test_gpu_cuda_graph_capture)
    test_gpu_quant_linear_attention_shapes = _mark(test_gpu_quant_linear_attention_shapes)
