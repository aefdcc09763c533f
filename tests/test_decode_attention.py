"""The paged decode kernel (moekv/ops/decode/paged.py) against its float64 reference.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors at small shapes (every dot in
fp32); with CUDA the same grid runs compiled, and the `gpu` tests add realistic shapes in bf16.
Caches are filled through each format's own `write` (pages quantized by its `quantize`, the newest
partial page staged), so the kernel reads exactly what the engine stores.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_decode_attention.py
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from safetensors.torch import save_file

from tests.triton_kernels import DECODE_MODULES, kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.context import Context  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.kvcache.formats.dense import is_decode_only  # noqa: E402
from moekv.kvcache.formats.nuq2 import fit_centroids  # noqa: E402
from moekv.ops.reference import decode_attention_ref, gather_kv_ref  # noqa: E402

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
decode_launch, nuq2_tiles, paged = (decode[f"moekv.ops.decode.{name}"] for name in ("launch", "nuq2", "paged"))

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def slab_format(name: str, model_dtype: torch.dtype = torch.bfloat16, **options):
    """The registry's format `name` with slab pools (decode_kernel='triton'): these tests (and
    test_decode_vq.py's, test_decode_tiered.py's) check the Triton decode kernels, which read slabs,
    where 'auto' on an sm_90 GPU would put covered shapes in a Gluon kernel's fragment order (tested in
    tests/test_gluon_*.py). nuq2 and vq without their 16-bit window unless one is named: these tests
    read the pages (short contexts would sit in the window whole; the window's own cases name it)."""
    if name in ("nuq2", "vq"):
        options.setdefault("residual", 0)
    return get_kv_format(name, model_dtype, decode_kernel="triton", **options)


# label -> (kv_cache_dtype, options)
FORMATS = {
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "fp8_e4m3": ("fp8_e4m3", {}),
    "int4_g32": ("int4", {"group_size": 32}),
    "int4_g64": ("int4", {"group_size": 64}),
    "kivi2_r32": ("kivi2", {"residual": 32}),
    "kivi2_r0": ("kivi2", {"residual": 0}),
    "kivi2_g64": ("kivi2", {"residual": 64, "group_size": 64}),
    "nuq2": ("nuq2", {"codebook": "page", "residual": 0}),
    "nuq2_r48": ("nuq2", {"codebook": "page", "residual": 48}),  # the ring's first token inside a page
}


def build_cache(fmt, lens, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, seed=0, kv=None, layer=0):
    """Allocate a pool (of decoder layer `layer`), give each sequence shuffled pages and a staging
    slot, and write its whole context through fmt.write (one prefill). kv(T) -> (k, v) [T, Hkv, D]
    overrides random data. Returns (cache, decode Context)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 2
    cache = fmt.allocate(num_blocks, num_kv_heads, block_size, head_dim, device, B + 2, dtype)
    cache.layer = layer
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(pages)
    tables = [[free.pop() for _ in range(n)] + [0] * (width - n) for n in pages]
    T = sum(lens)
    if kv is None:
        k = torch.randn(T, num_kv_heads, head_dim, generator=g)
        v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    else:
        k, v = kv(T, g)
    positions, slots, starts = [], [], [0]
    for b, n in enumerate(lens):
        positions += range(n)
        slots += [tables[b][p // block_size] * block_size + p % block_size for p in range(n)]
        starts.append(starts[-1] + n)
    seq_slots = torch.arange(B + 1, 1, -1)  # not the identity: the kernel must follow seq_slots
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    prefill = Context(t(positions, torch.long), t(slots, torch.long), t(tables, torch.int32), t(lens, torch.int32),
                      t(starts, torch.int32), t([], torch.long), seq_slots.to(device))
    fmt.write(cache, k.to(device, dtype), v.to(device, dtype), prefill)
    decode = Context(t([n - 1 for n in lens], torch.long), t([0] * B, torch.long), prefill.block_tables,
                     prefill.context_lens, torch.arange(B + 1, dtype=torch.int32, device=device),
                     t([], torch.long), prefill.seq_slots, max_query_len=1)
    return cache, decode


def reference(fmt, cache, ctx, q, scale, window):
    """float64 decode attention over each sequence's context as the format dequantizes it."""
    keys, values = [], []
    for b, n in enumerate(ctx.context_lens.tolist()):
        if hasattr(fmt, "gather"):
            k, v = fmt.gather(cache, ctx, b, n, "key"), fmt.gather(cache, ctx, b, n, "value")
        else:
            k = gather_kv_ref(cache["k_pages"], ctx.block_tables[b], n)
            v = gather_kv_ref(cache["v_pages"], ctx.block_tables[b], n)
        keys.append(k.double())
        values.append(v.double())
    return decode_attention_ref(q.double(), keys, values, scale, window)


def page_size(label, block_size):
    """kivi2 pages hold whole token groups of G: 64 tokens at least for G = 64."""
    return max(block_size, 64) if label == "kivi2_g64" else block_size


def run_case(label, lens, num_kv_heads, group, head_dim, block_size, num_splits, window=None, kv=None,
             q_dtype=torch.float32, seed=0, block_n=None, swap_ab=None):
    block_size = page_size(label, block_size)
    name, options = FORMATS[label]
    kv_dtype = torch.float16 if label == "fp16" else torch.bfloat16
    fmt = slab_format(name, kv_dtype, **options)
    cache, ctx = build_cache(fmt, lens, num_kv_heads, head_dim, block_size, kv_dtype, seed=seed, kv=kv)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(DEVICE, q_dtype)
    scale = head_dim ** -0.5
    spec = fmt.decode_spec(block_size, head_dim)
    out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, window,
                                    spec, num_splits=num_splits, block_n=block_n, swap_ab=swap_ab)
    return out, reference(fmt, cache, ctx, q, scale, window), cache, ctx


def tolerance(label, ref, q_dtype=torch.float32):
    """Error budget: fp16 rounding of dequantized int4/kivi2 tiles (the reference dequantizes in
    fp32); on CUDA the fp16/bf16 MMA operands and a 16-bit output add theirs."""
    scale = ref.abs().max().item() + 1e-6
    rel = 2e-3 if label.startswith(("int4", "kivi2", "nuq2")) else 1e-5
    if DEVICE.type == "cuda":
        rel = max(rel, 2e-2)
    if q_dtype != torch.float32:
        rel = max(rel, 1e-2)
    return rel * scale


def check(label, out, ref, q_dtype=torch.float32):
    assert out.dtype == q_dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= tolerance(label, ref, q_dtype), f"{label}: max error {err:.3g}"


# (lens, Hkv, G, D, P, splits, BLOCK_N): batch 1 and 3, contexts on and off page boundaries,
# shorter than a page, GQA 1/4/8, head_dim 32/64/128, one split or several (more splits than
# tiles too), tiles inside a page (from its start or not) and tiles spanning 2 pages
GRID = [
    ([64], 2, 4, 64, 32, 1, 16),
    ([96, 40, 1], 2, 4, 32, 32, 3, 64),
    ([37], 1, 8, 32, 32, 5, 32),
    ([150, 64, 7], 2, 1, 64, 32, 2, 16),
    ([75], 1, 4, 128, 32, 2, 64),
]


@pytest.mark.slow
@pytest.mark.parametrize("label", list(FORMATS))
@pytest.mark.parametrize("case", range(len(GRID)))
@pytest.mark.parametrize("swap_ab", [False, True], ids=["qk", "kq"])
def test_kernel_matches_reference(label, case, swap_ab):
    """Both orientations of the products (DecodeSpec.swap_ab: scores as q @ k^T or k @ q^T)."""
    lens, hkv, group, head_dim, block_size, splits, block_n = GRID[case]
    if label.startswith("int4_g64") and head_dim % 64:
        pytest.skip("int4 g64 needs head_dim divisible by 64")
    out, ref, _, _ = run_case(label, lens, hkv, group, head_dim, block_size, splits, block_n=block_n,
                              swap_ab=swap_ab)
    check(label, out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["fp8_e4m3", "int4_g32", "kivi2_r32", "nuq2", "nuq2_r48", "bf16"])
def test_the_last_split_reads_the_tail(label):
    """The 16-bit tail (staging page, kivi2's ring) is read by the last split after its pages, in
    its accumulator's column order (nuq2's planar columns): num_splits programs per head, not one
    more; fp8's spec keeps a program of its own for it (measured faster), and separate_tail asks
    for that layout everywhere: the same output. Contexts off page boundaries, more splits than
    some sequences have tiles."""
    lens, hkv, group, head_dim, block_size, splits, block_n = [150, 64, 7], 2, 4, 64, 32, 3, 32
    name, options = FORMATS[label]
    fmt = slab_format(name, torch.bfloat16, **options)
    cache, ctx = build_cache(fmt, lens, hkv, head_dim, block_size, torch.bfloat16, seed=3)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    spec = fmt.decode_spec(block_size, head_dim)
    ref = reference(fmt, cache, ctx, q, head_dim ** -0.5, None)
    outs = {}
    for separate in (False, True):
        outs[separate] = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                                   head_dim ** -0.5, None, spec, num_splits=splits, block_n=block_n,
                                                   separate_tail=separate)
        assert spec.tail_in_last_split == (label != "fp8_e4m3")
        extra = 1 if spec.staged and (separate or not spec.tail_in_last_split) else 0
        assert decode_launch.LAST_LAUNCH["grid"] == (len(lens) * hkv, splits + extra)
        check(label, outs[separate], ref)
    assert (outs[False] - outs[True]).abs().max().item() <= tolerance(label, ref)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["bf16", "fp8_e4m3", "int4_g32", "kivi2_r32", "kivi2_g64", "nuq2", "nuq2_r48"])
def test_pages_of_16_and_sliding_window(label):
    block_size = 32 if label.startswith("kivi2") else 16
    for window, splits, block_n in ((None, 4, 64), (19, 2, 32), (1, 1, 16)):  # tiles over 4, 2, 1 pages
        out, ref, _, _ = run_case(label, [83, 16, 30], 2, 4, 32, block_size, splits, window=window, seed=3,
                                  block_n=block_n)
        check(label, out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_nuq2_head_dim_16(block_n):
    """head_dim 16 takes the join-free unpack (moekv/ops/decode/codes.py JOIN_FREE_BELOW: a join into a 16-wide
    product was wrong on the H200), also with each token's own page codebook when a tile spans
    pages (tiles of 32 and 64 over pages of 16), and with the outlier slots in use."""
    kv = lambda T, g: _heavy_kv(T, g, 2, 16)  # noqa: E731
    out, ref, cache, _ = run_case("nuq2", [83, 16, 30], 2, 4, 16, 16, 2, kv=kv, seed=5, block_n=block_n)
    check("nuq2", out, ref)
    assert _used_slots(slab_format("nuq2", codebook="page"), cache, "key", 16, 16) > 0


def _outlier_kv(T, g, num_kv_heads=2, head_dim=64):
    """Keys with two large outlier channels and heavy tails; values with a constant run and zeros."""
    k = torch.randn(T, num_kv_heads, head_dim, generator=g)
    k[..., 5] *= 40
    k[..., 50] += 25
    k[T // 3] *= 8  # one heavy token
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    v[: T // 4] = 0.0  # an all-zero stretch (fp8 scale 0 -> 1, int4/kivi2 constant groups)
    v[T // 4: T // 2] = 0.75  # constant rows
    return k, v


def _zero_kv(T, g, num_kv_heads=2, head_dim=64):
    return torch.zeros(T, num_kv_heads, head_dim), torch.zeros(T, num_kv_heads, head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(FORMATS))
def test_structured_inputs(label):
    out, ref, _, _ = run_case(label, [130, 64], 2, 4, 64, 32, 3, kv=_outlier_kv, seed=5)
    check(label, out, ref)
    out, ref, _, _ = run_case(label, [40], 2, 4, 64, 32, 2, kv=_zero_kv, seed=6)
    check(label, out, ref)
    assert ref.abs().max() == 0 and out.abs().max() == 0


@pytest.mark.parametrize("label", ["bf16", "fp16", "fp8_e4m3", "int4_g32", "kivi2_r32", "nuq2", "nuq2_r48"])
def test_16bit_queries(label):
    q_dtype = torch.float16 if label == "fp16" else torch.bfloat16
    out, ref, _, _ = run_case(label, [70, 33], 2, 4, 64, 32, 2, q_dtype=q_dtype, seed=7)
    check(label, out, ref, q_dtype)


def test_default_splits_follow_the_spec():
    """The launcher's splits are num_splits_for's times the format's split_factor (fp8: 2, the rest 1),
    never more than one tile each."""
    bf16 = slab_format("bf16").decode_spec(64, 128)
    fp8 = slab_format("fp8_e4m3").decode_spec(64, 128)
    assert bf16.split_factor == 1 and fp8.split_factor == 2
    for batch, context in [(1, 4096), (16, 32768), (64, 32768)]:
        base = decode_launch.num_splits_for(batch, 8, context, 64, 132)
        assert decode_launch.default_num_splits(bf16, batch, 8, context, 64, 132) == base
        assert decode_launch.default_num_splits(fp8, batch, 8, context, 64, 132) == 2 * base
    assert decode_launch.default_num_splits(fp8, 1, 8, 128, 64, 132) == 2  # 2 tiles: one split each
    assert decode_launch.default_num_splits(fp8, 1, 8, 64, 64, 132) == 1


def test_dispatch(nuq2_calibration, monkeypatch):
    """CPU and prefill keep the reference path; CUDA decode steps go to the kernel where a format
    has a DecodeSpec; fp32 pages and unkernelised formats have none. nuq2 with calibrated codebooks
    has one (its centroids as DecodeSpec.tables) and still takes the reference path on CPU."""
    assert slab_format("fp32").decode_spec(16, 64) is None
    assert slab_format("tiered").decode_spec(16, 64) is None
    calibrated = slab_format("nuq2", calibration=nuq2_calibration(2, 64))
    assert calibrated.calibrated
    spec = calibrated.decode_spec(16, 64)
    assert spec is not None and callable(spec.tables)
    assert spec.key.params[0] == spec.value.params[0] == nuq2_tiles.NUQ2_TABLE_CENTROIDS
    assert slab_format("nuq2", codebook="page").decode_spec(16, 64).tables == ()  # page codebooks: unchanged
    cache, ctx = build_cache(calibrated, [40, 9], 2, 64, 16, torch.bfloat16, device=torch.device("cpu"), layer=1)
    k_tab, v_tab = spec.tables(cache)  # layer 1's, [Hkv, 4] fp16, one copy per (layer, device)
    assert k_tab.dtype == torch.float16 and k_tab.shape == (2, 4) and k_tab.is_contiguous()
    assert torch.equal(k_tab, calibrated.tables["nuq2.layer1.key.centroids"])
    assert torch.equal(v_tab, calibrated.tables["nuq2.layer1.value.centroids"])
    assert spec.tables(cache)[0] is k_tab
    monkeypatch.setattr(paged, "paged_decode_attention", lambda *a, **k: pytest.fail("kernel on CPU"))
    q = torch.randn(2, 8, 64)
    assert torch.equal(calibrated.attend(q, cache, ctx, 0.125, None),
                       calibrated.attend_reference(q, cache, ctx, 0.125, None))
    monkeypatch.undo()
    fp32_books = slab_format("nuq2", calibration=nuq2_calibration(2, 64))
    fp32_books.tables = {k: v.float() for k, v in fp32_books.tables.items()}
    assert fp32_books.decode_spec(16, 64) is None  # the kernel's lookup is fp16: not exact for these
    for label in FORMATS:
        name, options = FORMATS[label]
        block_size = page_size(label, 32 if name == "kivi2" else 16)
        assert slab_format(name, **options).decode_spec(block_size, 64) is not None
    fmt = slab_format("fp8_e4m3")
    cache, ctx = build_cache(fmt, [40, 9], 2, 64, 16, torch.bfloat16, device=torch.device("cpu"))
    q = torch.randn(2, 8, 64)
    assert torch.equal(fmt.attend(q, cache, ctx, 0.125, None), fmt.attend_reference(q, cache, ctx, 0.125, None))
    assert is_decode_only(q, ctx)
    ctx.max_query_len = None
    assert is_decode_only(q, ctx)  # found from query_start_loc
    ctx.query_start_loc = torch.tensor([0, 0, 2], dtype=torch.int32)
    assert not is_decode_only(q, ctx)
    assert not is_decode_only(q[:1], ctx)


# -- nuq2: outlier slots in use ---------------------------------------------------------------------------
def _heavy_kv(T, g, num_kv_heads=2, head_dim=64):
    """Heavy-tailed keys (Student t, 2 dof) with an offset and a scaled channel, and heavy-tailed
    values: both fill nuq2's outlier slots (keys several 16-slot chunks)."""
    normal = torch.randn(T, num_kv_heads, head_dim, generator=g)
    chi = torch.randn(2, T, num_kv_heads, head_dim, generator=g).pow(2).mean(0).sqrt()
    k = (normal / (chi + 1e-3)).clamp(-60, 60)  # Student t with 2 degrees of freedom
    k[..., 3] += 20
    k[..., 9] *= 15
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    spikes = torch.rand(T, num_kv_heads, head_dim, generator=g) < 0.01
    v = torch.where(spikes, 12 * torch.randn(T, num_kv_heads, head_dim, generator=g), v)
    v[: min(T, 32)] = 0.0  # the first page (of 16 or 32) all zero: centroids 0, no slots
    return k, v


def _used_slots(fmt, cache, kind, block_size, head_dim):
    layout = fmt.layout(kind, block_size, head_dim)
    pool = cache["k_pages" if kind == "key" else "v_pages"]
    idx = layout.unpack(pool)["out_idx"].to(torch.int32)
    return (idx != 0xFFFF).sum(-1).max().item()  # most slots used by one page-head


# (lens, Hkv, G, P, splits, BLOCK_N): batch 1 and 3, on and off page boundaries, GQA 1/4/8, tiles
# inside a page (from its start or not) and over 2 or 4 pages
NUQ2_GRID = [
    ([64], 2, 4, 32, 2, 16),
    ([96, 41, 5], 2, 1, 32, 3, 64),
    ([77], 1, 8, 16, 2, 64),
    ([128, 32, 33], 2, 4, 32, 2, 32),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(NUQ2_GRID)))
@pytest.mark.parametrize("swap_ab", [False, True], ids=["qk", "kq"])
def test_nuq2_outlier_slots(case, swap_ab):
    """Keys and values whose outlier slots are in use (keys over several chunks of 16), an all-zero
    page, page codebooks: the kernel against the format's own dequantization, in both orientations
    of the products (the slot hooks take [G_PAD, ...] tensors: transposed around them under swap_ab)."""
    lens, hkv, group, block_size, splits, block_n = NUQ2_GRID[case]
    kv = lambda T, g: _heavy_kv(T, g, hkv, 64)  # noqa: E731
    out, ref, cache, _ = run_case("nuq2", lens, hkv, group, 64, block_size, splits, kv=kv, seed=case,
                                  block_n=block_n, swap_ab=swap_ab)
    check("nuq2", out, ref)
    fmt = slab_format("nuq2", codebook="page")
    slots = fmt.outlier_slots("key", block_size, 64)
    assert slots > 16 and _used_slots(fmt, cache, "key", block_size, 64) == slots  # every chunk in use
    assert _used_slots(fmt, cache, "value", block_size, 64) > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(NUQ2_GRID)))
def test_nuq2_slot_modes(case):
    """The kernel variants the benchmark times: 'eager' (the first slot code) and 'first' (chunk 0
    without a branch) are exact too; 'off' applies no slot, so it equals the reference of the same
    pages with every slot cleared, and so do 'lazy' (the default) on those cleared pages (no chunk in
    use: every branch skipped) and 'first' (its unconditional chunk 0 holds no used slot)."""
    lens, hkv, group, block_size, splits, block_n = NUQ2_GRID[case]
    kv = lambda T, g: _heavy_kv(T, g, hkv, 64)  # noqa: E731
    fmt = slab_format("nuq2", codebook="page")
    cache, ctx = build_cache(fmt, lens, hkv, 64, block_size, torch.bfloat16, seed=case, kv=kv)
    q = torch.randn(len(lens), hkv * group, 64, generator=torch.Generator().manual_seed(case + 1)).to(DEVICE)
    scale = 64 ** -0.5

    def attend(slots):
        spec = nuq2_tiles.nuq2_spec(fmt, block_size, 64, slots=slots)
        return paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, None,
                                         spec, num_splits=splits, block_n=block_n)

    full = reference(fmt, cache, ctx, q, scale, None)
    check("nuq2", attend("eager"), full)
    check("nuq2", attend("first"), full)
    off = attend("off")
    assert (off.double() - full).abs().max() > tolerance("nuq2", full)  # the slots matter here
    for kind, pool in (("key", "k_pages"), ("value", "v_pages")):  # clear every slot: out_idx = 0xFFFF
        layout = fmt.layout(kind, block_size, 64)
        start = layout.offsets["out_idx"]
        cache[pool][..., start:start + 2 * fmt.outlier_slots(kind, block_size, 64)] = 0xFF
    assert _used_slots(fmt, cache, "key", block_size, 64) == 0
    cleared = reference(fmt, cache, ctx, q, scale, None)
    check("nuq2", off, cleared)
    check("nuq2", attend("lazy"), cleared)
    check("nuq2", attend("first"), cleared)
    with pytest.raises(ValueError):
        nuq2_tiles.nuq2_spec(fmt, block_size, 64, slots="sometimes")


# -- nuq2 with calibrated codebooks: per (layer, K/V, head) centroids through DecodeSpec.tables ---------
@pytest.fixture(scope="module")
def nuq2_calibration(tmp_path_factory):
    """(Hkv, head_dim) -> a calibration folder with nuq2 codebooks for two layers, fitted as
    `moekv calibrate` does (fit_centroids, one codebook per head) on different random pages: layer 0
    on Gaussian keys and values, layer 1 on heavy-tailed keys and values 3x larger, so each layer's
    (and each head's) centroids differ."""
    root = tmp_path_factory.mktemp("nuq2cal")

    def make(hkv: int, head_dim: int) -> str:
        folder = root / f"h{hkv}_d{head_dim}"
        if not folder.exists():
            folder.mkdir()
            g = torch.Generator().manual_seed(100 + hkv)
            tables = {}
            for layer in range(2):
                T = 8 * 64
                if layer == 0:
                    k, v = torch.randn(T, hkv, head_dim, generator=g), torch.randn(T, hkv, head_dim, generator=g)
                else:
                    k, v = _heavy_kv(T, g, hkv, head_dim)
                    v = 3 * v
                for kind, x in (("key", k), ("value", v)):
                    x = x * torch.linspace(0.5, 2.0, hkv)[:, None]  # heads of different scales
                    pages = x.reshape(8, 64, hkv, head_dim).transpose(1, 2)  # [n, Hkv, P, D]
                    tables[f"nuq2.layer{layer}.{kind}.centroids"] = fit_centroids(pages, kind)
            save_file(tables, str(folder / "kv_calibration.safetensors"))
        return str(folder)
    return make


def run_calibrated(calibration, lens, hkv, group, head_dim, block_size, splits, block_n, q_dtype=torch.float32,
                   seed=0, layer=1, kv_dtype=torch.bfloat16, **launch):
    """Calibrated nuq2 pages of `layer` (heavy-tailed: the keys' outlier slots in use), the kernel
    and the float64 reference. Returns (out, ref, fmt, cache, ctx, q, spec)."""
    fmt = slab_format("nuq2", kv_dtype, calibration=calibration, codebook="calibrated")
    kv = lambda T, g: _heavy_kv(T, g, hkv, head_dim)  # noqa: E731
    cache, ctx = build_cache(fmt, lens, hkv, head_dim, block_size, kv_dtype, seed=seed, kv=kv, layer=layer)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEVICE, q_dtype)
    scale = head_dim ** -0.5
    spec = fmt.decode_spec(block_size, head_dim)
    out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, None,
                                    spec, num_splits=splits, block_n=block_n, **launch)
    return out, reference(fmt, cache, ctx, q, scale, None), fmt, cache, ctx, q, spec


# (lens, Hkv, G, D, P, splits, BLOCK_N): batch 1 and 3, on and off page boundaries, GQA 1/4, tiles
# inside a page (from its start or not) and over 2 or 4 pages; D = 16 at P = 16 leaves the value
# slab padding, so values have outlier slots too (codes only otherwise)
NUQ2_CAL_GRID = [
    ([64], 2, 4, 64, 32, 2, 16),
    ([96, 41, 5], 2, 1, 64, 32, 3, 64),
    ([77], 1, 4, 64, 16, 2, 64),
    ([128, 32, 33], 2, 4, 64, 32, 2, 32),
    ([50, 16, 23], 2, 4, 16, 16, 2, 32),
]


@pytest.mark.slow
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", range(len(NUQ2_CAL_GRID)))
def test_nuq2_calibrated_codebooks(case, q_dtype, nuq2_calibration):
    """Calibrated codebooks (no centroids in the slab): the readers take layer 1's per-head centroids
    from DecodeSpec.tables, with the keys' outlier slots in use; the kernel against the format's
    own dequantization. The same pages read with layer 0's tables give another answer."""
    lens, hkv, group, head_dim, block_size, splits, block_n = NUQ2_CAL_GRID[case]
    calibration = nuq2_calibration(hkv, head_dim)
    out, ref, fmt, cache, ctx, q, spec = run_calibrated(calibration, lens, hkv, group, head_dim, block_size, splits,
                                                        block_n, q_dtype=q_dtype, seed=case)
    check("nuq2", out, ref, q_dtype)
    assert "centroids" not in fmt.layout("key", block_size, head_dim).offsets
    slots = fmt.outlier_slots("key", block_size, head_dim)
    assert slots > 0 and _used_slots(fmt, cache, "key", block_size, head_dim) > 0
    if head_dim == 16:
        assert _used_slots(fmt, cache, "value", block_size, head_dim) > 0
    if head_dim == 64 and block_size == 32:
        assert _used_slots(fmt, cache, "key", block_size, head_dim) > 16  # more than one chunk of slots
    # layer 1's tables are the ones read: layer 0's give a different output on the same pages
    assert not torch.equal(fmt.decode_tables(0, DEVICE)[0], fmt.decode_tables(1, DEVICE)[0])
    wrong = dataclasses.replace(spec, tables=fmt.decode_tables(0, DEVICE))
    other = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                      head_dim ** -0.5, None, wrong, num_splits=splits, block_n=block_n)
    assert (other.double() - ref).abs().max() > 10 * tolerance("nuq2", ref, q_dtype)


@pytest.mark.slow
def test_nuq2_calibrated_slot_modes(nuq2_calibration):
    """'eager' and 'first' slot code with calibrated codebooks are exact too; 'off' is not (the slots matter)."""
    lens, hkv, group, head_dim, block_size, splits, block_n = NUQ2_CAL_GRID[3]
    out, ref, fmt, cache, ctx, q, _ = run_calibrated(nuq2_calibration(hkv, head_dim), lens, hkv, group, head_dim,
                                                     block_size, splits, block_n, seed=9)
    check("nuq2", out, ref)
    for slots, exact in (("eager", True), ("first", True), ("off", False)):
        spec = nuq2_tiles.nuq2_spec(fmt, block_size, head_dim, slots=slots)
        res = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                        head_dim ** -0.5, None, spec, num_splits=splits, block_n=block_n)
        err = (res.double() - ref).abs().max().item()
        assert (err <= tolerance("nuq2", ref)) == exact, (slots, err)


# -- compiled kernels on the GPU, realistic shapes, bf16 ------------------------------------------------
# (block_n, num_warps, num_stages, use_asm, prefetch): launch shapes the benchmark tries, and more
# (prefetch None: the spec's default)
GPU_LAUNCHES = [(64, 4, 2, True, None), (128, 8, 3, True, 0), (32, 4, 2, True, 2), (64, 4, 2, False, 0),
                (64, 4, 3, True, 2)]


def check_gpu_launches(label, spec, cache, ctx, q, scale, ref, block_size):
    """Every launch shape the benchmark tries (pages of 64) or the default one (other pages), in
    both orientations of the products (swap_ab)."""
    launches = GPU_LAUNCHES if block_size == 64 else GPU_LAUNCHES[:1]
    for i, ((block_n, warps, stages, use_asm, prefetch), swap_ab) in enumerate(
            (launch, swap_ab) for launch in launches for swap_ab in (False, True)):
        try:
            out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale,
                                            None, spec, block_n=block_n, num_warps=warps, num_stages=stages,
                                            use_asm=use_asm, prefetch=prefetch, swap_ab=swap_ab)
        except triton.runtime.errors.OutOfResources:
            # a non-default shape may need more shared memory than the GPU has (kivi2 at
            # (128, 8, 3): 264 KiB > 227 KiB on an H200); the benchmark skips it the same way
            assert i > 1, "the default launch shape must fit"
            continue
        check(label, out, ref, torch.bfloat16)


def check_engine_path(label, fmt, cache, ctx, q, scale, ref, monkeypatch):
    """The engine's path: attend on CUDA with a decode-only Context takes the kernel, and a window too."""
    calls = []
    launcher = paged.paged_decode_attention
    monkeypatch.setattr(paged, "paged_decode_attention", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    check(label, fmt.attend(q, cache, ctx, scale, None), ref, torch.bfloat16)
    assert calls, "format.attend did not take the decode kernel"
    windowed = reference(fmt, cache, ctx, q, scale, 700)
    check(label, fmt.attend(q, cache, ctx, scale, 700), windowed, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("label", list(FORMATS))
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_realistic_shapes(label, block_size, monkeypatch):
    """32 query / 8 KV heads, head_dim 128, mixed long contexts off page boundaries, bf16 queries:
    every launch shape the benchmark tries (pages of 64), the default one (pages of 16), and the
    engine's path through format.attend."""
    if label.startswith("kivi2") and block_size < 32:
        pytest.skip("kivi2 pages hold whole 32-token groups")
    name, options = FORMATS[label]
    kv_dtype = torch.float16 if label == "fp16" else torch.bfloat16
    fmt = slab_format(name, kv_dtype, **options)
    lens = [4096 + 7, 1000, 16384, 129]
    cache, ctx = build_cache(fmt, lens, 8, 128, block_size, kv_dtype, seed=11)
    q = torch.randn(len(lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    scale = 128 ** -0.5
    ref = reference(fmt, cache, ctx, q, scale, None)
    spec = fmt.decode_spec(block_size, 128)
    check_gpu_launches(label, spec, cache, ctx, q, scale, ref, block_size)
    check_engine_path(label, fmt, cache, ctx, q, scale, ref, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_nuq2_calibrated(block_size, nuq2_calibration, monkeypatch):
    """Calibrated nuq2 at 32 query / 8 KV heads, head_dim 128, long contexts off page boundaries,
    bf16 queries, layer 1's codebooks: every launch shape the benchmark tries (pages of 64; inline
    PTX lookup from the table and plain Triton), the default one (pages of 16), and the engine's
    path through format.attend (a window too)."""
    calibration = nuq2_calibration(8, 128)
    fmt = slab_format("nuq2", torch.bfloat16, calibration=calibration, codebook="calibrated")
    lens = [4096 + 7, 1000, 16384, 129]
    kv = lambda T, g: _heavy_kv(T, g, 8, 128)  # noqa: E731
    cache, ctx = build_cache(fmt, lens, 8, 128, block_size, torch.bfloat16, seed=11, kv=kv, layer=1)
    assert _used_slots(fmt, cache, "key", block_size, 128) > 0
    q = torch.randn(len(lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    scale = 128 ** -0.5
    ref = reference(fmt, cache, ctx, q, scale, None)
    spec = fmt.decode_spec(block_size, 128)
    check_gpu_launches("nuq2", spec, cache, ctx, q, scale, ref, block_size)
    wrong = dataclasses.replace(spec, tables=fmt.decode_tables(0, DEVICE))  # layer 0's codebooks
    other = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, None,
                                         wrong)
    assert (other.double() - ref).abs().max() > 2 * tolerance("nuq2", ref, torch.bfloat16)
    check_engine_path("nuq2", fmt, cache, ctx, q, scale, ref, monkeypatch)


def test_wave_splits_fill_whole_waves():
    """The launcher's split rule (decode_launch.wave_splits): the fewest splits from 2 whose
    programs fill the last wave to the tuning's wave_fill (all of it when it is the first), else the
    fullest; at least 2 tiles a split."""
    wave_fill = decode_launch.decode_tuning().wave_fill
    # the H200 sweep's points (132 SMs, 8 KV heads, tiles of 64)
    assert decode_launch.wave_splits(16, 8, 32768, 64, 132, 5) == 5  # 640 of 660 slots
    assert decode_launch.wave_splits(16, 8, 32768, 64, 132, 4) == 4  # 512 of 528
    assert decode_launch.wave_splits(1, 8, 131072, 64, 132, 5) == 82  # 656 of 660
    assert decode_launch.wave_splits(1, 8, 131072, 64, 132, 4) == 66  # 528 of 528
    assert decode_launch.wave_splits(64, 8, 32768, 64, 132, 4) == 2  # 1024 of 2 x 528
    assert decode_launch.wave_splits(64, 8, 32768, 64, 132, 5) == 5  # 2560 of 4 x 660
    assert decode_launch.wave_splits(1, 8, 4096, 64, 132, 3) == 32  # never one wave: the most, 2 tiles each
    assert decode_launch.wave_splits(1, 8, 64, 64, 132, 3) == 1  # one tile
    for batch, hkv, context, occ in itertools.product([1, 3, 16, 40], [1, 8], [300, 4096, 50000], [1, 2, 5]):
        splits = decode_launch.wave_splits(batch, hkv, context, 64, 132, occ)
        cap = max(1, min(128, math.ceil(context / 128)))
        assert 1 <= splits <= cap

        def fill(n):
            programs = batch * hkv * n
            slots = 132 * occ
            return programs / (slots * math.ceil(programs / slots))
        later = range(min(2, cap), cap + 1)
        assert fill(splits) >= wave_fill or fill(splits) >= max(fill(n) for n in later) - 1e-9
        first = next((n for n in later if fill(n) >= wave_fill), None)
        if first is not None and batch * hkv * first <= 132 * occ:  # one wave: the most it holds
            assert splits == min(cap, 132 * occ // (batch * hkv))
        elif first is not None:
            assert splits == first


def test_programs_per_sm_counts_registers_and_shared_memory():
    h200 = dict(max_regs=65536, max_shared=232448)
    assert decode_launch.programs_per_sm(128, 38912, 4, **h200) == 4  # fp8 q @ k^T: registers
    assert decode_launch.programs_per_sm(96, 34816, 4, **h200) == 5  # fp8 k @ q^T
    assert decode_launch.programs_per_sm(72, 69632, 4, **h200) == 3  # bf16: shared memory
    assert decode_launch.programs_per_sm(243, 38912, 4, **h200) == 2  # nuq2: 248 registers allocated
    assert decode_launch.programs_per_sm(32, 0, 4, **h200) == 16  # warps
    assert decode_launch.programs_per_sm(255, 200000, 8, **h200) == 1


def test_register_caps_only_where_measured():
    """The formats' specs carry the register caps timed on the H200 at pages of 64 (its tuning file's
    max_registers); smaller pages, where a tile spans pages and the same caps spill hundreds of bytes,
    keep ptxas's choice, except fp8 (no spills there). vq needs a calibration: its cap is read from
    the same function its spec calls."""
    for name, options, cap in (("int4", {}, 96), ("nuq2", {"codebook": "page"}, 168), ("fp8_e4m3", {}, 80)):
        fmt = slab_format(name, torch.bfloat16, **options)
        assert fmt.decode_spec(64, 128).max_registers == cap, name
        assert fmt.decode_spec(128, 128).max_registers == cap, name
        assert fmt.decode_spec(16, 128).max_registers == (80 if name == "fp8_e4m3" else None), name
    assert decode_launch.register_cap("vq", 64) == 96 and decode_launch.register_cap("vq", 16) is None
    assert decode_launch.register_cap("tiered", 64) == 168  # its launcher's
    assert decode_launch.register_cap("tiered", 16) is None
    assert slab_format("bf16", torch.bfloat16).decode_spec(16, 128).max_registers is None


def test_choose_launch_drops_a_spilling_default_cap_on_short_splits():
    """decode_launch.choose_launch against its rule, with made-up occupancies: capped 3 programs
    per SM with spills, uncapped 2."""
    asked = []

    def occupancy(regs, spills=100):
        asked.append(regs)
        return (3, spills) if regs else (2, 0)

    # batch 1 x 128k: 2048 tiles, 49 splits of ~42: the cap stays, splits from its occupancy
    assert decode_launch.choose_launch(None, 168, True, occupancy, 1, 8, 131072, 64, 132) == (
        decode_launch.wave_splits(1, 8, 131072, 64, 132, 3), 168)
    asked.clear()
    # batch 1 x 4k: 64 tiles, 32 splits of 2: dropped, splits chosen again uncapped (the occupancy
    # asked once under the cap, once without it)
    assert decode_launch.choose_launch(None, 168, True, occupancy, 1, 8, 4096, 64, 132) == (
        decode_launch.wave_splits(1, 8, 4096, 64, 132, 2), 0)
    assert asked == [168, 0]
    # batch 1 x 16k: 256 tiles, 49 splits of ~5 capped: dropped, and 33 splits (2 per SM) instead
    assert decode_launch.wave_splits(1, 8, 16384, 64, 132, 3) == 49
    assert decode_launch.choose_launch(None, 168, True, occupancy, 1, 8, 16384, 64, 132) == (33, 0)
    # batch 1 x 32k: 512 tiles, 49 splits of 11 capped: stays
    assert decode_launch.choose_launch(None, 168, True, occupancy, 1, 8, 32768, 64, 132)[1] == 168
    # a cap that does not spill stays (fp8), as does one the caller asked for
    assert decode_launch.choose_launch(None, 80, True, lambda r: occupancy(r, 0), 1, 8, 4096, 64, 132)[1] == 80
    assert decode_launch.choose_launch(None, 168, False, occupancy, 1, 8, 4096, 64, 132)[1] == 168
    # explicit splits are kept; with 2 tiles each the default cap still goes
    assert decode_launch.choose_launch(2, 168, True, occupancy, 16, 8, 32768, 64, 132) == (2, 168)
    assert decode_launch.choose_launch(40, 168, True, occupancy, 1, 8, 4096, 64, 132) == (40, 0)
    # no cap: nothing to drop, and the uncapped occupancy is the one asked
    asked.clear()
    assert decode_launch.choose_launch(None, 0, True, occupancy, 16, 8, 32768, 64, 132) == (
        decode_launch.wave_splits(16, 8, 32768, 64, 132, 2), 0)
    assert asked == [0]


def test_launch_split_kernel_compiles_once_per_key_then_launches_its_choice(monkeypatch):
    """The compiled branch of decode_launch.launch_split_kernel (both launchers' launch), with a
    stand-in kernel: each (launch key, cap) is compiled once, before any launch; a spilling default
    cap is dropped at batch 1 x 4k (2 tiles a split) and kept at 16 x 32k; the launch gets the
    chosen splits as its grid and the cap as maxnreg."""
    compiled, launched = [], []

    class Compiled:  # what compiled_occupancy reads of a compile: spills (and, below, the cap)
        def __init__(self, regs):
            self.regs, self.n_spills = regs, 100 if regs else 0

    class Kernel:
        def warmup(self, *args, grid, num_warps, num_stages, **options):
            compiled.append(options.get("maxnreg", 0))
            return Compiled(options.get("maxnreg", 0))

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, args[0], kw.get("maxnreg")))

    # capped: 3 programs per SM (with spills); uncapped: 2
    monkeypatch.setattr(decode_launch, "_kernel_programs_per_sm", lambda kernel, warps, device: 3 if kernel.regs else 2)
    monkeypatch.setattr(decode_launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode_launch, "OCCUPANCY", decode_launch.OccupancyCache())

    def kernel_args(splits):
        return "o", "lse", splits + 1, (splits,)

    def run(batch, context, default=True):
        return decode_launch.launch_split_kernel(Kernel(), kernel_args, lambda regs: ("key", batch, regs), 7, None,
                                                 168, default, batch, 8, context, 64, 4, 2, False, "cpu")

    splits = decode_launch.wave_splits(16, 8, 32768, 64, 132, 3)
    assert run(16, 32768) == ("o", "lse", splits + 1)
    assert compiled == [168] and launched[-1] == ((128, splits + 1), splits, 168)
    run(16, 32768)
    assert compiled == [168]  # cached: not compiled again
    run(1, 4096)
    assert compiled == [168, 168, 0]  # a new key: capped first, then uncapped after the drop
    assert launched[-1] == ((8, 33), 32, None) and decode_launch.LAST_LAUNCH["max_registers"] is None
    run(1, 4096, default=False)  # a cap the caller asked for stays
    assert launched[-1][2] == 168
    assert decode_launch.LAST_LAUNCH == {"num_splits": 32, "max_registers": 168, "grid": (8, 33)}


def test_occupancy_key_tells_compiled_kernels_apart():
    """The launcher caches programs per SM by occupancy_key: specs rebuilt for every call (and a
    calibrated nuq2's new tables closure) share a key; another orientation, format or launch does not."""
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    pool = torch.zeros(4, 2, 100, dtype=torch.uint8)
    keys = {}
    for name, options in (("nuq2", {"codebook": "page"}), ("int4", {}), ("fp8_e4m3", {})):
        fmt = slab_format(name, torch.bfloat16, **options)
        a, b = fmt.decode_spec(32, 64), fmt.decode_spec(32, 64)
        assert a is not b
        ka = decode_launch.occupancy_key(a, (), q, pool, pool, 4, 32, 64, 4, 2, True, 2, a.swap_ab)
        assert ka == decode_launch.occupancy_key(b, (), q, pool, pool, 4, 32, 64, 4, 2, True, 2, b.swap_ab)
        assert ka != decode_launch.occupancy_key(a, (), q, pool, pool, 4, 32, 64, 4, 2, True, 2, not a.swap_ab)
        assert ka != decode_launch.occupancy_key(a, (), q, pool, pool, 4, 32, 64, 4, 2, True, 0, a.swap_ab)
        keys[name] = ka
    assert len(set(keys.values())) == 3
