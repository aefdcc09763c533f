"""int4, kivi2, nuq2, vq and fp8_e4m3 pools in their Gluon kernels' fragment order (the format's
decode_kernel; fragment.FragmentPagedFormat), and tiered's (its FP8 codes reordered, its low tier in nuq2's tables):
pages converted when written hold exactly what the slab pools hold, read back and attend the same
(CPU: the reference path over both, the residual rings and tiered's page masses included); on a GPU
(marked gpu) the engine's attend takes the Gluon kernel and matches the reference path, and a captured
fill step converts its pages as the eager one does."""
from __future__ import annotations

import functools
import importlib
import tempfile

import pytest
import torch

from moekv.context import Context
from moekv.kvcache.formats import get_kv_format

H, P, D = 2, 64, 128
# format -> (get_kv_format's options, spiky keys (a few elements x10), what shows the pages' side tables at work)
FORMATS = {
    "int4": ({"group_size": 32}, True,
             lambda pool: float(pool["k_out_delta"][:6].abs().max()) > 1),  # outlier channels: what codes do not
    "nuq2": ({"codebook": "page"}, True, lambda pool: int(pool["k_used"].sum()) > 0),  # outlier slots in use
    "kivi2": ({}, False, lambda pool: "k_residual" in pool.tensors),  # the ring beside the fragment tables
    "vq": ({}, False, lambda pool: pool["k_tok_scale"].float().abs().sum() > 0),  # token scales written
    "fp8_e4m3": ({}, True, lambda pool: bool(pool["k_slabs"][:6, :, P * D:].any())),  # row scales in the slabs
}
# an uncovered shape's format and the message naming what the kernel covers (beyond block_size/head_dim)
UNCOVERED = {"int4": ({"group_size": 64}, "group_size 32"), "kivi2": ({"group_size": 64}, "group 32")}
# (format, its residual window R: kivi2, nuq2, vq): the attention cases (R = 64: the ring begins inside a page)
ATTEND = [("int4", None), ("nuq2", 0), ("nuq2", 64), ("kivi2", 0), ("kivi2", 128), ("vq", 0), ("vq", 64),
          ("vq", 256), ("fp8_e4m3", None)]


@functools.cache
def vq_calibration() -> str:
    """A random vq calibration for H kv heads (made once per session)."""
    from moekv.kvcache.formats.vq import random_calibration

    return str(random_calibration(tempfile.mkdtemp(prefix="vq_engine_"), H, D))


def format_options(name: str) -> dict:
    """get_kv_format's options of FORMATS[name] (vq: its calibration)."""
    return {**FORMATS[name][0], **({"calibration": vq_calibration()} if name == "vq" else {})}


def decode_ctx(context_lens, slots, tables, device="cpu"):
    B = len(context_lens)
    return Context(
        positions=torch.tensor([n - 1 for n in context_lens], device=device),
        slot_mapping=torch.zeros(B, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=device),
        logits_indices=torch.arange(B, device=device),
        seq_slots=torch.tensor(slots, device=device),
        max_query_len=1,
        fills_no_page=True,
    )


def layout(name):
    return importlib.import_module(f"moekv.ops.gluon.{name.removesuffix('_e4m3')}_layout")


def filled_pools(name, choice, device="cpu", dtype=torch.float32, residual=None):
    """A pool of format `name` (decode_kernel=choice) whose pages 0..5 were filled from staging
    by quantize_filled_pages, staging (and the residual ring, R = residual or the format's default) refilled
    with random tokens per sequence."""
    options, spiky = format_options(name), FORMATS[name][1]
    fmt = get_kv_format(name, dtype, decode_kernel=choice, **options,
                        **({} if residual is None else {"residual": residual}))
    cache = fmt.allocate(8, H, P, D, torch.device(device), 3, dtype)
    g = torch.Generator().manual_seed(0)
    for fill_pages in ([0, 3, 5], [1, 4, 2]):  # two steps of three fills each
        for kv in ("k", "v"):
            x = torch.randn(3, H, P, D, generator=g)
            if kv == "k":
                x[..., 5] += 4
                if spiky:
                    x.view(-1)[torch.randint(0, x.numel(), (40,), generator=g)] *= 10
            cache[f"{kv}_staging"].copy_(x.to(dtype))
        ctx = decode_ctx([P, P, P], [0, 1, 2], [[0], [1], [2]], device)
        ctx.fill_slots = torch.tensor([0, 1, 2], device=device)
        ctx.fill_pages = torch.tensor(fill_pages, device=device)
        fmt.quantize_filled_pages([cache], ctx)
    for kv in ("k", "v"):
        cache[f"{kv}_staging"].copy_(torch.randn(3, H, P, D, generator=g).to(dtype))
        if f"{kv}_residual" in cache.tensors and cache[f"{kv}_residual"].shape[2]:
            ring = cache[f"{kv}_residual"]
            ring.copy_(torch.randn(ring.shape, generator=g).to(dtype) + 0.5)
    return fmt, cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors, 1-byte types (fp8) compared as bytes."""
    return torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                       b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


@pytest.mark.parametrize("name", list(FORMATS))
def test_fragment_pools_hold_what_slab_pools_hold(name):
    fmt_s, slabs = filled_pools(name, "triton")
    fmt_f, frag = filled_pools(name, "gluon")
    fields = layout(name).FRAGMENT_FIELDS
    assert "k_pages" in slabs.tensors and "k_pages" not in frag.tensors
    assert all(field in frag.tensors for field in fields)
    want = layout(name).to_fragment_order(fmt_s, slabs["k_pages"][:6], slabs["v_pages"][:6])
    for field in fields:
        assert same_bits(frag[field][:6], getattr(want, field)), field
    assert FORMATS[name][2](frag)
    ids = torch.tensor([5, 0, 2])
    for kind in ("key", "value"):
        assert torch.equal(fmt_f.dequantize_pages(frag, kind, ids), fmt_s.dequantize_pages(slabs, kind, ids)), kind


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("name, residual", ATTEND)
def test_fragment_pools_attend_as_slab_pools(name, residual, window):
    """Decode attention (CPU: the reference path) over pages + the staged newest page (+ the residual
    ring): the same output from both pools."""
    fmt_s, slabs = filled_pools(name, "triton", residual=residual)
    fmt_f, frag = filled_pools(name, "gluon", residual=residual)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]])
    q = torch.randn(3, 4 * H, D, generator=torch.Generator().manual_seed(1))
    out_s = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    out_f = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    torch.testing.assert_close(out_f, out_s, rtol=1e-6, atol=1e-6)


def test_nuq2_fragment_pool_reference_path_is_float64_attention():
    """nuq2 pools in fragment order on the CPU (decode_kernel='gluon'; the slots' FP8 values recovered
    from their fp16 deltas) attend through the reference path as float64 dense attention over the pages
    nuq2 dequantizes from its own slabs (the slab pool's, an independent path) and the staged newest page."""
    from moekv.ops.reference import decode_attention_ref

    fmt_s, slabs = filled_pools("nuq2", "triton", residual=0)
    fmt_f, frag = filled_pools("nuq2", "gluon", residual=0)
    assert int(frag["k_used"].sum()) > 0 and "k_out_val" not in frag.tensors
    lens, tables = [2 * P + 5, P + 1, 3 * P], [[0, 3, 1], [5, 4, 0], [1, 2, 3]]
    ctx = decode_ctx(lens, [2, 0, 1], tables)
    q = torch.randn(3, 4 * H, D, generator=torch.Generator().manual_seed(1))
    out = fmt_f.attend(q, frag, ctx, D ** -0.5, None)
    pages = {kind: fmt_s.dequantize(fmt_s.layout(kind, P, D).unpack(slabs[f"{kind[0]}_pages"]), kind).double()
             for kind in ("key", "value")}
    keys, values = [], []
    for b, (n, slot) in enumerate(zip(lens, [2, 0, 1])):
        full = (n - 1) // P  # pages before the staged newest one
        rows = torch.tensor(tables[b][:full], dtype=torch.long)
        for kind, out_list in (("key", keys), ("value", values)):
            paged = pages[kind][rows].permute(0, 2, 1, 3).reshape(-1, H, D)
            staged = frag[f"{kind[0]}_staging"][slot].double().transpose(0, 1)[: n - full * P]
            out_list.append(torch.cat([paged, staged]))
    ref = decode_attention_ref(q.double(), keys, values, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FORMATS))
def test_fragment_pool_accounting_and_choice(name):
    options = format_options(name)
    fmt = get_kv_format(name, torch.float32, decode_kernel="gluon", **options)
    slab = get_kv_format(name, torch.float32, decode_kernel="triton", **options)
    if name in ("kivi2", "fp8_e4m3"):  # the same bytes as the slabs, reordered
        assert slab.page_bytes(H, P, D) == H * layout(name).fragment_bytes_per_page_head(fmt)
    assert fmt.page_bytes(H, P, D) == H * layout(name).fragment_bytes_per_page_head(fmt)
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 2, torch.float32)
    side = sum(t.numel() * t.element_size() for n, t in cache.tensors.items() if n.endswith(("_staging", "_residual")))
    assert cache.nbytes() - side == 4 * fmt.page_bytes(H, P, D)
    with pytest.raises(ValueError, match="block_size 64, head_dim 128"):
        fmt.allocate(4, H, 32, D, torch.device("cpu"), 2, torch.float32)
    if name in UNCOVERED:
        other, message = UNCOVERED[name]
        with pytest.raises(ValueError, match=message):
            get_kv_format(name, torch.float32, decode_kernel="gluon", **other).allocate(
                4, H, P, D, torch.device("cpu"), 2, torch.float32)
    auto = get_kv_format(name, torch.float32, **options)
    assert auto.decode_kernel == "auto"
    assert not auto.fragment_pages(P, D, "cpu")  # auto: sm_90 CUDA devices only
    assert not auto.fragment_pages(32, D)
    assert not slab.fragment_pages(P, D)
    with pytest.raises(ValueError, match=r"decode_kernel='cuda' is not supported; accepted: \['auto', 'triton', "):
        get_kv_format(name, torch.float32, decode_kernel="cuda", **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
@pytest.mark.parametrize("group", [4, 12])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("name, residual", ATTEND)
def test_gpu_engine_attend_takes_the_gluon_kernel(monkeypatch, name, residual, window, group):
    """On CUDA a decode step over a fragment-order pool runs the Gluon kernel (staged tail, and the
    residual ring, as its extra split; a group of 12 query heads a KV head in two launches, 8 + 4 heads):
    it matches the reference path over the same pool and the Triton kernel over slabs."""
    kernel = name.removesuffix("_e4m3")  # fp8_e4m3's modules are fp8_*
    gluon_decode = importlib.import_module(f"moekv.ops.gluon.{kernel}_decode")
    fmt_f, frag = filled_pools(name, "gluon", "cuda", torch.bfloat16, residual)
    fmt_s, slabs = filled_pools(name, "triton", "cuda", torch.bfloat16, residual)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]], "cuda")
    q = torch.randn(3, group * H, D, device="cuda", dtype=torch.bfloat16)
    calls = []
    entry = f"{kernel}_decode_attention"
    real = getattr(gluon_decode, entry)
    monkeypatch.setattr(gluon_decode, entry, lambda *a, **k: calls.append(a[0].shape[1] // H) or real(*a, **k))
    out = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    assert calls == ([4] if group == 4 else [8, 4]), "the Gluon kernel did not run once a part"
    ref = fmt_f.attend_reference(q, frag, ctx, D ** -0.5, window)
    triton_out = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    assert rel(out, ref) < 1e-2 and rel(triton_out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
@pytest.mark.parametrize("name", list(FORMATS))
def test_gpu_captured_fill_step_converts_its_pages(name):
    """A decode step that fills pages is captured in a CUDA graph by the engine: the conversion into
    fragment order must not copy from the host or sync. Replayed, it writes what the eager step wrote."""
    fmt, cache = filled_pools(name, "gluon", "cuda", torch.bfloat16)
    fields = layout(name).FRAGMENT_FIELDS
    ctx = decode_ctx([P, P], [0, 1], [[6], [7]], "cuda")
    ctx.fill_slots = torch.tensor([0, 1], device="cuda")
    ctx.fill_pages = torch.tensor([6, 7], device="cuda")
    fmt.quantize_filled_pages([cache], ctx)  # eager: the reference, and the kernels compiled
    eager = {field: cache[field][6:8].clone() for field in fields}
    for field in fields:
        cache[field][6:8].zero_()
    ctx.graph_step = True
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fmt.quantize_filled_pages([cache], ctx)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fmt.quantize_filled_pages([cache], ctx)
    for field in fields:
        cache[field][6:8].zero_()
    graph.replay()
    torch.cuda.synchronize()
    for field in fields:
        assert same_bits(cache[field][6:8], eager[field]), field


# -- tiered: its FP8 slabs in FP8 fragment order, its low tier in nuq2's fragment tables ------------------
def tiered_pools(choice, device="cpu", dtype=torch.float32):
    """A tiered pool (decode_kernel=choice) whose pages 0..5 were stored in FP8 and pages 1, 3, 4
    then demoted to nuq2; staging refilled with random tokens per sequence."""
    fmt = get_kv_format("tiered", dtype, decode_kernel=choice, codebook="page")
    cache = fmt.allocate(8, H, P, D, torch.device(device), 3, dtype)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, H, P, D, generator=g)
    k[..., 5] += 4
    k.view(-1)[torch.randint(0, k.numel(), (60,), generator=g)] *= 10
    v = torch.randn(6, H, P, D, generator=g)
    fmt._store_pages(cache, [(p, {"k": k[p].to(device), "v": v[p].to(device)}, [p]) for p in range(6)])
    fmt._demote(cache, [1, 3, 4])
    for kv in ("k", "v"):
        cache[f"{kv}_staging"].copy_(torch.randn(3, H, P, D, generator=g).to(dtype))
    return fmt, cache


def test_tiered_fragment_pools_hold_what_slab_pools_hold():
    from moekv.ops.gluon.fp8_layout import slabs_from_fragment
    from moekv.ops.gluon.nuq2_layout import FRAGMENT_FIELDS, to_fragment_order

    fmt_s, slabs = tiered_pools("triton")
    fmt_f, frag = tiered_pools("gluon")
    assert "k_low" in slabs.tensors and "k_low" not in frag.tensors and fmt_f.is_fragment_pool(frag)
    assert slabs.state.tier == frag.state.tier and slabs.state.fp8_slot == frag.state.fp8_slot
    for name, kind in (("k", "key"), ("v", "value")):
        assert not torch.equal(frag[f"{name}_fp8"], slabs[f"{name}_fp8"])  # reordered ...
        assert torch.equal(slabs_from_fragment(fmt_f.hi, kind, frag[f"{name}_fp8"]), slabs[f"{name}_fp8"])  # ... only
    low = torch.tensor([1, 3, 4])
    want = to_fragment_order(fmt_s.lo, slabs["k_low"][low], slabs["v_low"][low])
    for field in FRAGMENT_FIELDS:
        assert same_bits(frag[field][low], getattr(want, field)), field
    assert int(frag["k_used"][low].sum()) > 0  # outlier slots in use
    pages = list(range(6))
    for kind in ("key", "value"):
        assert torch.equal(fmt_f._gather_pages(frag, pages, kind), fmt_s._gather_pages(slabs, pages, kind))


@pytest.mark.parametrize("window", [None, 70])
def test_tiered_fragment_pools_attend_as_slab_pools(window):
    """CPU: the reference path over both pools gives the same output and the same page masses."""
    fmt_s, slabs = tiered_pools("triton")
    fmt_f, frag = tiered_pools("gluon")
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]])
    q = torch.randn(3, 4 * H, D, generator=torch.Generator().manual_seed(1))
    out_s = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    out_f = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    torch.testing.assert_close(out_f, out_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(frag.state.mass_dev, slabs.state.mass_dev, rtol=1e-6, atol=1e-6)
    assert float(frag.state.mass_dev.sum()) > 0


def test_tiered_fragment_pool_accounting_and_choice():
    from moekv.ops.gluon import nuq2_layout

    slab = get_kv_format("tiered", torch.float32, decode_kernel="triton", codebook="page")
    slab_bytes = slab.page_bytes(H, P, D)
    assert not slab.fragment_pages(P, D)
    fmt = get_kv_format("tiered", torch.float32, decode_kernel="gluon", codebook="page")
    lo = sum(fmt.lo.layout(kind, P, D).slab_bytes for kind in ("key", "value"))
    assert fmt.page_bytes(H, P, D) - slab_bytes == pytest.approx(
        H * (nuq2_layout.fragment_bytes_per_page_head(fmt.lo) - lo), abs=1)  # nuq2's fragment tables, FP8 the same
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 2, torch.float32)
    assert all(field in cache.tensors for field in nuq2_layout.FRAGMENT_FIELDS)
    assert bool((cache["k_out_idx"] == nuq2_layout.NO_SLOT).all())  # unused slots
    with pytest.raises(ValueError, match="block_size 64, head_dim 128"):
        fmt.allocate(4, H, 32, D, torch.device("cpu"), 2, torch.float32)
    assert not get_kv_format("tiered", torch.float32, codebook="page").fragment_pages(P, D, "cpu")  # auto: sm_90 only


def test_auto_on_an_sm90_device_picks_the_validated_kernels(monkeypatch):
    """The default, 'auto', on an sm_90 GPU (its queries faked here): fragment order for the covered
    shapes of int4, kivi2, nuq2, vq and tiered (page codebooks), slabs for other shapes and calibrated tiered;
    fp8_e4m3 only while its Gluon kernel is its default (fp8.GLUON_BY_DEFAULT)."""
    from moekv.kvcache.formats.fp8 import GLUON_BY_DEFAULT

    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name, options in (("int4", {}), ("kivi2", {}), ("nuq2", {"codebook": "page"}), ("vq", format_options("vq"))):
        fmt = get_kv_format(name, torch.bfloat16, **options)
        assert fmt.fragment_pages(P, D, "cuda"), name
        assert not fmt.fragment_pages(32, D, "cuda"), name
    assert get_kv_format("fp8_e4m3", torch.bfloat16).fragment_pages(P, D, "cuda") == GLUON_BY_DEFAULT
    tiered = get_kv_format("tiered", torch.bfloat16, codebook="page")
    assert tiered.fragment_pages(P, D, "cuda")
    assert not tiered.fragment_pages(32, D, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not get_kv_format("int4", torch.bfloat16).fragment_pages(P, D, "cuda")  # not sm_90
    assert not tiered.fragment_pages(P, D, "cuda")
    assert get_kv_format("tiered", torch.bfloat16, decode_kernel="gluon", codebook="page").fragment_pages(P, D, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
@pytest.mark.parametrize("group", [4, 12])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_tiered_engine_attend_takes_the_gluon_kernel(monkeypatch, window, group):
    """On CUDA a decode step over a tiered pool in fragment order runs the Gluon kernel (FP8 and nuq2
    pages, the staged tail; 12 query heads a KV head in two launches, 8 + 4 heads, each adding its heads'
    mass): output and page masses match the reference path over the same pool, and the Triton kernel over
    slabs."""
    from moekv.ops.gluon import tiered_decode

    fmt_f, frag = tiered_pools("gluon", "cuda", torch.bfloat16)
    fmt_s, slabs = tiered_pools("triton", "cuda", torch.bfloat16)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]], "cuda")
    q = torch.randn(3, group * H, D, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = tiered_decode.tiered_decode_attention
    monkeypatch.setattr(tiered_decode, "tiered_decode_attention",
                        lambda *a, **k: calls.append(a[0].shape[1] // H) or real(*a, **k))
    out = fmt_f.attend(q, frag, ctx, D ** -0.5, window)
    assert calls == ([4] if group == 4 else [8, 4]), "the Gluon kernel did not run once a part"
    mass = frag.state.mass_dev.clone()
    frag.state.mass_dev.zero_()
    ref = fmt_f.attend_reference(q, frag, ctx, D ** -0.5, window)
    triton_out = fmt_s.attend(q, slabs, ctx, D ** -0.5, window)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    assert rel(out, ref) < 1e-2 and rel(triton_out, ref) < 1e-2
    assert float((mass - frag.state.mass_dev).abs().max()) < 2e-2 * q.shape[1]
    assert float((mass - slabs.state.mass_dev).abs().max()) < 2e-2 * q.shape[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
def test_gpu_tiered_gluon_step_replays_in_a_cuda_graph():
    """The engine replays tiered's decode steps: the Gluon launch, the reduce and the mass into the
    accumulator captured once give the eager step's output, and each replay adds the same mass."""
    fmt, cache = tiered_pools("gluon", "cuda", torch.bfloat16)
    ctx = decode_ctx([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]], "cuda")
    q = torch.randn(3, 4 * H, D, device="cuda", dtype=torch.bfloat16)
    eager = fmt.attend(q, cache, ctx, D ** -0.5, None).clone()
    once = cache.state.mass_dev.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fmt.attend(q, cache, ctx, D ** -0.5, None)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = fmt.attend(q, cache, ctx, D ** -0.5, None)
    cache.state.mass_dev.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    torch.testing.assert_close(cache.state.mass_dev, 2 * once, rtol=1e-5, atol=1e-6)
