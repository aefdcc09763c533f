"""kivi2 pages in MMA-fragment order (moekv/ops/gluon/kivi2_layout.py): the reorder is a bijection
given by its documented bit formulas, round-trips kivi2's slabs byte for byte, and dequantizing from it
equals kivi2's own dequantize exactly."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.kivi2 import KIVI2Format
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
from tests.gluon_cases import D, P, large_channel_keys, pack

H = 2


def kivi2_pages(n: int, seed: int, fmt: KIVI2Format | None = None):
    """n random pages of keys (two large channels) and values, quantized and packed by kivi2 itself."""
    fmt = fmt or KIVI2Format()
    g = torch.Generator().manual_seed(seed)
    k = large_channel_keys(n, H, g)
    return fmt, *pack(fmt, k, torch.randn(n, H, P, D, generator=g))


@pytest.mark.parametrize("kind", ["key", "value"])
def test_slot_map_is_a_bijection(kind):
    assert torch.equal(ELEMENT_OF_SLOT[kind].sort().values, torch.arange(P * D))


def test_documented_positions():
    """Spot checks of the docstring's formulas. Keys: token 40 = 16 blk + 8 y1 + g (blk 2, y1 1, g 0),
    channel 97 = 64 f1 + 32 f0 + y0 (f1 1, f0 1, y0 1): row 2, lane 0, u 3 (word 256 + 3), h 1, j 1
    (bits 16 + 2 = 18-19: byte 2, field 1). Values: token 37 = 32 blk + 2 q4 + y0 (blk 1, q4 2, y0
    1), channel 50 = 32 f0 + 16 rh + g (f0 1, rh 1, g 2): row 2 blk + rh = 3, lane 4 g + q4 = 10, u 1
    (word 384 + 41), h 1, j 0 (bit 16: byte 2, field 0)."""
    codes = torch.zeros(2, P, D, dtype=torch.long)
    codes[0, 40, 97] = 3
    codes[1, 37, 50] = 2
    kb = codes_to_fragment(codes[0], "key").view(torch.uint8)
    vb = codes_to_fragment(codes[1], "value").view(torch.uint8)
    at = 4 * (256 + 3) + 2
    assert kb.nonzero().flatten().tolist() == [at] and int(kb[at]) == 3 << 2
    at = 4 * (384 + 41) + 2
    assert vb.nonzero().flatten().tolist() == [at] and int(vb[at]) == 2


def test_halves_and_groups_sit_where_the_kernel_reads_them():
    """Keys: rows 0-1 hold token group 0 (tokens 0..31), rows 2-3 group 1; values: word u of a lane's
    four is channel group u; a register's pair (adjacent columns of the A fragment: key channels c, c + 1,
    value tokens t, t + 1) is the same crumb of a word's two 16-bit halves (what the kernel's per-half
    key MMAs, per-group value words and shift-free magic-number pairs rely on)."""
    m = torch.arange(P * D)
    word, c = m // 16, m % 16
    row, u, h, j = word // 128, word % 4, c // 8, c % 8
    k_el, v_el = ELEMENT_OF_SLOT["key"], ELEMENT_OF_SLOT["value"]
    assert torch.equal((k_el // D) // 32, row // 2)
    assert torch.equal((v_el % D) // 32, u)
    lo = h == 0  # slot (word, 0, j) and its partner (word, 1, j) = slot + 8
    assert torch.equal(k_el[m[lo] + 8], k_el[m[lo]] + 1)  # key channel + 1, same token
    assert torch.equal(v_el[m[lo] + 8], v_el[m[lo]] + D)  # value token + 1, same channel
    assert int(j.max()) == 7


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


MAGIC = [0x6400, 0x5C00, 0x5400, 0x4C00, 0x4400]  # fp16 2^(10 - 2j): a code at bits 2j has unit 1


def _crumb_pairs(word: int) -> list[int]:
    """The kernel's asm (kivi2_kernel._crumb_pairs) on one word, bit for bit: 16 fp16 bit patterns,
    element 2 k + i = the i-th half of output register k."""
    out = []
    for k in range(8):
        x, j = (word, k) if k < 5 else (word >> 10, k - 5)
        t = (x & (0x00030003 << (2 * j))) | (MAGIC[j] * 0x10001)  # lop3 (a & b) | c
        for i in range(2):  # sub.f16x2 t, magic: exact, the halves apart
            out.append(int(torch.tensor([(t >> (16 * i)) & 0xFFFF], dtype=torch.int16).view(torch.float16).float()
                           - torch.tensor([MAGIC[j]], dtype=torch.int16).view(torch.float16).float()))
    return out


def test_kernel_dequant_chain_rebuilds_the_tiles():
    """The Gluon kernel's register steps replayed on the logical tensors: the magic-number asm
    emulated bit for bit, then the kernel's reshape/permute to K_h [32, 128] (keys, per half) and
    V^T_{g,h} [32, 32] (values, per group and half) must give exactly the codes at (token, channel).
    (The compiler checks the layouts are trivial; this checks the index algebra those layouts carry.)"""
    codes = torch.randint(0, 4, (2, P, D), generator=torch.Generator().manual_seed(3))
    for kind, c in (("key", codes[0]), ("value", codes[1])):
        words = [[w & 0xFFFFFFFF for w in r] for r in codes_to_fragment(c, kind).view(4, 128).tolist()]
        pairs = {(r, w): _crumb_pairs(words[r][w]) for r in range(4) for w in range(128)}
        for h in range(2):
            if kind == "key":  # x [2 rows, 128 words, 16 elements]
                x = torch.tensor([[pairs[2 * h + r, w] for w in range(128)] for r in range(2)])
                kf = x.reshape(2, 8, 4, 2, 2, 2, 2, 2, 2).permute(0, 7, 1, 3, 4, 5, 6, 2, 8).reshape(32, 128)
                assert torch.equal(kf, c[32 * h:32 * h + 32]), h
                continue
            for g in range(4):  # x [2 rows (rh), 32 lanes (word u = g), 16 elements]
                x = torch.tensor([[pairs[2 * h + r, 4 * lane + g] for lane in range(32)] for r in range(2)])
                vf = x.reshape(2, 8, 4, 2, 2, 2, 2).permute(0, 5, 1, 3, 4, 2, 6).reshape(32, 32)
                assert torch.equal(vf, c[32 * h:32 * h + 32, 32 * g:32 * g + 32].T), (h, g)
