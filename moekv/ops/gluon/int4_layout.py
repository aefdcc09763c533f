"""int4 pages in MMA-fragment order: what the Gluon int4 decode kernel (int4_decode.py) reads.

int4 stores a (page, kv head) slab as nibble codes [P, D/2] (even channel in the low nibble), a
per-(token, group of 32 channels) fp16 scale and zero, and a few bf16 outlier channels (int4.py).
The Gluon kernel turns 8 nibbles of a 32-bit word into 4 fp16 pairs in registers with the
magic-number trick ((w >> 4k) & 0x000f000f | 0x64006400 is the fp16 pair (1024 + n_k, 1024 + n_{k+4}),
minus 1024 exactly), straight into mma_v2 A-operand fragments (one warp, m16n8k16, K and V^T as the A
operand, one group of 32 channels at a time). This module reorders each page-head's codes (P = 64
tokens, D = 128 channels, 4096 bytes) into that order and derives the side tables; `from_fragment_order`
is the exact inverse.

Fragment order, version 1 (INT4_FRAGMENT_VERSION). A page-head's 4096 bytes are 8 rows of 512 bytes;
rows 2 g and 2 g + 1 hold channel group g (32 channels); thread `lane` of the warp reads bytes
[16 lane, 16 lane + 16) of a row (one 128-bit load: words u = 0..3). Nibble n of a little-endian
32-bit word (bits 4n..4n+3) is the word's slot e = 2 (n % 4) + n // 4 (so the conversion's k-th fp16
pair holds slots 2k, 2k + 1). Write row = 2 g + i0, lane = 4 l' + q4 (l' = lane // 4), u = 2 u1 + u0,
e = 4 e2 + 2 e1 + e0; then

  keys   token = l' + 8 e1 + 16 u1 + 32 i0        channel = 32 g + e0 + 2 q4 + 8 e2 + 16 u0
  values token = e0 + 2 q4 + 8 e2 + 16 u0 + 32 u1  channel = 32 g + l' + 8 e1 + 16 i0

which are the A-operand layouts of K_g [64 tokens, 32 channels] and V^T_g [32 channels, 64 tokens]
(gl.to_linear_layout of DotOperandLayout(0, mma_v2) at those shapes: register bits e0, e1, e2, u0,
u1, i0 and lane bits q4, l' map to exactly these rows and columns), so the kernel's reshape/permute to
the tile moves no data (convert_layout(assert_trivial=True) checks it at compile time).

Side tables (per page-head; int4's own values, nothing re-quantized):
  k_scale, k_zero, v_scale, v_zero  fp16 [N, H, 64, 4]   per token and group, as int4 stores them
  k_out_idx, v_out_idx              int32 [N, H, O]       the outlier channels
  k_out_val, v_out_val              bf16 [N, H, 64, O]    their values (kept for the exact inverse)
  k_out_delta, v_out_delta          fp32 [N, H, 64, O]    derived: value - zero[t, channel // 32], what the
                                                          outlier adds to the codes' term there (int4
                                                          writes code 0 at outlier channels)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from moekv.ops.gluon.tables import (
    HEAD_DIM,
    PAGE_TOKENS,
    allocate_tables,
    check_version,
    pick_pages,
    slab_fields,
    table_bytes,
)

INT4_FRAGMENT_VERSION = 1
GROUP = 32  # the fragment order is defined for int4 with group_size 32
GROUPS = HEAD_DIM // GROUP
PAGE_BYTES = PAGE_TOKENS * HEAD_DIM // 2
WORDS_PER_PAGE = PAGE_BYTES // 4
MAX_OUTLIERS = 4  # the kernel's side MMA has room for 4 outlier channels (hi and lo parts)


def _element_of_slot(kind: str) -> torch.Tensor:
    """[P * D] long: for nibble m = 2 * byte + (0 low, 1 high) of a page-head's fragment order, the
    element t * D + c whose code it holds."""
    m = torch.arange(PAGE_TOKENS * HEAD_DIM)
    word, n = m // 8, m % 8
    row, lane, u = word // 128, (word % 128) // 4, word % 4
    e = 2 * (n % 4) + n // 4
    g, i0 = row // 2, row % 2
    lq, q4 = lane // 4, lane % 4
    u1, u0 = u // 2, u % 2
    e2, e1, e0 = e // 4, (e // 2) % 2, e % 2
    if kind == "key":
        token = lq + 8 * e1 + 16 * u1 + 32 * i0
        chan = GROUP * g + e0 + 2 * q4 + 8 * e2 + 16 * u0
    elif kind == "value":
        token = e0 + 2 * q4 + 8 * e2 + 16 * u0 + 32 * u1
        chan = GROUP * g + lq + 8 * e1 + 16 * i0
    else:
        raise ValueError(f"kind={kind!r}: expected 'key' or 'value'")
    return token * HEAD_DIM + chan


ELEMENT_OF_SLOT = {kind: _element_of_slot(kind) for kind in ("key", "value")}
SLOT_OF_ELEMENT = {kind: torch.argsort(e) for kind, e in ELEMENT_OF_SLOT.items()}
_ON_DEVICE: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _index_on(table: str, kind: str, device: torch.device) -> torch.Tensor:
    """The reorder's index tables on `device`, copied once (a host copy inside a CUDA graph capture is
    refused)."""
    key = (table, kind, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (ELEMENT_OF_SLOT if table == "element" else SLOT_OF_ELEMENT)[kind].to(device)
    return _ON_DEVICE[key]


def prepare_device(device: torch.device) -> None:
    for kind in ("key", "value"):
        _index_on("element", kind, device)
        _index_on("slot", kind, device)


def _check_kind(kind: str) -> None:
    if kind not in ELEMENT_OF_SLOT:
        raise ValueError(f"kind={kind!r}: expected 'key' or 'value'")


def codes_to_fragment(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [..., 64, 128] in 0..15 -> int32 words [..., 1024] in fragment order."""
    _check_kind(kind)
    if codes.shape[-2:] != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"codes_to_fragment: codes must end in [{PAGE_TOKENS}, {HEAD_DIM}], got {tuple(codes.shape)}")
    lead = codes.shape[:-2]
    flat = codes.reshape(*lead, PAGE_TOKENS * HEAD_DIM).to(torch.uint8)
    nib = flat[..., _index_on("element", kind, codes.device)].reshape(*lead, PAGE_BYTES, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).contiguous().view(torch.int32)


def codes_from_fragment(words: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 words [..., 1024] in fragment order -> codes [..., 64, 128] (int64)."""
    _check_kind(kind)
    lead = words.shape[:-1]
    b = words.contiguous().view(torch.uint8)  # [..., 4096]
    nib = torch.stack([b & 15, b >> 4], dim=-1).reshape(*lead, PAGE_TOKENS * HEAD_DIM)
    return nib[..., _index_on("slot", kind, words.device)].reshape(*lead, PAGE_TOKENS, HEAD_DIM).long()


def outlier_deltas(out_idx: torch.Tensor, out_val: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 [N, H, 64, O]: outlier value - zero[t, group of its channel] (the codes' term there)."""
    g = (out_idx.long() // GROUP)[:, :, None, :].expand(-1, -1, zero.shape[2], -1)  # [N, H, 64, O]
    return (out_val.float() - zero.float().gather(-1, g)).contiguous()


@dataclass
class Int4FragmentPages:
    """A layer's int4 page pools in fragment order (N pages, H kv heads); see the module docstring."""

    k_codes: torch.Tensor  # int32 [N, H, 1024]
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # fp16 [N, H, 64, 4]
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_out_idx: torch.Tensor  # int32 [N, H, O]
    v_out_idx: torch.Tensor
    k_out_val: torch.Tensor  # bf16 [N, H, 64, O]
    v_out_val: torch.Tensor
    version: int = INT4_FRAGMENT_VERSION
    k_out_delta: torch.Tensor | None = None  # fp32 [N, H, 64, O]; None: derived here
    v_out_delta: torch.Tensor | None = None

    def __post_init__(self):
        if (self.k_out_delta is None) != (self.v_out_delta is None):
            raise ValueError("Int4FragmentPages: k_out_delta and v_out_delta come together (or both None)")
        if self.k_out_delta is None:
            self.k_out_delta = outlier_deltas(self.k_out_idx, self.k_out_val, self.k_zero)
            self.v_out_delta = outlier_deltas(self.v_out_idx, self.v_out_val, self.v_zero)

    @property
    def num_outliers(self) -> int:
        return self.k_out_idx.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def kernel_bytes_per_page_head(self) -> int:
        """What the kernel reads per page-head: K and V codes, scales, zeros, outlier channels and deltas."""
        o = self.num_outliers
        return 2 * (PAGE_BYTES + 2 * PAGE_TOKENS * GROUPS * 2 + 4 * o + 4 * PAGE_TOKENS * o)


def check_shape(fmt, block_size: int, head_dim: int) -> None:
    if getattr(fmt, "name", None) != "int4":
        raise ValueError(f"int4 fragment order: needs an Int4Format, got {type(fmt).__name__}")
    if (block_size, head_dim, fmt.group_size) != (PAGE_TOKENS, HEAD_DIM, GROUP):
        raise ValueError(f"int4 fragment order (version {INT4_FRAGMENT_VERSION}) is defined for block_size "
                         f"{PAGE_TOKENS}, head_dim {HEAD_DIM} and group_size {GROUP}, got {block_size}, {head_dim} "
                         f"and {fmt.group_size}")
    if not 1 <= fmt.num_outliers(head_dim) <= MAX_OUTLIERS:
        raise ValueError(f"int4 fragment order: at most {MAX_OUTLIERS} outlier channels, the format has "
                         f"{fmt.num_outliers(head_dim)}")


def kind_to_fragment(fmt, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One kind's int4 slabs [N, H, slab] uint8 -> its fragment-order tables, named as
    Int4FragmentPages' fields. No host sync (usable inside captured steps)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    name, f = slab_fields("int4 fragment order", fmt, kind, slabs)
    packed = f["codes"]  # [N, H, P, D/2]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)  # even channel in the low nibble
    idx = f["outlier_idx"].to(torch.int32).contiguous()
    out = {f"{name}_codes": codes_to_fragment(codes, kind), f"{name}_scale": f["scale"].contiguous(),
           f"{name}_zero": f["zero"].contiguous(), f"{name}_out_idx": idx,
           f"{name}_out_val": f["outlier_val"].contiguous()}
    out[f"{name}_out_delta"] = outlier_deltas(idx, out[f"{name}_out_val"], out[f"{name}_zero"])
    return out


def to_fragment_order(fmt, k_pages: torch.Tensor, v_pages: torch.Tensor) -> Int4FragmentPages:
    """int4 slabs k_pages, v_pages [N, H, slab] uint8 (block_size 64, head_dim 128, group_size 32)
    -> the same pages in fragment order."""
    return Int4FragmentPages(**kind_to_fragment(fmt, "key", k_pages), **kind_to_fragment(fmt, "value", v_pages))


def from_fragment_order(fmt, frag: Int4FragmentPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_fragment_order: (k_pages, v_pages) int4 slabs [N, H, slab] uint8."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    check_version("int4 fragment order", frag.version, INT4_FRAGMENT_VERSION)
    slabs = []
    for name, kind in (("k", "key"), ("v", "value")):
        codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind).to(torch.uint8)
        values = {"codes": codes[..., 0::2] | (codes[..., 1::2] << 4), "scale": getattr(frag, f"{name}_scale"),
                  "zero": getattr(frag, f"{name}_zero"), "outlier_val": getattr(frag, f"{name}_out_val"),
                  "outlier_idx": getattr(frag, f"{name}_out_idx").to(torch.uint8)}
        slabs.append(fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).pack(values))
    return slabs[0], slabs[1]


def dequantize_fragment(frag: Int4FragmentPages, kind: str) -> torch.Tensor:
    """Pages [N, H, 64, 128] fp32 from the fragment-ordered tables, as int4's dequantize computes them."""
    name = "k" if kind == "key" else "v"
    codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind).float()  # [N, H, P, D]
    n, heads = codes.shape[:2]
    scale = getattr(frag, f"{name}_scale").float()[..., None]
    zero = getattr(frag, f"{name}_zero").float()[..., None]
    x = (codes.view(n, heads, PAGE_TOKENS, GROUPS, GROUP) * scale + zero).reshape(n, heads, PAGE_TOKENS, HEAD_DIM)
    idx = getattr(frag, f"{name}_out_idx").long()[:, :, None, :].expand(-1, -1, PAGE_TOKENS, -1)
    return x.scatter_(-1, idx, getattr(frag, f"{name}_out_val").float())


FRAGMENT_FIELDS = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "k_out_idx", "v_out_idx",
                   "k_out_val", "v_out_val", "k_out_delta", "v_out_delta")


def fragment_table_shapes(fmt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per (page, kv head): each fragment table's trailing shape and dtype (what an engine pool holds)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    o = fmt.num_outliers(HEAD_DIM)
    out = {}
    for name in ("k", "v"):
        out.update({f"{name}_codes": ((WORDS_PER_PAGE,), torch.int32),
                    f"{name}_scale": ((PAGE_TOKENS, GROUPS), torch.float16),
                    f"{name}_zero": ((PAGE_TOKENS, GROUPS), torch.float16),
                    f"{name}_out_idx": ((o,), torch.int32), f"{name}_out_val": ((PAGE_TOKENS, o), torch.bfloat16),
                    f"{name}_out_delta": ((PAGE_TOKENS, o), torch.float32)})
    return out


def fragment_bytes_per_page_head(fmt) -> int:
    return table_bytes(fragment_table_shapes(fmt))


def allocate_fragment_tables(fmt, num_blocks: int, num_kv_heads: int,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """Empty fragment-order pools [num_blocks, num_kv_heads, ...] (zero codes, scales, zeros, deltas;
    outlier channel 0)."""
    prepare_device(device)
    return allocate_tables(fragment_table_shapes(fmt), num_blocks, num_kv_heads, device)


def fragment_view(tensors, page_ids: torch.Tensor | None = None) -> Int4FragmentPages:
    """Int4FragmentPages over a pool's tables (a LayerKVCache or dict), all pages or page_ids only."""
    return Int4FragmentPages(**pick_pages(tensors, FRAGMENT_FIELDS, page_ids))
