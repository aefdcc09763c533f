"""FP8 pages in MMA-fragment order: what the Gluon kernels that read fp8_e4m3 slabs take (tiered's FP8
tier, tiered_kernel.py; fp8_e4m3's own pools, fp8_kernel.py).

An fp8_e4m3 slab (moekv/kvcache/formats/fp8.py) holds codes e4m3 [P, D] for keys, [D, P] for values,
then the fp16 row scales [P]. The Gluon kernels convert the codes in registers (cvt.rn.f16x2.e4m3x2,
two an instruction) straight into mma_v2 A-operand fragments, 16 tokens a step (K [16, 128] and
V^T [128, 16], as the staged 16-bit tail is read), so each thread must find its fragment's codes in ONE
128-bit load per 512-byte row. This module permutes the 8192 code bytes of each FP8 slab into that
order; everything else of the slab (the scales at their offset, the padding) stays where fp8.py puts
it, so a slab in fragment order has the same size.

FP8 fragment order, version 1 (FP8_FRAGMENT_VERSION). A page-head's codes are 16 rows of 512 bytes,
row 4 i + r for step i (tokens 16 i .. 16 i + 15) and r = 2 f1 + f0; thread `lane` of the warp reads
bytes [16 lane, 16 lane + 16) of every row. With byte = 64 g + 16 q4 + y, y = 8 y3 + 4 y2 + 2 y1 + y0:

  keys:    token = 16 i + 8 y1 + g                 chan = 64 f1 + 32 f0 + 16 y3 + 8 y2 + 2 q4 + y0
  values:  token = 16 i + 8 y2 + 2 q4 + y0         chan = 64 f1 + 32 f0 + 16 y3 + 8 y1 + g

(keys: nuq2's key order with the 2-bit field turned into the row r; lane = 4 g + q4 holds the A
fragment's rows g, g + 8 and column pairs 2 q4 + 8 j; values: rows of V^T are channels.) The
conversion of 4 bytes (one 32-bit word) gives 4 fp16 in register order y1 y0, which the kernel's
reshape/permute turns into the A-operand layout without moving data between threads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.ops.gluon.tables import (
    HEAD_DIM,
    PAGE_TOKENS,
    allocate_tables,
    bit_fields,
    check_kind,
    check_version,
    pick_pages,
)

FP8_FRAGMENT_VERSION = 1
CODE_BYTES = PAGE_TOKENS * HEAD_DIM  # e4m3 codes of one page-head, in front of the slab
STEP_TOKENS = 16  # tokens per step of the kernel's FP8 tile (4 rows of 512 bytes each)


def _element_of_byte(kind: str) -> torch.Tensor:
    """[P * D] long: for byte e of a page-head's FP8 fragment order, the element t * D + c it holds."""
    i, f1, f0, g, q4, y3, y2, y1, y0 = bit_fields(CODE_BYTES, 2, 1, 1, 3, 2, 1, 1, 1, 1)
    if kind == "key":
        token = 16 * i + 8 * y1 + g
        chan = 64 * f1 + 32 * f0 + 16 * y3 + 8 * y2 + 2 * q4 + y0
    else:
        token = 16 * i + 8 * y2 + 2 * q4 + y0
        chan = 64 * f1 + 32 * f0 + 16 * y3 + 8 * y1 + g
    return token * HEAD_DIM + chan


ELEMENT_OF_BYTE = {kind: _element_of_byte(kind) for kind in ("key", "value")}
BYTE_OF_ELEMENT = {kind: torch.argsort(e) for kind, e in ELEMENT_OF_BYTE.items()}
_ON_DEVICE: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _index_on(table: str, kind: str, device: torch.device) -> torch.Tensor:
    """ELEMENT_OF_BYTE / BYTE_OF_ELEMENT [kind] on `device`, copied once (a host copy inside a CUDA
    graph capture is refused: the engine converts the pages a captured step fills)."""
    key = (table, kind, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (ELEMENT_OF_BYTE if table == "element" else BYTE_OF_ELEMENT)[kind].to(device)
    return _ON_DEVICE[key]


def prepare_device(device: torch.device) -> None:
    """Put the permutations on `device` now (before any capture that converts pages)."""
    for kind in ("key", "value"):
        _index_on("element", kind, device)
        _index_on("slot", kind, device)


def _check(what: str, slabs: torch.Tensor, slab_bytes: int) -> None:
    if slabs.dtype != torch.uint8 or slabs.dim() < 1 or slabs.shape[-1] != slab_bytes:
        raise ValueError(f"{what}: FP8 slabs must be uint8 [..., {slab_bytes}], got {slabs.dtype} "
                         f"{tuple(slabs.shape)}")


def _element_codes(slabs: torch.Tensor, kind: str) -> torch.Tensor:
    """The slab's code bytes in element order t * D + c (values are stored [D, P]: transposed here)."""
    codes = slabs[..., :CODE_BYTES]
    if kind == "value":
        codes = codes.reshape(*codes.shape[:-1], HEAD_DIM, PAGE_TOKENS).transpose(-1, -2).reshape(codes.shape)
    return codes


def slabs_to_fragment(fp8_fmt, kind: str, slabs: torch.Tensor) -> torch.Tensor:
    """fp8_e4m3 slabs [..., slab] uint8 (block_size 64, head_dim 128) -> the same slabs with their
    code bytes in FP8 fragment order (scales and padding unchanged). No host sync."""
    check_kind(kind)
    _check("FP8 fragment order", slabs, fp8_fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).slab_bytes)
    out = slabs.clone()
    out[..., :CODE_BYTES] = _element_codes(slabs, kind)[..., _index_on("element", kind, slabs.device)]
    return out


def slabs_from_fragment(fp8_fmt, kind: str, slabs: torch.Tensor, version: int = FP8_FRAGMENT_VERSION) -> torch.Tensor:
    """The inverse of slabs_to_fragment: slabs in FP8 fragment order -> fp8_e4m3's own slabs."""
    check_kind(kind)
    check_version("FP8 fragment order", version, FP8_FRAGMENT_VERSION)
    _check("FP8 fragment order", slabs, fp8_fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).slab_bytes)
    codes = slabs[..., :CODE_BYTES][..., _index_on("slot", kind, slabs.device)]  # element order
    if kind == "value":  # back to [D, P]
        codes = codes.reshape(*codes.shape[:-1], PAGE_TOKENS, HEAD_DIM).transpose(-1, -2).reshape(codes.shape)
    out = slabs.clone()
    out[..., :CODE_BYTES] = codes
    return out


def dequantize_fragment_slabs(fp8_fmt, kind: str, slabs: torch.Tensor) -> torch.Tensor:
    """Slabs [n, H, slab] in FP8 fragment order -> pages [n, H, 64, 128] fp32, as fp8_e4m3 dequantizes."""
    plain = slabs_from_fragment(fp8_fmt, kind, slabs)
    return fp8_fmt.dequantize(fp8_fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).unpack(plain), kind)


def scale_offset(fp8_fmt, kind: str) -> int:
    """Byte offset of the fp16 row scales in the slab (the kernel reads them there)."""
    return int(fp8_fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).offsets["scale"])


# -- fp8_e4m3's own pools in fragment order (FragmentPagedFormat's layout module) --------------------
@dataclass
class FP8FragmentPages:
    """A layer's fp8_e4m3 pools in fragment order: whole slabs [N, H, slab] uint8, codes in FP8
    fragment order, row scales where fp8.py puts them; fmt: the FP8Format they belong to (its slab
    layout: where the scales are, how codes dequantize)."""

    k_slabs: torch.Tensor
    v_slabs: torch.Tensor
    fmt: object
    version: int = FP8_FRAGMENT_VERSION

    @property
    def num_kv_heads(self) -> int:
        return self.k_slabs.shape[1]


FRAGMENT_FIELDS = ("k_slabs", "v_slabs")


def check_shape(fmt, block_size: int, head_dim: int) -> None:
    if getattr(fmt, "name", None) != "fp8_e4m3":
        raise ValueError(f"FP8 fragment order: needs an FP8Format, got {type(fmt).__name__}")
    if (block_size, head_dim) != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"FP8 fragment order (version {FP8_FRAGMENT_VERSION}) is defined for block_size "
                         f"{PAGE_TOKENS} and head_dim {HEAD_DIM}, got {block_size} and {head_dim}")


def fragment_bytes_per_page_head(fmt) -> int:
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    return sum(fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).slab_bytes for kind in ("key", "value"))


def allocate_fragment_tables(fmt, num_blocks: int, num_kv_heads: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Empty pools [num_blocks, num_kv_heads, slab] uint8 (zero codes and scales: the same in either order)."""
    prepare_device(device)
    return allocate_tables({f"{name}_slabs": ((fmt.layout(kind, PAGE_TOKENS, HEAD_DIM).slab_bytes,), torch.uint8)
                            for name, kind in (("k", "key"), ("v", "value"))}, num_blocks, num_kv_heads, device)


def kind_to_fragment(fmt, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One kind's fp8_e4m3 slabs [N, H, slab] -> its pool's rows in fragment order. No host sync."""
    return {("k" if kind == "key" else "v") + "_slabs": slabs_to_fragment(fmt, kind, slabs)}


def fragment_view(fmt, tensors, page_ids: torch.Tensor | None = None) -> FP8FragmentPages:
    """FP8FragmentPages of fmt over a pool's tables (a LayerKVCache or dict), all pages or page_ids only."""
    return FP8FragmentPages(**pick_pages(tensors, FRAGMENT_FIELDS, page_ids), fmt=fmt)


def dequantize_fragment(frag: FP8FragmentPages, kind: str) -> torch.Tensor:
    """Pages [N, H, 64, 128] fp32 from slabs in fragment order, as fp8_e4m3 dequantizes them."""
    check_kind(kind)
    check_version("FP8 fragment order", frag.version, FP8_FRAGMENT_VERSION)
    return dequantize_fragment_slabs(frag.fmt, kind, frag.k_slabs if kind == "key" else frag.v_slabs)


def to_fragment_order(fmt, k_pages: torch.Tensor, v_pages: torch.Tensor) -> FP8FragmentPages:
    """fp8_e4m3 slabs k_pages, v_pages [N, H, slab] uint8 (block_size 64, head_dim 128) -> the same
    pages in fragment order."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    return FP8FragmentPages(slabs_to_fragment(fmt, "key", k_pages), slabs_to_fragment(fmt, "value", v_pages), fmt)
