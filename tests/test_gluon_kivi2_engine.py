"""kivi2 pools in the Gluon kernel's fragment order (MOEKV_DECODE_KERNEL; KIVI2Format.fragment_pages):
pages converted when written hold exactly what the slab pools hold, read back and attend the same
(CPU: the reference path over both, residual ring included); on a GPU (marked gpu) the engine's
attend takes the Gluon kernel and matches the reference path."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats import get_kv_format
from moekv.ops.gluon.kivi2_layout import FRAGMENT_FIELDS, fragment_bytes_per_page_head, to_fragment_order
from tests.test_gluon_int4_engine import decode_ctx

H, P, D = 2, 64, 128


def filled_pools(monkeypatch, choice, device="cpu", dtype=torch.float32, residual=128):
    """A kivi2 pool (MOEKV_DECODE_KERNEL=choice) whose pages 0..5 were filled from staging by
    quantize_filled_pages, staging and residual ring refilled with random tokens per sequence."""
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", choice)
    fmt = get_kv_format("kivi2", dtype, residual=residual)
    cache = fmt.allocate(8, H, P, D, torch.device(device), 3, dtype)
    g = torch.Generator().manual_seed(0)
    for fill_pages in ([0, 3, 5], [1, 4, 2]):  # two steps of three fills each
        for name in ("k", "v"):
            x = torch.randn(3, H, P, D, generator=g)
            if name == "k":
                x[..., 5] += 4
            cache[f"{name}_staging"].copy_(x.to(dtype))
        ctx = decode_ctx([P, P, P], [0, 1, 2], [[0], [1], [2]], device)
        ctx.fill_slots = torch.tensor([0, 1, 2], device=device)
        ctx.fill_pages = torch.tensor(fill_pages, device=device)
        fmt.quantize_filled_pages([cache], ctx)
    for name in ("k", "v"):
        cache[f"{name}_staging"].copy_(torch.randn(3, H, P, D, generator=g).to(dtype))
        if residual:
            cache[f"{name}_residual"].copy_(torch.randn(3, H, residual, D, generator=g).to(dtype) + 0.5)
    return fmt, cache


def test_fragment_pools_hold_what_slab_pools_hold(monkeypatch):
    fmt_s, slabs = filled_pools(monkeypatch, "triton")
    fmt_f, frag = filled_pools(monkeypatch, "gluon")
    assert "k_pages" in slabs.tensors and "k_pages" not in frag.tensors and "k_residual" in frag.tensors
    assert all(name in frag.tensors for name in FRAGMENT_FIELDS)
    want = to_fragment_order(fmt_s, slabs["k_pages"][:6], slabs["v_pages"][:6])
    for name in FRAGMENT_FIELDS:
        assert torch.equal(frag[name][:6], getattr(want, name)), name
    ids = torch.tensor([5, 0, 2])
    for kind in ("key", "value"):
        assert torch.equal(fmt_f.dequantize_pages(frag, kind, ids), fmt_s.dequantize_pages(slabs, kind, ids)), kind


@pytest.mark.parametrize("residual", [0, 128])
@pytest.mark.parametrize("window", [None, 70])
def test_fragment_pools_attend_as_slab_pools(monkeypatch, window, residual):
    """Decode attention (CPU: the reference path) over pages + staged newest page + residual ring: the
    same output from both pools."""
    fmt_s, slabs = filled_pools(monkeypatch, "triton", residual=residual)
    fmt_f, frag = filled_pools(monkeypatch, "gluon", residual=residual)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]])
    q = torch.randn(3, 4 * H, D, generator=torch.Generator().manual_seed(1))
    out_s = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    out_f = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    torch.testing.assert_close(out_f, out_s, rtol=1e-6, atol=1e-6)


def test_fragment_pool_accounting_and_choice(monkeypatch):
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "gluon")
    fmt = get_kv_format("kivi2", torch.float32)
    assert fmt.page_bytes(H, P, D) == H * fragment_bytes_per_page_head(fmt)
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "triton")
    assert fmt.page_bytes(H, P, D) == H * fragment_bytes_per_page_head(fmt)  # the same bytes, reordered
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "gluon")
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 2, torch.float32)
    side = sum(cache[n].numel() * cache[n].element_size()
               for n in ("k_staging", "v_staging", "k_residual", "v_residual"))
    assert cache.nbytes() - side == 4 * fmt.page_bytes(H, P, D)
    with pytest.raises(ValueError, match="block_size 64, head_dim 128"):
        fmt.allocate(4, H, 32, D, torch.device("cpu"), 2, torch.float32)
    with pytest.raises(ValueError, match="group 32"):
        get_kv_format("kivi2", torch.float32, group_size=64).allocate(4, H, P, D, torch.device("cpu"), 2,
                                                                      torch.float32)
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "auto")
    assert not fmt.fragment_pages(P, D, "cpu")  # auto: sm_90 CUDA devices only
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "triton")
    assert not fmt.fragment_pages(P, D)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
@pytest.mark.parametrize("residual", [0, 128])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_engine_attend_takes_the_gluon_kernel(monkeypatch, window, residual):
    """On CUDA a decode step over a fragment-order pool runs the Gluon kernel (staged page and ring as
    its extra split): it matches the reference path over the same pool and the Triton kernel over slabs."""
    import moekv.ops.gluon.kivi2_decode as gluon_decode

    fmt_f, frag = filled_pools(monkeypatch, "gluon", "cuda", torch.bfloat16, residual)
    fmt_s, slabs = filled_pools(monkeypatch, "triton", "cuda", torch.bfloat16, residual)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]], "cuda")
    q = torch.randn(3, 4 * H, D, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = gluon_decode.kivi2_decode_attention
    monkeypatch.setattr(gluon_decode, "kivi2_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    assert calls, "the Gluon kernel did not run"
    ref = fmt_f.attend_reference(q, frag, ctx, D ** -0.5, window)
    triton_out = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    assert rel(out, ref) < 1e-2 and rel(triton_out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
def test_gpu_captured_fill_step_converts_its_pages(monkeypatch):
    """A decode step that fills pages is captured in a CUDA graph by the engine: the conversion into
    fragment order must not copy from the host or sync. Replayed, it writes what the eager step wrote."""
    fmt, cache = filled_pools(monkeypatch, "gluon", "cuda", torch.bfloat16)
    ctx = decode_ctx([P, P], [0, 1], [[6], [7]], "cuda")
    ctx.fill_slots = torch.tensor([0, 1], device="cuda")
    ctx.fill_pages = torch.tensor([6, 7], device="cuda")
    fmt.quantize_filled_pages([cache], ctx)  # eager: the reference, and the kernels compiled
    eager = {name: cache[name][6:8].clone() for name in FRAGMENT_FIELDS}
    for name in FRAGMENT_FIELDS:
        cache[name][6:8].zero_()
    ctx.graph_step = True
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fmt.quantize_filled_pages([cache], ctx)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fmt.quantize_filled_pages([cache], ctx)
    for name in FRAGMENT_FIELDS:
        cache[name][6:8].zero_()
    graph.replay()
    torch.cuda.synchronize()
    for name in FRAGMENT_FIELDS:
        assert torch.equal(cache[name][6:8], eager[name]), name
