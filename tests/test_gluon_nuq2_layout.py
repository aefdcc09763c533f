"""nuq2 pages in MMA-fragment order (moekv/ops/gluon/nuq2_layout.py): the reorder is a bijection
given by its documented bit formulas, round-trips nuq2's slabs byte for byte, and dequantizing from
it equals nuq2's own dequantize exactly."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.ops.gluon.nuq2_layout import (
    ELEMENT_OF_SLOT,
    NUQ2_FRAGMENT_VERSION,
    codes_from_fragment,
    codes_to_fragment,
    dequantize_fragment,
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
    assert (frag.k_out_idx != 0xFFFF).any()  # the pages do use outlier slots


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
    kd = mean + scale * z_slot, values centroid + dv = z_slot. Unused slots carry 0, used ones come first."""
    fmt, k_pages, v_pages = nuq2_pages(n, seed=10 + n)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    for name, kind, pages in (("k", "key", k_pages), ("v", "value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind).double()
        idx, used = getattr(frag, f"{name}_out_idx").long(), getattr(frag, f"{name}_used")
        delta = getattr(frag, f"{name}_slot_delta").double()
        slot = torch.arange(idx.shape[2])
        assert torch.equal(idx != 0xFFFF, slot < used[..., None])  # used first, counted
        assert bool((delta[idx == 0xFFFF] == 0).all()) and int(used.sum()) > 0
        main = dequantize_fragment(frag, kind, outliers=False).double().reshape(n, H, P * D)
        main.scatter_add_(2, idx.clamp(max=P * D - 1), torch.where(idx != 0xFFFF, delta, 0.0))
        torch.testing.assert_close(main.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
        # and without the deltas the codebook term differs at the slots
        assert (dequantize_fragment(frag, kind, outliers=False).double() - ref).abs().max() > 0.1


def test_derived_slot_tables_come_together():
    fmt, k_pages, v_pages = nuq2_pages(1, seed=2)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    parts = {f: getattr(frag, f) for f in ("k_codes", "v_codes", "k_centroids", "v_centroids", "k_mean", "k_scale",
                                           "k_out_val", "k_out_idx", "v_out_val", "v_out_idx")}
    with pytest.raises(ValueError, match="come together"):
        type(frag)(**parts, k_used=frag.k_used)
