"""Fused MoE (moekv/ops/fused_moe.py): the align step and both kernel paths against float64 references.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors at small shapes (fp32/fp16;
bf16 dots are cast up there, DESIGN.md section 6); with CUDA the same grid runs compiled, and the
`gpu` tests add Mixtral-8x7B expert shapes in bf16 and CUDA-graph capture.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_fused_moe.py
    python -m pytest -q -m gpu tests/test_fused_moe.py          # on the GPU machine
"""
from __future__ import annotations

import pytest
import torch

from moekv.engine.cuda_graphs import capture_after_warmup  # noqa: E402
from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.ops.reference import fused_moe_ref, moe_align_block_size_ref  # noqa: E402

_, fm = kernel_modules("moekv.ops.dense_gemv", "moekv.ops.fused_moe")  # fused_moe uses dense_gemv.row_dots

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL_GEMM = fm.GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
SMALL_GEMV = fm.GemvConfig(block_n=16, block_k=16, num_splits=2)  # row sums, the default


def route(T: int, E: int, k: int, pattern: str, seed: int):
    """(weights [T, k] fp32, expert_ids [T, k] int64) with distinct experts per token.
    pattern: "random" | "one" (every token's first choice is expert E-1; experts go empty)."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T
           else torch.empty(0, k, dtype=torch.int64))
    if pattern == "one" and T:
        ids = torch.stack([torch.cat([torch.tensor([E - 1]),
                                      torch.tensor([e for e in row.tolist() if e != E - 1][:k - 1], dtype=torch.int64)])
                           for row in ids])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    return weights.to(DEVICE), ids.to(DEVICE)


def experts(E: int, H: int, I: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    return w13.to(DEVICE), w2.to(DEVICE)


def check(T, E, k, H, I, dtype, pattern="random", seed=0, **kw):
    w13, w2 = experts(E, H, I, seed)
    weights, ids = route(T, E, k, pattern, seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(DEVICE)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    # the oracle: float64 on the same rounded inputs
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = fm.fused_moe(x, w13, w2, weights, ids, **kw)
    assert out.shape == (T, H) and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    err = (out.double() - ref).abs().max().item() if T else 0.0
    assert err <= tol * max(1.0, ref.abs().max().item()), (err, ref.abs().max().item())
    return out


# -- the align step ---------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E,k,block_m,pattern", [
    (1, 8, 2, 16, "random"), (3, 4, 1, 4, "random"), (17, 8, 2, 16, "random"), (17, 4, 2, 4, "one"),
    (40, 8, 2, 8, "one"), (64, 8, 2, 16, "random"), (5, 16, 2, 1, "random"), (0, 4, 2, 16, "random"),
])
def test_align_matches_reference_and_invariants(T, E, k, block_m, pattern):
    _, ids = route(T, E, k, pattern, seed=T + E)
    sorted_ids, block_experts, post = fm.moe_align_block_size(ids, E, block_m)
    ref = moe_align_block_size_ref(ids.cpu(), E, block_m)
    for got, want in zip((sorted_ids, block_experts, post), ref):
        assert torch.equal(got.cpu(), want)
    M, used = T * k, int(post.item())
    flat = ids.reshape(-1).cpu()
    s = sorted_ids.cpu()
    assert s.numel() == block_experts.numel() * block_m >= used and used % block_m == 0
    real = s[s < M]
    assert sorted(real.tolist()) == list(range(M))  # every (token, slot) exactly once
    assert bool((s[used:] == M).all()) and bool((block_experts.cpu()[used // block_m:] == -1).all())
    counts = torch.bincount(flat, minlength=E)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    for b, e in enumerate(block_experts.cpu()[:used // block_m].tolist()):
        rows = s[b * block_m:(b + 1) * block_m]
        rows = rows[rows < M]
        assert rows.numel() > 0 and bool((flat[rows.long()] == e).all())  # no block is all padding
    assert block_experts.cpu()[:used // block_m].diff().ge(0).all()


# -- the kernels ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_matches_reference(T, E, k, dtype):
    """H, I off the block sizes; the path the launcher picks, with small blocks so that every grid
    has several blocks along M, N and K; at T <= 3 also the other path."""
    H, I = 40, 24
    cfg = SMALL_GEMV if T * k <= fm.GEMV_MAX_PAIRS else SMALL_GEMM
    check(T, E, k, H, I, dtype, seed=T * 10 + E + k, config=cfg)
    if T <= 3:
        check(T, E, k, H, I, dtype, seed=T * 10 + E + k, path="gemm", config=SMALL_GEMM)


FOLD_GEMV = fm.GemvConfig(block_n=16, block_k=16, fold_slots=True)


@pytest.mark.slow
@pytest.mark.parametrize("T,k", [(1, 1), (1, 2), (3, 2), (5, 3)])
@pytest.mark.parametrize("H,I", [(40, 24), (32, 64)])  # off and on the block sizes
def test_gemv_with_slots_folded_into_the_down_projection(T, k, H, I):
    """fold_slots: one program per (token, n-block) sums the k slots and writes the output dtype."""
    check(T, 8, k, H, I, torch.float32, seed=T + 7 * k + H, path="gemv", config=FOLD_GEMV)
    check(T, 8, k, H, I, torch.float16, seed=T + 7 * k + H, path="gemv", config=FOLD_GEMV)


TILE_GEMV = fm.GemvConfig(block_n=16, block_k=16, num_splits=2, row_sums=False)


@pytest.mark.slow
@pytest.mark.parametrize("T,k", [(1, 2), (3, 2)])
@pytest.mark.parametrize("H,I", [(40, 24), (32, 64)])  # off and on the block sizes
def test_gemv_with_a_tile_accumulator(T, k, H, I):
    """row_sums=False: products accumulate in an fp32 tile reduced once at the end (both GEMVs)."""
    check(T, 8, k, H, I, torch.float32, seed=T + 5 * k + H, path="gemv", config=TILE_GEMV)
    check(T, 8, k, H, I, torch.float16, seed=T + 5 * k + H, path="gemv", config=TILE_GEMV)


@pytest.mark.parametrize("path,cfg", [("gemm", SMALL_GEMM), ("gemv", SMALL_GEMV), ("gemv", fm.GemvConfig(16, 16, 3)),
                                      ("gemv", FOLD_GEMV), ("gemv", TILE_GEMV)])
@pytest.mark.slow
def test_all_tokens_to_one_expert(path, cfg):
    check(9, 8, 2, 32, 48, torch.float32, pattern="one", seed=3, path=path, config=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_default_configs_and_even_shapes(path):
    """Launch shapes chosen by the launcher; H, I multiples of the blocks (the unmasked loops)."""
    check(5, 4, 2, 128, 256, torch.float16, seed=5, path=path)


def test_path_selection_and_bf16():
    """T*k <= GEMV_MAX_PAIRS takes the GEMV; bf16 (what the GPU runs) through both paths."""
    check(2, 8, 2, 32, 32, torch.bfloat16, seed=7, config=SMALL_GEMV)
    check(20, 8, 2, 32, 32, torch.bfloat16, seed=7, config=SMALL_GEMM)


def test_empty_batch_and_bad_input():
    x = torch.randn(0, 32, device=DEVICE)
    w13, w2 = (t.float() for t in experts(4, 32, 16, 0))
    w, ids = route(0, 4, 2, "random", 0)
    assert fm.fused_moe(x, w13, w2, w, ids).shape == (0, 32)
    with pytest.raises(ValueError, match="shapes"):
        fm.fused_moe(torch.randn(1, 31, device=DEVICE), w13, w2, *route(1, 4, 2, "random", 0))
    with pytest.raises(ValueError, match="path"):
        fm.fused_moe(torch.randn(1, 32, device=DEVICE), w13, w2, *route(1, 4, 2, "random", 0), path="dense")


# -- compiled, Mixtral-8x7B expert shapes ---------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def mixtral_experts():
    E, H, I = 8, 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    return w13, w2


@pytest.mark.parametrize("path", [None, "gemm", "gemv"])
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_mixtral_shapes_bf16(mixtral_experts, T, path):
    """bf16 kernel vs the bf16 reference, both against fp32 math on the same bf16 weights."""
    w13, w2 = mixtral_experts
    torch.manual_seed(T)
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    weights = weights / weights.sum(-1, keepdim=True)
    out = fm.fused_moe(x, w13, w2, weights, ids, path=path).float()
    ref_bf16 = fused_moe_ref(x, w13, w2, weights, ids).float()
    used = ids.unique()
    remap = torch.full((8,), -1, dtype=ids.dtype, device="cuda")
    remap[used] = torch.arange(used.numel(), device="cuda")
    oracle = fused_moe_ref(x.float(), w13[used].float(), w2[used].float(), weights.float(), remap[ids])
    scale = oracle.abs().max().item()
    err, err_ref = (out - oracle).abs().max().item(), (ref_bf16 - oracle).abs().max().item()
    assert err <= max(1.5 * err_ref, 1e-2 * scale), (err, err_ref, scale)


@pytest.mark.parametrize("T", [1, 64])
def test_gpu_cuda_graph_capture(mixtral_experts, T):
    """No host sync anywhere: the step captures, and a replay with new routing gives new answers."""
    w13, w2 = mixtral_experts
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    graph, out = capture_after_warmup(lambda: fm.fused_moe(x, w13, w2, weights, ids))
    new_w, new_ids = torch.softmax(torch.randn(T, 8, device="cuda"), -1).topk(2)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    want = fm.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, want)


for _mark in gpu:
    test_gpu_mixtral_shapes_bf16 = _mark(test_gpu_mixtral_shapes_bf16)
    test_gpu_cuda_graph_capture = _mark(test_gpu_cuda_graph_capture)
