"""vq's fragment order (moekv/ops/gluon/vq_layout.py) on the CPU: exact round trips to vq's own slabs,
the same dequantized pages, the channel permutations, and the Gluon kernel's register chain replayed
with torch (the word loads, byte extraction, codeword gathers and reshape/permute of
moekv/ops/gluon/vq_kernel.py give K_h and V^T_h in the layout's column and row orders)."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.vq import VQFormat, random_calibration
from moekv.ops.gluon import vq_layout
from moekv.ops.gluon.vq_layout import (
    KEY_CHANNEL_OF_COLUMN,
    VALUE_CHANNEL_OF_ROW,
    VQFragmentPages,
    codes_from_fragment,
    codes_to_fragment,
    codewords,
    dequantize_fragment,
    from_fragment_order,
    to_fragment_order,
)

P, D = 64, 128


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    return VQFormat(random_calibration(tmp_path_factory.mktemp("vq"), 4, D))


def slabs(fmt, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 4, P, D, generator=g)
    k[..., 7] *= 8
    k[..., 91] += 6
    v = torch.randn(n, 4, P, D, generator=g)
    return [fmt.layout(kind, P, D).pack(fmt.quantize(x, kind, 0)) for kind, x in (("key", k), ("value", v))]


def test_round_trip_to_vq_slabs_is_exact(fmt):
    k_pages, v_pages = slabs(fmt)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert frag.k_codes.shape == (3, 4, 256) and frag.k_codes.dtype == torch.int32
    k2, v2 = from_fragment_order(fmt, frag)
    assert torch.equal(k2, k_pages) and torch.equal(v2, v_pages)


def test_codes_round_trip_and_every_byte_is_one_code():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 3, P, 16), generator=g, dtype=torch.uint8)
    for kind in ("key", "value"):
        words = codes_to_fragment(codes, kind)
        assert words.shape == (2, 3, 256)
        assert torch.equal(codes_from_fragment(words, kind), codes)
        assert sorted(vq_layout.ELEMENT_OF_BYTE[kind].tolist()) == list(range(P * 16))


def test_dequantized_pages_are_vq_dequantize(fmt):
    k_pages, v_pages = slabs(fmt, seed=2)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind, 0)
        assert torch.equal(dequantize_fragment(frag, kind), ref)


def test_channel_permutations_make_whole_codewords_per_lane():
    """Lane q4 holds K columns 16 kk + 8 hh + 2 q4 + e: their channels are 4 whole 8-channel groups;
    lane g holds V^T rows 16 b + 8 a + g: 2 whole groups."""
    assert sorted(KEY_CHANNEL_OF_COLUMN.tolist()) == list(range(D))
    assert sorted(VALUE_CHANNEL_OF_ROW.tolist()) == list(range(D))
    f = torch.arange(D)
    for q4 in range(4):
        groups = (KEY_CHANNEL_OF_COLUMN[(f // 2) % 4 == q4] // 8).unique()
        assert groups.tolist() == [4 * q4 + m for m in range(4)]
    for g in range(8):
        groups = (VALUE_CHANNEL_OF_ROW[f % 8 == g] // 8).unique()
        assert groups.tolist() == [2 * g, 2 * g + 1]


def test_wrong_shape_or_slots_are_refused(fmt):
    with pytest.raises(ValueError, match="block_size 64"):
        vq_layout.check_shape(fmt, 32, D)
    with pytest.raises(ValueError, match="VQFormat"):
        vq_layout.check_shape(object(), P, D)
    with pytest.raises(ValueError, match="kind"):
        codes_to_fragment(torch.zeros(P, 16, dtype=torch.uint8), "query")


def _kernel_chain(frag: VQFragmentPages, page: int, head: int, kind: str, half: int) -> torch.Tensor:
    """vq_kernel's register chain in torch for one half page: the lane's 4 words at 8 lane + 4 half,
    16 codes a lane (R = 4 word + byte), the group of each (keys 4 (lane % 4) + R % 4, values
    2 (lane // 4) + R % 2), the codeword gathers [16, 32, 8], then _key_half's or _value_half's
    reshape and permute."""
    words = (frag.k_codes if kind == "key" else frag.v_codes)[page, head]
    book = (frag.k_codebook if kind == "key" else frag.v_codebook)[head].float()  # [16, 256, 8]
    lane = torch.arange(32)
    w = words[(lane[:, None] * 8 + 4 * half + torch.arange(4)[None, :])]  # [32, 4]
    codes = (w[:, :, None] >> (8 * torch.arange(4))[None, None, :]) & 255  # [32, 4, 4]
    codes = codes.permute(1, 2, 0).reshape(16, 32).long()
    r = torch.arange(16)[:, None]
    group = 4 * (lane[None, :] % 4) + r % 4 if kind == "key" else 2 * (lane[None, :] // 4) + r % 2
    u = book[group, codes]  # [16, 32, 8]
    if kind == "key":
        return u.reshape(2, 2, 4, 8, 4, 2, 2, 2).permute(0, 1, 3, 2, 5, 6, 4, 7).reshape(32, D)
    return u.reshape(2, 2, 2, 2, 8, 4, 8).permute(6, 3, 4, 0, 1, 5, 2).reshape(D, 32)


def test_kernel_register_chain_builds_the_tiles(fmt):
    k_pages, v_pages = slabs(fmt, seed=3)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    uk, uv = codewords(frag, "key"), codewords(frag, "value")  # [N, H, P, D] by channel
    for page, head, half in ((0, 0, 0), (1, 3, 1), (2, 1, 0), (2, 2, 1)):
        tokens = slice(32 * half, 32 * half + 32)
        assert torch.equal(_kernel_chain(frag, page, head, "key", half),
                           uk[page, head, tokens][:, KEY_CHANNEL_OF_COLUMN])
        assert torch.equal(_kernel_chain(frag, page, head, "value", half),
                           uv[page, head, tokens][:, VALUE_CHANNEL_OF_ROW].T)


def test_kernel_channel_formulas_are_the_layouts():
    """The kernel computes the permutations inline (chan_k for q, chan_out for O^T's stores)."""
    f = torch.arange(D)
    assert torch.equal(32 * ((f >> 1) & 3) + 4 * (f >> 4) + 2 * ((f >> 3) & 1) + (f & 1), KEY_CHANNEL_OF_COLUMN)
    assert torch.equal(16 * (f % 8) + 8 * ((f // 8) % 2) + f // 16, VALUE_CHANNEL_OF_ROW)
