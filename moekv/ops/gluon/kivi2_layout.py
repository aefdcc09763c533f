"""kivi2 pages in MMA-fragment order: what the Gluon kivi2 decode kernel (kivi2_decode.py) reads.

kivi2 stores a (page, kv head) slab as 2-bit codes [P, D/4] (channel 4j + i in bits 2i of byte j)
with fp16 scale and zero tables: keys per channel over groups of 32 tokens ([P/32, D]), values per
token over groups of 32 channels ([P, D/32]) (moekv/kvcache/formats/kivi2.py). The Gluon kernel turns
the codes into fp16 in registers straight into mma_v2 A-operand fragments (one warp, K and V^T as
the A operand, m16n8k16), so each page-head's codes (P = 64 tokens, D = 128 channels, 2048 bytes)
are reordered into the order the consuming thread holds them.

Fragment order, version 1 (KIVI2_FRAGMENT_VERSION). A page-head's 2048 bytes are 4 rows of 512 bytes
(128 int32 words); thread `lane` reads words [4 lane, 4 lane + 4) of every row (one 128-bit load).
Word u of a lane holds 16 codes, the code of slot (h, j) in bits 16 h + 2 j: each 16-bit half holds 8
codes at bits 0, 2, .., 14, so (w & 0x00030003 << 2j) | magic_j is an fp16 pair (magic_j + code, same
for the other half) with magic_j = 2^(10 - 2j) (j < 5: the code's bits fall in the mantissa where their
unit is 1), minus magic_j exactly the codes: two instructions a pair and no shift; j = 5..7 after one
shift of the word by 10. Write lane = 4 g + q4, u = 2 f1 + f0, h = y0 and j = y1 + 2 y2 + 4 y3; then

  keys   (row = blk, 16 tokens each)          token = 16 blk + 8 y1 + g
                                              chan  = 64 f1 + 32 f0 + 16 y3 + 8 y2 + 2 q4 + y0
  values (row = 2 blk + rh)                   token = 32 blk + 16 y3 + 8 y2 + 2 q4 + y0
                                              chan  = 64 f1 + 32 f0 + 16 rh + 8 y1 + g

(nuq2's index formulas, with the bits placed so that the pair of a register (y0) is the word's two
halves). What it gives kivi2's algebra: key rows 0-1 are the first token group (tokens 0..31) and rows
2-3 the second, so each half of a page is one key scale/zero row; word u of a lane is value channel
group u (channels 32 u .. 32 u + 31), so a group's V^T tile comes from one word a row.

Side tables (per page-head; kivi2's own values, nothing re-quantized):
  k_scale, k_zero   fp16 [N, H, 2, 128]   per (token group of 32, channel), each row in thread order:
                                          position 32 q4 + 2 i + e holds channel 8 i + 2 q4 + e
                                          (KEY_SIDE_CHANNEL), the 32 channels a thread's MMA operands
                                          hold (lane = 4 g + q4) contiguous: four 16-byte loads a row
  v_scale, v_zero   fp16 [N, H, 64, 4]    per (token, channel group of 32), as kivi2 stores them
Covered: block_size 64, head_dim 128, group 32 (KIVI's G; G = 64 keeps the slab path).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from moekv.ops.gluon import two_bit
from moekv.ops.gluon.tables import (
    HEAD_DIM,
    PAGE_TOKENS,
    allocate_tables,
    bit_fields,
    check_kind,
    check_version,
    pick_pages,
    slab_fields,
    table_bytes,
)
from moekv.ops.gluon.two_bit import PAGE_BYTES, WORDS_PER_PAGE

KIVI2_FRAGMENT_VERSION = 1
GROUP = 32  # tokens per key group and channels per value group the order is defined for
KEY_GROUPS = PAGE_TOKENS // GROUP  # 2 token groups a page
VALUE_GROUPS = HEAD_DIM // GROUP  # 4 channel groups a head


def _element_of_slot(kind: str) -> torch.Tensor:
    """[P * D] long: for slot 16 * word + 8 h + j (the code in bits 16 h + 2 j of the word; as bytes:
    slot = 4 * byte + field, the packing two_bit.codes_to_fragment writes) the element t * D + c."""
    # word = 128 row + 4 lane + u, lane = 4 g + q4, u = 2 f1 + f0; h = y0; j = 4 y3 + 2 y2 + y1
    row, g, q4, f1, f0, y0, y3, y2, y1 = bit_fields(PAGE_TOKENS * HEAD_DIM, 2, 3, 2, 1, 1, 1, 1, 1, 1)
    if kind == "key":
        token = 16 * row + 8 * y1 + g
        chan = 64 * f1 + 32 * f0 + 16 * y3 + 8 * y2 + 2 * q4 + y0
    elif kind == "value":
        blk, rh = row // 2, row % 2
        token = 32 * blk + 16 * y3 + 8 * y2 + 2 * q4 + y0
        chan = 64 * f1 + 32 * f0 + 16 * rh + 8 * y1 + g
    else:
        raise ValueError(f"kind={kind!r}: expected 'key' or 'value'")
    return token * HEAD_DIM + chan


ELEMENT_OF_SLOT = {kind: _element_of_slot(kind) for kind in ("key", "value")}
_q4, _i, _e = bit_fields(HEAD_DIM, 2, 4, 1)
KEY_SIDE_CHANNEL = 8 * _i + 2 * _q4 + _e  # position p of a stored key scale / zero row -> its channel
KEY_SIDE_POSITION = torch.argsort(KEY_SIDE_CHANNEL)  # channel -> its position
_SIDE_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _side_index(which: str, device: torch.device) -> torch.Tensor:
    key = (which, torch.device(device))
    if key not in _SIDE_ON_DEVICE:  # copied once (no host copy inside a captured step)
        _SIDE_ON_DEVICE[key] = (KEY_SIDE_CHANNEL if which == "channel" else KEY_SIDE_POSITION).to(device)
    return _SIDE_ON_DEVICE[key]


def key_side_to_thread_order(x: torch.Tensor) -> torch.Tensor:
    """[..., 128] by channel -> by position (what k_scale / k_zero store)."""
    return x[..., _side_index("channel", x.device)].contiguous()


def key_side_by_channel(x: torch.Tensor) -> torch.Tensor:
    """The stored [..., 128] (thread order) -> by channel."""
    return x[..., _side_index("position", x.device)]
two_bit.register_order("kivi2", ELEMENT_OF_SLOT)


def codes_to_fragment(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [..., 64, 128] in 0..3 -> int32 words [..., 512] in kivi2's fragment order."""
    return two_bit.codes_to_fragment(codes, kind, "kivi2")


def codes_from_fragment(words: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 words [..., 512] in kivi2's fragment order -> codes [..., 64, 128] (int64)."""
    return two_bit.codes_from_fragment(words, kind, "kivi2")


def prepare_device(device: torch.device) -> None:
    two_bit.prepare_device(device, "kivi2")
    _side_index("channel", device)
    _side_index("position", device)


@dataclass
class Kivi2FragmentPages:
    """A layer's kivi2 page pools in fragment order (N pages, H kv heads); see the module docstring."""

    k_codes: torch.Tensor  # int32 [N, H, 512]
    v_codes: torch.Tensor  # int32 [N, H, 512]
    k_scale: torch.Tensor  # fp16 [N, H, 2, 128]
    k_zero: torch.Tensor
    v_scale: torch.Tensor  # fp16 [N, H, 64, 4]
    v_zero: torch.Tensor
    version: int = KIVI2_FRAGMENT_VERSION

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def kernel_bytes_per_page_head(self) -> int:
        """What the kernel reads per page-head: K and V codes, their scales and zeros (= kivi2's slabs)."""
        return 2 * PAGE_BYTES + 2 * 2 * (KEY_GROUPS * HEAD_DIM) + 2 * 2 * (PAGE_TOKENS * VALUE_GROUPS)


def check_shape(fmt, block_size: int, head_dim: int) -> None:
    if getattr(fmt, "name", None) != "kivi2":
        raise ValueError(f"kivi2 fragment order: needs a KIVI2Format, got {type(fmt).__name__}")
    if (block_size, head_dim, fmt.group) != (PAGE_TOKENS, HEAD_DIM, GROUP):
        raise ValueError(f"kivi2 fragment order (version {KIVI2_FRAGMENT_VERSION}) is defined for block_size "
                         f"{PAGE_TOKENS}, head_dim {HEAD_DIM} and group {GROUP}, got {block_size}, {head_dim} "
                         f"and {fmt.group}")


def kind_to_fragment(fmt, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One kind's kivi2 slabs [N, H, slab] uint8 -> its fragment-order tables, named as
    Kivi2FragmentPages' fields. No host sync and no copy from the host (usable inside captured steps)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    name, f = slab_fields("kivi2 fragment order", fmt, kind, slabs)
    packed = f["codes"]  # [N, H, P, D/4]: channel 4j + i in bits 2i of byte j (kivi2's slabs)
    codes = torch.stack([(packed >> (2 * i)) & 3 for i in range(4)], dim=-1).flatten(-2)
    side = key_side_to_thread_order if kind == "key" else torch.Tensor.contiguous
    return {f"{name}_codes": codes_to_fragment(codes, kind), f"{name}_scale": side(f["scale"]),
            f"{name}_zero": side(f["zero"])}


def to_fragment_order(fmt, k_pages: torch.Tensor, v_pages: torch.Tensor) -> Kivi2FragmentPages:
    """kivi2 slabs k_pages, v_pages [N, H, slab] uint8 (block_size 64, head_dim 128, group 32)
    -> the same pages in fragment order."""
    return Kivi2FragmentPages(**kind_to_fragment(fmt, "key", k_pages), **kind_to_fragment(fmt, "value", v_pages))


def from_fragment_order(fmt, frag: Kivi2FragmentPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_fragment_order: (k_pages, v_pages) kivi2 slabs [N, H, slab] uint8."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    check_version("kivi2 fragment order", frag.version, KIVI2_FRAGMENT_VERSION)
    slabs = []
    for name, kind in (("k", "key"), ("v", "value")):
        codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind).to(torch.uint8)
        side = key_side_by_channel if kind == "key" else (lambda t: t)
        packed = sum(codes[..., i::4] << (2 * i) for i in range(4)).to(torch.uint8)  # channel 4j + i: bits 2i of j
        values = {"codes": packed, "scale": side(getattr(frag, f"{name}_scale")),
                  "zero": side(getattr(frag, f"{name}_zero"))}
        slabs.append(fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).pack(values))
    return slabs[0], slabs[1]


def dequantize_fragment(frag: Kivi2FragmentPages, kind: str) -> torch.Tensor:
    """Pages [N, H, 64, 128] fp32 from the fragment-ordered tables, as kivi2's dequantize computes them."""
    check_kind(kind)
    name = "k" if kind == "key" else "v"
    codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind).float()  # [N, H, P, D]
    n, heads = codes.shape[:2]
    scale, zero = getattr(frag, f"{name}_scale").float(), getattr(frag, f"{name}_zero").float()
    if kind == "key":  # [N, H, 2, D] over each group's 32 tokens
        scale, zero = key_side_by_channel(scale), key_side_by_channel(zero)
        x = codes.view(n, heads, KEY_GROUPS, GROUP, HEAD_DIM) * scale[:, :, :, None] + zero[:, :, :, None]
    else:  # [N, H, P, 4] over each group's 32 channels
        x = codes.view(n, heads, PAGE_TOKENS, VALUE_GROUPS, GROUP) * scale[..., None] + zero[..., None]
    return x.reshape(n, heads, PAGE_TOKENS, HEAD_DIM)


FRAGMENT_FIELDS = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")


def fragment_table_shapes(fmt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per (page, kv head): each fragment table's trailing shape and dtype (what an engine pool holds)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    return {"k_codes": ((WORDS_PER_PAGE,), torch.int32), "v_codes": ((WORDS_PER_PAGE,), torch.int32),
            "k_scale": ((KEY_GROUPS, HEAD_DIM), torch.float16), "k_zero": ((KEY_GROUPS, HEAD_DIM), torch.float16),
            "v_scale": ((PAGE_TOKENS, VALUE_GROUPS), torch.float16),
            "v_zero": ((PAGE_TOKENS, VALUE_GROUPS), torch.float16)}


def fragment_bytes_per_page_head(fmt) -> int:
    return table_bytes(fragment_table_shapes(fmt))


def allocate_fragment_tables(fmt, num_blocks: int, num_kv_heads: int,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """Empty fragment-order pools [num_blocks, num_kv_heads, ...] (zero codes, scales and zeros)."""
    prepare_device(device)
    return allocate_tables(fragment_table_shapes(fmt), num_blocks, num_kv_heads, device)


def fragment_view(tensors, page_ids: torch.Tensor | None = None) -> Kivi2FragmentPages:
    """Kivi2FragmentPages over a pool's tables (a LayerKVCache or dict), all pages or page_ids only."""
    return Kivi2FragmentPages(**pick_pages(tensors, FRAGMENT_FIELDS, page_ids))
