"""int4 pages in MMA-fragment order (moekv/ops/gluon/int4_layout.py): the reorder is a bijection given
by its documented bit formulas, round-trips int4's slabs byte for byte, and dequantizing from it
equals int4's own dequantize exactly."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.int4 import Int4Format
from moekv.ops.gluon.int4_layout import (
    ELEMENT_OF_SLOT,
    INT4_FRAGMENT_VERSION,
    codes_from_fragment,
    codes_to_fragment,
    dequantize_fragment,
    fragment_bytes_per_page_head,
    from_fragment_order,
    to_fragment_order,
)
from tests.gluon_cases import D, P, large_channel_keys, pack

H = 2


def int4_pages(n: int, seed: int, fmt: Int4Format | None = None):
    """n random pages of keys (two large channels) and values, quantized and packed by int4 itself."""
    fmt = fmt or Int4Format(group_size=32)
    g = torch.Generator().manual_seed(seed)
    k = large_channel_keys(n, H, g)
    return fmt, *pack(fmt, k, torch.randn(n, H, P, D, generator=g))


@pytest.mark.parametrize("kind", ["key", "value"])
def test_slot_map_is_a_bijection(kind):
    assert torch.equal(ELEMENT_OF_SLOT[kind].sort().values, torch.arange(P * D))


def test_documented_positions():
    """Spot checks of the docstring's formulas. Keys: token 9 = l' + 8 e1 (l' = 1, e1 = 1), channel
    32 + 3 (group 1, e0 = 1, q4 = 1): row 2, lane 5, word 0, slot e = 3 -> nibble 1 + 4 = 5 (byte 2,
    high nibble). Values: token 5 = e0 + 2 q4 (e0 = 1, q4 = 2), channel 64 + 8 + 2 (group 2, e1 = 1,
    l' = 2): row 4, lane 10, word 0, e = 3 -> byte 2's high nibble."""
    codes = torch.zeros(2, P, D, dtype=torch.long)
    codes[0, 9, 35] = 7
    codes[1, 5, 74] = 9
    kb = codes_to_fragment(codes[0], "key").view(torch.uint8)
    vb = codes_to_fragment(codes[1], "value").view(torch.uint8)
    assert kb.nonzero().flatten().tolist() == [512 * 2 + 16 * 5 + 2] and int(kb[512 * 2 + 16 * 5 + 2]) == 7 << 4
    assert vb.nonzero().flatten().tolist() == [512 * 4 + 16 * 10 + 2] and int(vb[512 * 4 + 16 * 10 + 2]) == 9 << 4


@pytest.mark.parametrize("kind", ["key", "value"])
def test_codes_round_trip(kind):
    codes = torch.randint(0, 16, (3, H, P, D), generator=torch.Generator().manual_seed(1))
    words = codes_to_fragment(codes, kind)
    assert words.shape == (3, H, 1024) and words.dtype == torch.int32
    assert torch.equal(codes_from_fragment(words, kind), codes)


@pytest.mark.parametrize("n", [1, 5])
def test_slabs_round_trip_and_dequantize_exactly(n):
    fmt, k_pages, v_pages = int4_pages(n, seed=n)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert frag.version == INT4_FRAGMENT_VERSION and frag.k_codes.shape == (n, H, 1024)
    k_back, v_back = from_fragment_order(fmt, frag)
    assert torch.equal(k_back, k_pages) and torch.equal(v_back, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind)
        assert torch.equal(dequantize_fragment(frag, kind), ref), kind
    # the deltas: outlier value minus the zero its (code 0) element dequantizes to without the outlier
    k_no = dequantize_fragment(frag, "key")
    idx = frag.k_out_idx.long()[:, :, None, :].expand(-1, -1, P, -1)
    zero_at = frag.k_zero.float().gather(-1, idx // 32)
    assert torch.allclose(frag.k_out_delta, k_no.gather(-1, idx) - zero_at, atol=0, rtol=1e-6)
    assert fragment_bytes_per_page_head(fmt) > fmt.page_bytes(1, P, D) // 2


def test_shapes_outside_the_order_are_refused():
    fmt, k_pages, v_pages = int4_pages(1, seed=0, fmt=Int4Format(group_size=64))
    with pytest.raises(ValueError, match="group_size"):
        to_fragment_order(fmt, k_pages, v_pages)
