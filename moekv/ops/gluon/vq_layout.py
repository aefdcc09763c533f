"""vq pages in MMA-fragment order: what the Gluon vq decode kernel (vq_decode.py) reads.

vq stores a (page, kv head) slab as one uint8 code per 8-channel group of a token ([P, D/8]: group j
= channels 8 j .. 8 j + 7, a row of the head's 256-entry codebook of group j), a per-token fp16 scale
and, for keys, the page's fp8 channel means (moekv/kvcache/formats/vq.py). The Gluon kernel gathers
each code's codeword (8 e4m3 bytes, one 8-byte load, widened to fp16) straight into mma_v2 A-operand
fragments (one warp, K and V^T as the A operand, m16n8k16). An A fragment gives lane 4 g + q4 rows
g, g + 8 and the column pairs (2 q4, 2 q4 + 1), (2 q4 + 8, 2 q4 + 9) of every 16 x 16 tile, so the
tiles' rows and columns are a permutation of the head's channels chosen for whole codewords:

  keys (K [64 tokens, 128 columns]): column f = 16 kk + 8 hh + 2 q4 + e holds channel
      KEY_CHANNEL_OF_COLUMN[f] = 32 q4 + 4 kk + 2 hh + e: lane q4's 32 columns are the 4 groups 4 q4 ..
      4 q4 + 3, codeword m of them the k-steps 2 m and 2 m + 1 (q follows the same order: q . k does not
      depend on it);
  values (V^T [128 rows, 64 tokens]): row r = 16 b + 8 a + g holds channel
      VALUE_CHANNEL_OF_ROW[r] = 16 g + 8 a + b: lane g's 16 rows are the groups 2 g and 2 g + 1 (the
      output O^T comes out in this row order and is stored by channel).

Fragment order, version 1 (VQ_FRAGMENT_VERSION). A page-head's 1024 code bytes per kind: lane L = 4 g +
q4 reads bytes [32 L, 32 L + 32), the first 16 for tokens 0..31 and the last 16 for tokens 32..63 (one
128-bit load per half page); byte 32 L + 16 h + R holds the code of

  keys    R = 8 mt + 4 i + m          token 32 h + 16 mt + 8 i + g, group 4 q4 + m
  values  R = 8 kk + 4 hh + 2 e + a   token 32 h + 16 kk + 8 hh + 2 q4 + e, group 2 g + a

Side tables per page-head: k_tok_scale, v_tok_scale fp16 [64] (by token) and k_mean fp8 [128] in column
order (position f holds the mean of channel KEY_CHANNEL_OF_COLUMN[f]). The calibration tables (per layer
and kv head, shared by all pages) ride along: k_codebook, v_codebook fp8 e4m3 [H, 16, 256, 8] (vq's
codewords are e4m3 values) and the keys' k_chan_scale fp32 [H, 128] by channel. Covered: block_size 64,
head_dim 128, 8-channel codes, no outlier slots (vq's slab padding leaves none at this shape).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

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

VQ_FRAGMENT_VERSION = 1
SUB = 8  # channels per code
GROUPS = HEAD_DIM // SUB  # 16 codes a token
CODE_BYTES = PAGE_TOKENS * GROUPS  # 1024 a page-head and kind
CODE_WORDS = CODE_BYTES // 4
CODEBOOK_DTYPE = torch.float8_e4m3fn  # vq's codewords are e4m3 values: 8 bytes a codeword, exact
CODEWORDS = 256  # entries of a channel group's codebook (a uint8 code)


def _element_of_byte(kind: str) -> torch.Tensor:
    """[1024] long: for byte 32 L + 16 h + R of a page-head's fragment order, the code t * 16 + j it holds."""
    check_kind(kind)
    if kind == "key":
        g, q4, h, mt, i, m = bit_fields(CODE_BYTES, 3, 2, 1, 1, 1, 2)
        token, group = 32 * h + 16 * mt + 8 * i + g, 4 * q4 + m
    else:
        g, q4, h, kk, hh, e, a = bit_fields(CODE_BYTES, 3, 2, 1, 1, 1, 1, 1)
        token, group = 32 * h + 16 * kk + 8 * hh + 2 * q4 + e, 2 * g + a
    return token * GROUPS + group


ELEMENT_OF_BYTE = {kind: _element_of_byte(kind) for kind in ("key", "value")}
BYTE_OF_ELEMENT = {kind: torch.argsort(e) for kind, e in ELEMENT_OF_BYTE.items()}
_kk, _hh, _q4, _e = bit_fields(HEAD_DIM, 3, 1, 2, 1)
KEY_CHANNEL_OF_COLUMN = 32 * _q4 + 4 * _kk + 2 * _hh + _e  # K's column f -> its channel
_b, _a, _g = bit_fields(HEAD_DIM, 3, 1, 3)
VALUE_CHANNEL_OF_ROW = 16 * _g + 8 * _a + _b  # V^T's (and O^T's) row r -> its channel
_ON_DEVICE: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _on(device: torch.device, table: str, kind: str = "") -> torch.Tensor:
    """An index table on `device`, copied once (no host copy inside a captured step)."""
    key = (table, kind, torch.device(device))
    if key not in _ON_DEVICE:
        source = {"element": ELEMENT_OF_BYTE, "byte": BYTE_OF_ELEMENT}.get(table)
        _ON_DEVICE[key] = (source[kind] if source else KEY_CHANNEL_OF_COLUMN).to(device)
    return _ON_DEVICE[key]


def codes_to_fragment(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [..., 64, 16] uint8 (vq's slab order) -> int32 words [..., 256] in fragment order."""
    check_kind(kind)
    if codes.shape[-2:] != (PAGE_TOKENS, GROUPS):
        raise ValueError(f"vq codes_to_fragment: codes must end in [{PAGE_TOKENS}, {GROUPS}], got {tuple(codes.shape)}")
    flat = codes.reshape(*codes.shape[:-2], CODE_BYTES).to(torch.uint8)
    return flat[..., _on(codes.device, "element", kind)].contiguous().view(torch.int32)


def codes_from_fragment(words: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 words [..., 256] in fragment order -> codes [..., 64, 16] uint8."""
    check_kind(kind)
    flat = words.contiguous().view(torch.uint8)
    return flat[..., _on(words.device, "byte", kind)].reshape(*words.shape[:-1], PAGE_TOKENS, GROUPS)


def mean_to_columns(mean: torch.Tensor) -> torch.Tensor:
    """[..., 128] fp8 by channel -> by K column (what k_mean stores)."""
    raw = mean.contiguous().view(torch.uint8)  # fp8 has no indexing on CPU
    return raw[..., _on(mean.device, "column")].contiguous().view(mean.dtype)


def mean_by_channel(mean: torch.Tensor) -> torch.Tensor:
    """The stored [..., 128] fp8 (by K column) -> by channel."""
    raw = mean.contiguous().view(torch.uint8)
    out = torch.empty_like(raw)
    out[..., _on(mean.device, "column")] = raw
    return out.view(mean.dtype)


@dataclass
class VQFragmentPages:
    """A layer's vq page pools in fragment order (N pages, H kv heads) and its calibration tables;
    see the module docstring."""

    k_codes: torch.Tensor  # int32 [N, H, 256]
    v_codes: torch.Tensor  # int32 [N, H, 256]
    k_tok_scale: torch.Tensor  # fp16 [N, H, 64]
    v_tok_scale: torch.Tensor  # fp16 [N, H, 64]
    k_mean: torch.Tensor  # fp8 [N, H, 128], by K column
    k_codebook: torch.Tensor  # fp8 e4m3 [H, 16, 256, 8]
    k_chan_scale: torch.Tensor  # fp32 [H, 128], by channel
    v_codebook: torch.Tensor  # fp8 e4m3 [H, 16, 256, 8]
    version: int = VQ_FRAGMENT_VERSION

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @staticmethod
    def kernel_bytes_per_page_head() -> int:
        """What the kernel reads from HBM per page-head: K and V codes, token scales and the key means
        (= vq's slabs; the codebooks are read once per layer and mostly from L2)."""
        return 2 * CODE_BYTES + 2 * 2 * PAGE_TOKENS + HEAD_DIM


def check_shape(fmt, block_size: int, head_dim: int) -> None:
    if getattr(fmt, "name", None) != "vq":
        raise ValueError(f"vq fragment order: needs a VQFormat, got {type(fmt).__name__}")
    slots = max(fmt.outlier_slots(kind, block_size, head_dim) for kind in ("key", "value"))
    if (block_size, head_dim, fmt.sub_dim, slots) != (PAGE_TOKENS, HEAD_DIM, SUB, 0):
        raise ValueError(f"vq fragment order (version {VQ_FRAGMENT_VERSION}) is defined for block_size {PAGE_TOKENS}, "
                         f"head_dim {HEAD_DIM}, {SUB}-channel codes and no outlier slots, got {block_size}, "
                         f"{head_dim}, {fmt.sub_dim} and {slots} slots")


def kind_to_fragment(fmt, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One kind's vq slabs [N, H, slab] uint8 -> its fragment-order page tables, named as
    VQFragmentPages' fields (k_codes, k_tok_scale, k_mean; v_codes, v_tok_scale). No host sync and no
    copy from the host (the engine converts the pages a captured decode step fills)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    name, f = slab_fields("vq fragment order", fmt, kind, slabs)
    out = {f"{name}_codes": codes_to_fragment(f["codes"], kind), f"{name}_tok_scale": f["tok_scale"].contiguous()}
    if kind == "key":
        out["k_mean"] = mean_to_columns(f["chan_mean"])
    return out


def layer_tables(fmt, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The layer's calibration tables as VQFragmentPages' fields, on `device`."""
    k_codebook, chan_scale, v_codebook = fmt.decode_tables(layer, device, CODEBOOK_DTYPE)
    return {"k_codebook": k_codebook, "k_chan_scale": chan_scale, "v_codebook": v_codebook}


def to_fragment_order(fmt, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int = 0) -> VQFragmentPages:
    """vq slabs k_pages, v_pages [N, H, slab] uint8 (block_size 64, head_dim 128) of `layer` -> the
    same pages in fragment order, with the layer's calibration tables on the pages' device."""
    return VQFragmentPages(**kind_to_fragment(fmt, "key", k_pages), **kind_to_fragment(fmt, "value", v_pages),
                           **layer_tables(fmt, layer, k_pages.device))


def from_fragment_order(fmt, frag: VQFragmentPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_fragment_order: (k_pages, v_pages) vq slabs [N, H, slab] uint8."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    check_version("vq fragment order", frag.version, VQ_FRAGMENT_VERSION)
    k = {"codes": codes_from_fragment(frag.k_codes, "key"), "tok_scale": frag.k_tok_scale,
         "chan_mean": mean_by_channel(frag.k_mean)}
    v = {"codes": codes_from_fragment(frag.v_codes, "value"), "tok_scale": frag.v_tok_scale}
    return (fmt.layout("key", PAGE_TOKENS, HEAD_DIM).pack(k), fmt.layout("value", PAGE_TOKENS, HEAD_DIM).pack(v))


def codewords(frag: VQFragmentPages, kind: str, pages: torch.Tensor | None = None) -> torch.Tensor:
    """The codebook rows of every code (of `pages` only, if given), unscaled: [N, H, 64, 128] fp32 by channel."""
    check_kind(kind)
    name = "k" if kind == "key" else "v"
    words = getattr(frag, f"{name}_codes")
    codes = codes_from_fragment(words if pages is None else words[pages], kind).long()  # [N, H, P, 16]
    book = getattr(frag, f"{name}_codebook").float()  # [H, 16, 256, 8]
    n, heads = codes.shape[:2]
    head = torch.arange(heads, device=codes.device)[None, :, None, None]
    group = torch.arange(GROUPS, device=codes.device)[None, None, None, :]
    return book[head, group, codes].reshape(n, heads, PAGE_TOKENS, HEAD_DIM)


def dequantize_fragment(frag: VQFragmentPages, kind: str) -> torch.Tensor:
    """Pages [N, H, 64, 128] fp32 from the fragment-ordered tables, as vq's dequantize computes them."""
    name = "k" if kind == "key" else "v"
    x = codewords(frag, kind) * getattr(frag, f"{name}_tok_scale").float()[..., None]
    if kind == "key":
        x = x * frag.k_chan_scale.float()[None, :, None, :] + mean_by_channel(frag.k_mean).float()[:, :, None, :]
    return x


FRAGMENT_FIELDS = ("k_codes", "v_codes", "k_tok_scale", "v_tok_scale", "k_mean")  # a pool's page tables


def fragment_table_shapes(fmt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per (page, kv head): each fragment table's trailing shape and dtype (what an engine pool holds)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    return {"k_codes": ((CODE_WORDS,), torch.int32), "v_codes": ((CODE_WORDS,), torch.int32),
            "k_tok_scale": ((PAGE_TOKENS,), torch.float16), "v_tok_scale": ((PAGE_TOKENS,), torch.float16),
            "k_mean": ((HEAD_DIM,), torch.float8_e4m3fn)}


def fragment_bytes_per_page_head(fmt) -> int:
    return table_bytes(fragment_table_shapes(fmt))


def allocate_fragment_tables(fmt, num_blocks: int, num_kv_heads: int,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """Empty fragment-order pools [num_blocks, num_kv_heads, ...] (zero codes and scales)."""
    for table in ("element", "byte"):  # the reorder's index tables on the device before any capture
        for kind in ("key", "value"):
            _on(device, table, kind)
    _on(device, "column")
    return allocate_tables(fragment_table_shapes(fmt), num_blocks, num_kv_heads, device)


def fragment_view(tensors, tables: dict[str, torch.Tensor], page_ids: torch.Tensor | None = None) -> VQFragmentPages:
    """VQFragmentPages over a pool's tables (a LayerKVCache or dict), all pages or page_ids only, with the
    layer's calibration tables (layer_tables)."""
    return VQFragmentPages(**pick_pages(tensors, FRAGMENT_FIELDS, page_ids), **tables)
