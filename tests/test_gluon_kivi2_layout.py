"""kivi2 pages in MMA-fragment order (moekv/ops/gluon/kivi2_layout.py): the reorder is a bijection
given by its documented bit formulas, round-trips kivi2's slabs byte for byte, and dequantizing from it
equals kivi2's own dequantize exactly."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.kivi import KIVI2Format
from moekv.ops.gluon.kivi2_layout import (
    ELEMENT_OF_SLOT,
    KIVI2_FRAGMENT_VERSION,
    codes_from_fragment,
    codes_to_fragment,
    dequantize_fragment,
    fragment_bytes_per_page_head,
    from_fragment_order,
    to_fragment_order,
)

P, D, H = 64, 128, 2


def kivi2_pages(n: int, seed: int, fmt: KIVI2Format | None = None):
    """n random pages of keys (two large channels) and values, quantized and packed by kivi2 itself."""
    fmt = fmt or KIVI2Format()
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, P, D, generator=g)
    k[..., 7] *= 8
    k[..., 91] += 6
    v = torch.randn(n, H, P, D, generator=g)
    slabs = [fmt.layout(kind, P, D).pack(fmt.quantize(x, kind)) for kind, x in (("key", k), ("value", v))]
    return fmt, slabs[0], slabs[1]


@pytest.mark.parametrize("kind", ["key", "value"])
def test_slot_map_is_a_bijection(kind):
    assert torch.equal(ELEMENT_OF_SLOT[kind].sort().values, torch.arange(P * D))


def test_documented_positions():
    """Spot checks of the docstring's formulas. Keys: token 40 = 16 blk + 8 y1 + g (blk 2, y1 1, g 0),
    channel 97 = 64 f1 + 32 f0 + y0 (f1 1, f0 1, y0 1): byte 512 * 2 + 64 * 0 + 16 * 0 + 3 (y = 2 y1 +
    y0), field 3 (bits 6-7). Values: token 37 = 32 blk + 2 q4 + y0 (blk 1, q4 2, y0 1), channel 50 =
    32 f0 + 16 rh + g (f 1, rh 1, g 2): row 2 blk + rh = 3, byte 64 * 2 + 16 * 2 + 1, field 1."""
    codes = torch.zeros(2, P, D, dtype=torch.long)
    codes[0, 40, 97] = 3
    codes[1, 37, 50] = 2
    kb = codes_to_fragment(codes[0], "key").view(torch.uint8)
    vb = codes_to_fragment(codes[1], "value").view(torch.uint8)
    assert kb.nonzero().flatten().tolist() == [512 * 2 + 3] and int(kb[512 * 2 + 3]) == 3 << 6
    assert vb.nonzero().flatten().tolist() == [512 * 3 + 128 + 32 + 1] and int(vb[512 * 3 + 161]) == 2 << 2


def test_halves_and_groups_sit_where_the_kernel_reads_them():
    """Keys: rows 0-1 hold token group 0 (tokens 0..31), rows 2-3 group 1; values: field f of every
    byte is channel group f (what the kernel's per-half key MMAs and per-group value shifts rely on)."""
    m = torch.arange(P * D)
    row, field = (m // 4) // 512, m % 4
    k_tok = ELEMENT_OF_SLOT["key"] // D
    assert torch.equal(k_tok // 32, row // 2)
    assert torch.equal((ELEMENT_OF_SLOT["value"] % D) // 32, field)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_codes_round_trip(kind):
    codes = torch.randint(0, 4, (3, H, P, D), generator=torch.Generator().manual_seed(1))
    words = codes_to_fragment(codes, kind)
    assert words.shape == (3, H, 512) and words.dtype == torch.int32
    assert torch.equal(codes_from_fragment(words, kind), codes)


@pytest.mark.parametrize("n", [1, 5])
def test_slabs_round_trip_and_dequantize_exactly(n):
    fmt, k_pages, v_pages = kivi2_pages(n, seed=n)
    frag = to_fragment_order(fmt, k_pages, v_pages)
    assert frag.version == KIVI2_FRAGMENT_VERSION and frag.k_codes.shape == (n, H, 512)
    assert frag.k_scale.shape == (n, H, 2, D) and frag.v_scale.shape == (n, H, P, 4)
    k_back, v_back = from_fragment_order(fmt, frag)
    assert torch.equal(k_back, k_pages) and torch.equal(v_back, v_pages)
    for kind, pages in (("key", k_pages), ("value", v_pages)):
        ref = fmt.dequantize(fmt.layout(kind, P, D).unpack(pages), kind)
        assert torch.equal(dequantize_fragment(frag, kind), ref), kind
    # the fragment tables hold exactly the slab's bytes (codes, scales, zeros), reordered
    slab_bytes = fmt.layout("key", P, D).slab_bytes + fmt.layout("value", P, D).slab_bytes
    assert fragment_bytes_per_page_head(fmt) == slab_bytes
    assert frag.kernel_bytes_per_page_head() == fragment_bytes_per_page_head(fmt)


def test_shapes_outside_the_order_are_refused():
    fmt, k_pages, v_pages = kivi2_pages(1, seed=0, fmt=KIVI2Format(group_size=64))
    with pytest.raises(ValueError, match="group"):
        to_fragment_order(fmt, k_pages, v_pages)
    fmt, k_pages, v_pages = kivi2_pages(1, seed=0)
    with pytest.raises(ValueError, match="uint8"):
        to_fragment_order(fmt, k_pages[..., :-2], v_pages)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i = byte (sel >> 4 i) & 7 of the 8-byte value b:a."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _centroid_pairs(word: int, shift: int, lo: int, hi: int) -> list[int]:
    """The kernel's asm (nuq2_kernel._centroid_pairs) on one word: the 4 fp16 bit patterns it returns,
    element i = byte i of the word (the 4 consecutive register elements of pack=4)."""
    t = (word >> shift) & 0x03030303
    s = (t * 34 + 0x10101010) & 0xFFFFFFFF
    r0, r1 = _prmt(lo, hi, s & 0xFFFF), _prmt(lo, hi, s >> 16)
    return [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]


def test_kernel_dequant_chain_rebuilds_the_tiles():
    """The Gluon kernel's register steps replayed on the logical tensors: the prmt lookup with the
    table 0, 1, 2, 3 (kivi2_kernel.CODE_LO / CODE_HI) emulated bit for bit, then the kernel's
    reshape/permute to K_h [32, 128] (keys, per half) and V^T_{g,h} [32, 32] (values, per group and
    half) must give exactly the codes at (token, channel). (The compiler checks the layouts are
    trivial; this checks the index algebra those layouts carry.)"""
    lo, hi = 0x3C000000, 0x42004000
    fp16 = {0x0000: 0, 0x3C00: 1, 0x4000: 2, 0x4200: 3}
    codes = torch.randint(0, 4, (2, P, D), generator=torch.Generator().manual_seed(3))
    for kind, c in (("key", codes[0]), ("value", codes[1])):
        words = codes_to_fragment(c, kind).view(4, 128).tolist()  # 4 rows of 128 words
        if kind == "key":
            for h in range(2):  # x [2 rows, 128 words, 4 bytes, 4 fields]
                x = torch.tensor([[[[fp16[_centroid_pairs(words[2 * h + r][w] & 0xFFFFFFFF, 2 * f, lo, hi)[bw]]
                                     for f in range(4)] for bw in range(4)] for w in range(128)] for r in range(2)])
                kf = x.reshape(2, 8, 4, 2, 2, 2, 2, 2, 2).permute(0, 5, 1, 7, 8, 3, 4, 2, 6).reshape(32, 128)
                assert torch.equal(kf, c[32 * h:32 * h + 32]), h
        else:
            for h in range(2):
                for g in range(4):  # x [2 rows (rh), 128 words, 4 bytes] at shift 2 g
                    x = torch.tensor([[[fp16[_centroid_pairs(words[2 * h + r][w] & 0xFFFFFFFF, 2 * g, lo, hi)[bw]]
                                        for bw in range(4)] for w in range(128)] for r in range(2)])
                    vf = x.reshape(2, 8, 4, 2, 2, 2, 2).permute(0, 5, 1, 3, 4, 2, 6).reshape(32, 32)
                    assert torch.equal(vf, c[32 * h:32 * h + 32, 32 * g:32 * g + 32].T), (h, g)
