"""Fused routing kernels (ops/fused_routing.py, ops/rms_norm_coarse_gate.py) against their references.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors at small shapes (fp32/fp16,
DESIGN.md section 6); with CUDA the same tests run compiled, and the `gpu` test checks the engine's
kernel path against its CPU path.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_routing_kernels.py
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.ops.reference import cluster_routing_ref, fused_routing_ref, rms_norm_coarse_gate_ref  # noqa: E402

_, fr, rc = kernel_modules("moekv.ops.rms_norm", "moekv.ops.fused_routing", "moekv.ops.rms_norm_coarse_gate")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")


def assert_same(out, ref):
    assert torch.equal(out[1].cpu(), ref[1].cpu())
    torch.testing.assert_close(out[0].cpu(), ref[0].cpu(), rtol=1e-5, atol=1e-6)


def adversarial_logits(T: int, E: int, n_group: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g) * 2
    size = E // n_group
    x[0] = 0.0  # all tied
    x[1, :size if n_group > 1 else E // 2] = -INF  # a disabled group (flat: half the experts)
    x[2, size:] = -INF  # one live group: the other kept groups win nothing
    x[3] = x[3].round()  # many ties
    x[4, 0], x[4, 1] = 30.0, 29.0  # both winners in group 0
    return x


@pytest.mark.parametrize("E,k,n_group,topk_group", [(8, 2, 1, 1), (16, 2, 4, 2), (12, 3, 3, 2), (64, 6, 8, 3),
                                                    (64, 8, 8, 8), (20, 1, 1, 1)])
@pytest.mark.slow
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_routing_kernel_matches_reference(E, k, n_group, topk_group, scoring):
    g = torch.Generator().manual_seed(E + k)
    logits = adversarial_logits(6, E, n_group, seed=E)
    bias = (torch.randn(E, generator=g) * 0.2).to(DEVICE)
    logits = logits.to(DEVICE)
    for kwargs in (dict(), dict(bias=bias, scaling_factor=2.5)):
        for renormalize in (True, False):
            out = fr.fused_routing(logits, k, renormalize, scoring, n_group=n_group, topk_group=topk_group, **kwargs)
            ref = fused_routing_ref(logits, k, renormalize, scoring, n_group=n_group, topk_group=topk_group, **kwargs)
            assert_same(out, ref)


def test_fused_routing_kernel_half_input_strides_and_empty():
    logits = torch.randn(6, 32, device=DEVICE)
    wide = torch.randn(6, 40, device=DEVICE)[:, :32]  # a row stride that is not E
    assert_same(fr.fused_routing(wide, 4, True, n_group=4, topk_group=2),
                fused_routing_ref(wide, 4, True, n_group=4, topk_group=2))
    half = logits.half()
    assert_same(fr.fused_routing(half, 2, True), fused_routing_ref(half, 2, True))
    w, ids = fr.fused_routing(logits[:0], 2, True)
    assert w.shape == (0, 2) and ids.dtype == torch.int64


def cluster_problem(E: int, C: int, H: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, H, generator=g) / math.sqrt(H) * 3
    experts = torch.randperm(E, generator=g).view(C, E // C)
    hidden = torch.randn(T, H, generator=g)
    scores = torch.randn(T, C, generator=g)
    return (hidden.to(DEVICE), scores.to(DEVICE), gate[experts].contiguous().to(DEVICE), experts.to(DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("E,C,H,k", [(16, 4, 48, 2), (12, 4, 40, 3), (64, 8, 72, 6), (8, 2, 17, 2)])
@pytest.mark.parametrize("max_clusters,margin", [(1, 0.0), (2, 0.25), (4, 0.0), (4, -0.5), (2, INF), (4, -INF)])
def test_cluster_routing_kernel_matches_reference(E, C, H, k, max_clusters, margin):
    max_clusters = min(max_clusters, C)
    hidden, scores, gbc, experts = cluster_problem(E, C, H, T=5, seed=E + H)
    scores[0] = 0.0  # tied clusters
    scores[1, 1:] = -INF  # only one cluster live
    bias = torch.randn(E, device=DEVICE) * 0.05
    for renormalize in (True, False):
        for kwargs in (dict(), dict(scoring="sigmoid", bias=bias, scaling_factor=2.5)):
            args = (hidden, scores, gbc, experts, k, renormalize, max_clusters, margin)
            assert_same(fr.fused_cluster_routing(*args, **kwargs), cluster_routing_ref(*args, **kwargs))


def test_cluster_routing_kernel_tied_logits_and_half_hidden():
    hidden, scores, gbc, experts = cluster_problem(16, 4, 32, T=6, seed=0)
    hidden[0] = 0.0  # every logit 0: candidates in (rank, position) order
    args = (hidden, scores, gbc, experts, 2, True, 3, 0.5)
    assert_same(fr.fused_cluster_routing(*args), cluster_routing_ref(*args))
    args = (hidden.half(), scores, gbc.half(), experts, 2, True, 3, 0.5)
    assert_same(fr.fused_cluster_routing(*args), cluster_routing_ref(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,C,bias", [(64, 4, True), (48, 3, False), (256, 8, True)])
def test_rms_norm_coarse_gate_matches_reference(dtype, H, C, bias):
    g = torch.Generator().manual_seed(H + C)
    x = (torch.randn(7, H, generator=g) * 3).to(DEVICE, dtype)
    x[0] = 0.0  # an all-zero row: eps keeps it finite
    x[1, :4] = 100.0  # outlier channels
    w = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype)
    cw = torch.randn(C, H, generator=g).to(DEVICE, dtype)
    cb = torch.randn(C, generator=g).to(DEVICE) if bias else None
    out, scores = rc.rms_norm_coarse_gate(x, w, 1e-5, cw, cb)
    ref_out, ref_scores = rms_norm_coarse_gate_ref(x, w, 1e-5, cw, cb)
    assert out.dtype == dtype and scores.dtype == torch.float32
    tol = 0 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol or 1e-6, atol=tol or 1e-6)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-3 if dtype == torch.float16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_kernel_path_matches_cpu(mixtral_ckpt, tmp_path):
    """Flat, group-limited and hierarchical routing on CUDA (kernels) give the CPU's logits."""
    from moekv import LLM
    from moekv.tools.cluster import build_cluster_map
    from tests.checkpoints import CORPUS

    cpu = LLM(mixtral_ckpt, dtype="float32", max_model_len=64)
    ids = cpu.tokenizer.encode(CORPUS, add_special_tokens=False)
    cmap, _ = build_cluster_map(cpu, ids[:300], 4, progress=False)
    path = cmap.save(tmp_path / "map.safetensors")
    prompt = [{"prompt_token_ids": ids[:24]}]
    for kwargs in (dict(routing="flat"), dict(routing="group_limited", n_group=4, topk_group=2),
                   dict(routing="hierarchical", cluster_map=path, cluster_admit_margin=0.5)):
        a = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, **kwargs).score(prompt)[0]
        b = LLM(mixtral_ckpt, dtype="float32", device="cuda", max_model_len=64, **kwargs).score(prompt)[0]
        assert (a - b).abs().max().item() < 1e-3, kwargs


@pytest.mark.parametrize("E,k,n_group,topk_group", [(16, 2, 4, 2), (64, 6, 8, 3)])
def test_fused_routing_kernel_group_max_matches_reference(E, k, n_group, topk_group):
    """DeepSeek-V2's group_limited_greedy (a group scored by its best expert) in the kernel as in
    the reference, ties and disabled groups included; it keeps other groups than top-2 sums do."""
    logits = adversarial_logits(6, E, n_group, seed=E + 1).to(DEVICE)
    for renormalize in (True, False):
        out = fr.fused_routing(logits, k, renormalize, "softmax", n_group=n_group, topk_group=topk_group,
                               group_score="max")
        assert_same(out, fused_routing_ref(logits, k, renormalize, "softmax", n_group=n_group,
                                           topk_group=topk_group, group_score="max"))
    # group 0: one strong expert; group 1: two fairly strong ones. max keeps group 0, top-2 sums group 1
    x = torch.full((1, 8), -5.0)
    x[0, 0], x[0, 4], x[0, 5] = 3.0, 2.5, 2.5
    pick = {score: fused_routing_ref(x, 1, False, n_group=2, topk_group=1, group_score=score)[1].item()
            for score in ("max", "top2_sum")}
    assert pick == {"max": 0, "top2_sum": 4}
