"""nuq2 pages in MMA-fragment order (moekv/ops/gluon/nuq2_layout.py): the reorder is a bijection
given by its documented bit formulas, round-trips nuq2's slabs byte for byte (the slots' FP8 values
recovered from their fp16 deltas), and dequantizing from it equals nuq2's own dequantize exactly."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.ops.gluon.nuq2_layout import (
    DELTA_MAX,
    ELEMENT_OF_SLOT,
    NO_SLOT,
    NUQ2_FRAGMENT_VERSION,
    allocate_fragment_tables,
    codes_from_fragment,
    codes_to_fragment,
    dequantize_fragment,
    fragment_bytes_per_page_head,
    fragment_table_shapes,
    from_fragment_order,
    to_fragment_order,
)
from tests.gluon_cases import D, P, large_channel_keys, pack

H = 2


def nuq2_pages(n: int, seed: int, fmt: NUQ2Format | None = None):
    """n random pages of keys (two outlier channels, a few huge elements) and values, quantized and
    packed by nuq2 itself -> (fmt, k slabs, v slabs)."""
    fmt = fmt or NUQ2Format(codebook="page", quantize_kernel=False)
    g = torch.Generator().manual_seed(seed)
    k = large_channel_keys(n, H, g)
    k.view(-1)[torch.randint(0, k.numel(), (n * 5,), generator=g)] *= 12  # outlier slots in use
    v = torch.randn(n, H, P, D, generator=g)
    v.view(-1)[torch.randint(0, v.numel(), (n * 3,), generator=g)] *= 10
    return fmt, *pack(fmt, k, v, layer=0)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_slot_map_is_a_bijection(kind):
    e = ELEMENT_OF_SLOT[kind]
    assert torch.equal(e.sort().values, torch.arange(P * D))


def test_documented_positions():
    """Spot checks of the docstring's formulas: thread lane reads bytes [16 lane, 16 lane + 16) of a
    row; keys: lane 4 g + q4 holds tokens g and g + 8 (the A fragment's rows), values: token 2 q4 + y0."""
    codes = torch.zeros(2, P, D, dtype=torch.long)
    codes[0, 9, 3] = 1  # key token 9 = 8 y1 + g (g = 1, y1 = 1), channel 3 = 2 q4 + y0 (q4 = 1, y0 = 1)
    codes[1, 5, 40] = 2  # value token 5 = 2 q4 + y0 (q4 = 2, y0 = 1), channel 40 = 32 f0 + 8 y1 (f0 = 1, y1 = 1)
    kb = codes_to_fragment(codes[0], "key").view(torch.uint8)
    vb = codes_to_fragment(codes[1], "value").view(torch.uint8)
    assert kb.nonzero().flatten().tolist() == [64 * 1 + 16 * 1 + 2 + 1]  # y = 2 y1 + y0, field 0
    assert int(kb[83]) == 1
    assert vb.nonzero().flatten().tolist() == [64 * 0 + 16 * 2 + 2 + 1]  # y = 2 y1 + y0, field f0 = 1
    assert int(vb[35]) == 2 << 2


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_codes_round_trip(kind, n):
    codes = torch.randint(0, 4, (n, H, P, D), generator=torch.Generator().manual_seed(n))
    words = codes_to_fragment(codes, kind)
    assert words.shape == (n, H, 512) and words.dtype == torch.int32
    assert torch.equal(codes_from_fragment(words, kind), codes)


@pytest.mark.parametrize("n", [1, 4, 9])
def test_slabs_round_trip_and_dequantize_exactly(n):
    fmt, k_pages, v_pages = nuq2_pages(n, seed=n)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert frag.version == NUQ2_FRAGMENT_VERSION
    assert frag.k_codes.shape == (n, H, 512) and frag.k_centroids.dtype == torch.float16
    k_back, v_back = from_fragment_order(fmt, frag)
    assert torch.equal(k_back, k_pages) and torch.equal(v_back, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind)
        assert torch.equal(dequantize_fragment(frag, kind), ref), kind
    assert (frag.k_out_idx != NO_SLOT).any()  # the pages do use outlier slots


def test_calibrated_codebooks_are_expanded_per_page(tmp_path):
    from safetensors.torch import save_file

    from moekv.kvcache.formats.nuq2 import fit_centroids

    pages = torch.randn(4, H, P, D, generator=torch.Generator().manual_seed(3))
    save_file({f"nuq2.layer0.{kind}.centroids": fit_centroids(pages, kind) for kind in ("key", "value")},
              str(tmp_path / "kv_calibration.safetensors"))
    fmt = NUQ2Format(calibration=tmp_path, codebook="calibrated", quantize_kernel=False)
    fmt, k_pages, v_pages = nuq2_pages(3, seed=5, fmt=fmt)
    frag = to_fragment_order(fmt, k_pages, v_pages, layer=0)
    assert frag.calibrated and frag.v_centroids.shape == (3, H, 4)
    k_back, v_back = from_fragment_order(fmt, frag)
    assert torch.equal(k_back, k_pages) and torch.equal(v_back, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind, layer=0)
        assert torch.equal(dequantize_fragment(frag, kind), ref), kind


def test_bad_shapes_are_refused():
    fmt = NUQ2Format(codebook="page")
    with pytest.raises(ValueError, match="uint8"):
        to_fragment_order(fmt, torch.zeros(2, H, 100, dtype=torch.uint8), torch.zeros(2, H, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kind"):
        codes_to_fragment(torch.zeros(P, D, dtype=torch.long), "keys")


@pytest.mark.parametrize("n", [1, 5])
def test_slot_deltas_complete_the_codebook_term(n):
    """The per-slot deltas the kernel folds in (k_slot_delta, v_slot_delta), scattered onto the
    codebook term at their elements, give nuq2's own dequantize: keys mean + scale * centroid +
    kd = mean + scale * z_slot, values centroid + dv = z_slot, up to the deltas' fp16 rounding (at most
    2^-11 of each delta). Unused slots carry NO_SLOT and 0, used ones come first, counted in uint8."""
    fmt, k_pages, v_pages = nuq2_pages(n, seed=10 + n)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    for name, kind, pages in (("k", "key", k_pages), ("v", "value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind).double()
        idx, used = getattr(frag, f"{name}_out_idx"), getattr(frag, f"{name}_used")
        delta = getattr(frag, f"{name}_slot_delta")
        assert idx.dtype == torch.int16 and used.dtype == torch.uint8 and delta.dtype == torch.float16
        slot = torch.arange(idx.shape[2])
        assert torch.equal(idx != NO_SLOT, slot < used[..., None].long())  # used first, counted
        assert bool((delta[idx == NO_SLOT] == 0).all()) and int(used.sum()) > 0
        pos = torch.where(idx != NO_SLOT, idx.long(), 0)
        main = dequantize_fragment(frag, kind, outliers=False).double().reshape(n, H, P * D)
        main.scatter_add_(2, pos, delta.double())
        main = main.reshape(ref.shape)
        err = (main - ref).reshape(n, H, P * D).gather(2, pos)  # at the slots; elsewhere 0
        assert bool((err.abs() <= delta.double().abs() * 2.0 ** -11 + 1e-6).all()), float(err.abs().max())
        assert bool((main - ref).reshape(n, H, P * D).scatter(2, pos, 0.0).abs().max() < 1e-6)
        # and without the deltas the codebook term differs at the slots
        assert (dequantize_fragment(frag, kind, outliers=False).double() - ref).abs().max() > 0.1


@pytest.mark.parametrize("key_scale, value_scale", [(1e-4, 1e-6), (1e-2, 1e-3), (1.0, 1.0), (300.0, 1e3)])
def test_slot_values_are_recovered_exactly(key_scale, value_scale):
    """The pools hold no FP8 slot values: slot_values recovers them from the fp16 deltas bit for bit
    for keys and values from 1e-6 to ~6e4 in magnitude (keys 1e-4 .. 300 with channels 8x larger and
    outliers 12x: up to ~3e4), many slots used, so the slabs come back byte for byte and
    dequantize_fragment equals nuq2's dequantize exactly."""
    g = torch.Generator().manual_seed(int(key_scale * 1000) % 997)
    n = 6
    k = large_channel_keys(n, H, g) * key_scale
    k.view(-1)[torch.randint(0, k.numel(), (n * 40,), generator=g)] *= 12
    v = torch.randn(n, H, P, D, generator=g)
    v.view(-1)[torch.randint(0, v.numel(), (n * 30,), generator=g)] *= 10
    fmt = NUQ2Format(codebook="page", quantize_kernel=False, outlier_cap=1024)  # every slot fillable
    k_pages, v_pages = pack(fmt, k, v * value_scale, layer=0)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert int(frag.k_used.sum()) > 20 * n * H  # more than a chunk of slots a page-head
    k_back, v_back = from_fragment_order(fmt, frag)
    assert torch.equal(k_back, k_pages) and torch.equal(v_back, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        assert torch.equal(dequantize_fragment(frag, kind), fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind))


def test_deltas_saturate_beyond_fp16():
    """Values beyond fp16's range: the deltas saturate at +-65504 (finite: the kernel adds no inf), and
    the recovery is then no longer exact (the one case it is not; such keys have saturated nuq2's FP8
    channel scale, 448, long before)."""
    g = torch.Generator().manual_seed(4)
    v = torch.randn(2, H, P, D, generator=g) * 1e3  # values of std 1e3 ...
    v[0, 0, 3, 5] = 3e5  # ... and an outlier of 3e5 (within FP8's 448 units of the largest centroid)
    fmt = NUQ2Format(codebook="page", quantize_kernel=False)
    k_pages, v_pages = pack(fmt, torch.randn(2, H, P, D, generator=g), v, layer=0)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert bool(frag.v_slot_delta.isfinite().all()) and float(frag.v_slot_delta.float().abs().max()) == DELTA_MAX
    assert not torch.equal(from_fragment_order(fmt, frag)[1], v_pages)


def test_pool_tables_and_bits():
    """The engine's pools: int16 positions (NO_SLOT when unused), fp16 deltas, uint8 counts, no FP8
    slot values; 4818 bytes a page-head: the slabs' 4736 less their 32 bytes of padding, plus one byte a
    slot (a 16-bit delta for the 8-bit value) and the two counts: 2.35 bits an element."""
    fmt = NUQ2Format(codebook="page", quantize_kernel=False)
    shapes = fragment_table_shapes(fmt)
    assert "k_out_val" not in shapes and shapes["k_out_idx"] == ((80,), torch.int16)
    assert shapes["v_slot_delta"] == ((32,), torch.float16) and shapes["k_used"] == ((), torch.uint8)
    slabs = sum(fmt.layout(kind, P, D).slab_bytes for kind in ("key", "value"))
    assert slabs == 4736 and fragment_bytes_per_page_head(fmt) == 4818 == slabs - 32 + (80 + 32) + 2
    tables = allocate_fragment_tables(fmt, 3, H, torch.device("cpu"))
    assert bool((tables["k_out_idx"] == NO_SLOT).all()) and bool((tables["v_out_idx"] == NO_SLOT).all())
