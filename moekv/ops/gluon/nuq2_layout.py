"""nuq2 pages in MMA-fragment order: what the Gluon decode kernel (nuq2_decode.py) reads.

nuq2 stores a (page, kv head) slab as planar codes [P, D/4] plus side fields (nuq2.py). The Gluon
kernel dequantizes in registers straight into mma_v2 A-operand fragments (one warp, K and V^T as
the A operand, m16n8k16): each thread must find the codes of its fragment elements in ONE 128-bit
load per 512-byte row, in the order the fragment wants them. This module reorders the codes of
each page-head (P = 64 tokens, D = 128 channels, 2048 bytes) into that order and splits the other
fields into side tables; `from_fragment_order` is the exact inverse.

Fragment order, version 2 (NUQ2_FRAGMENT_VERSION; version 1 held int32 positions and counts, fp32 deltas
and the FP8 slot values). A page-head's 2048 bytes are 4 rows of 512 bytes;
thread `lane` of the warp reads bytes [16 lane, 16 lane + 16) of every row (one 128-bit load).
Byte b of a row holds four 2-bit codes, field f in bits 2f..2f+1. Write the indices in bits:

  byte  = 64 g + 16 q4 + y           g in 0..7, q4 in 0..3, y = 8 y3 + 4 y2 + 2 y1 + y0
  field = 2 f1 + f0

  keys   (row = blk, 16 tokens each):       token = 16 blk + 8 y1 + g
                                            chan  = 64 f1 + 32 f0 + 16 y3 + 8 y2 + 2 q4 + y0
  values (row = 2 blk + rh, 32 tokens per   token = 32 blk + 16 y3 + 8 y2 + 2 q4 + y0
          block of two rows):               chan  = 64 f1 + 32 f0 + 16 rh + 8 y1 + g

so that, after a per-byte table lookup, the thread's fp16 values reshape/permute into the logical
K [64, 128] / V^T [128, 64] tile in DotOperandLayout(0, mma_v2) without moving data between threads
(keys: lane = 4 g + q4 holds rows g, g + 8 of each 16-token block, the A fragment's rows).

Side tables (per page-head; the codebook fields as nuq2 stores them, the outlier slots as the kernel
reads them):
  k_centroids, v_centroids  fp16 [N, H, 4]   the codebook (calibrated codebooks expanded per page)
  k_mean, k_scale           fp8  [N, H, D]   the keys' channel mean and scale
  k_out_idx, v_out_idx      int16 [N, H, S]  outlier slot positions t * D + c (< 8192); NO_SLOT (0x7FFF, the
                                           slabs' NO_OUTLIER 0xFFFF) marks an unused slot; the used slots
                                           come first (the order of slots carries no meaning; nuq2 writes
                                           them so, `used_slots_first` makes sure)
  k_used, v_used            uint8 [N, H]   how many out slots are used (nuq2 has at most 80 a page-head)
  k_slot_delta              fp16 [N, H, Sk]  what a key slot adds to the main term's scaled key:
                                           scale[c] * (slot value - centroid[code at (t, c)]) (0 unused)
  v_slot_delta              fp16 [N, H, Sv]  what a value slot adds: slot value - centroid[code] (0 unused)
The slot deltas are q-independent, so they are computed once here (`slot_deltas`, in fp32, then rounded
to fp16, saturating at +-65504: a relative error of at most 2^-11 of the slot's correction, 1/64 of the
2^-4 of the FP8 value it comes from; docs/decisions.md, "nuq2's fragment tables at the slabs' bits"),
and the Gluon tile loop adds the slots with one-hot products on the tensor cores (nuq2_kernel.py).
The slots' FP8 values are not stored: `slot_values` recovers them from the deltas (value = (delta /
scale[c] + centroid[code]) / max |centroid|, rounded to FP8), exactly, bit for bit, wherever the fp16
delta's rounding (2^-12 of it) stays below half the FP8 value's spacing: every slot of a page-head whose
outliers lie beyond its centroids, what nuq2's threshold (tau robust deviations) makes them, unless a
delta saturates (keys or values beyond fp16's range) or falls into fp16's subnormals (|delta| < 2^-14);
so from_fragment_order gives the slabs back and dequantize_fragment nuq2's dequantize.
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
from moekv.ops.nuq2_codes import NO_OUTLIER, pack_codes, unpack_codes

NUQ2_FRAGMENT_VERSION = 2
NO_SLOT = 0x7FFF  # k_out_idx / v_out_idx of an unused slot (int16): above every position t * D + c < 8192
DELTA_MAX = 65504.0  # the largest finite fp16: slot deltas saturate there
FP8_MAX = 448.0  # the largest finite E4M3 (nuq2.FP8_MAX: the slot values' clamp)
MAX_SLOTS = 255  # the uint8 used counts
SLOT_BYTES = 4  # what the kernel reads a used slot: its int16 position and fp16 delta


def _element_of_slot(kind: str) -> torch.Tensor:
    """[P * D] long: for slot e = 4 * byte + field of a page-head's fragment order, the element
    t * D + c whose code it holds."""
    if kind == "key":  # byte = (blk, g, q4, y3, y2, y1, y0), then field = (f1, f0)
        blk, g, q4, y3, y2, y1, y0, f1, f0 = bit_fields(PAGE_TOKENS * HEAD_DIM, 2, 3, 2, 1, 1, 1, 1, 1, 1)
        token = 16 * blk + 8 * y1 + g
        chan = 64 * f1 + 32 * f0 + 16 * y3 + 8 * y2 + 2 * q4 + y0
    elif kind == "value":  # byte = (blk, rh, g, q4, y3, y2, y1, y0), then field = (f1, f0)
        blk, rh, g, q4, y3, y2, y1, y0, f1, f0 = bit_fields(PAGE_TOKENS * HEAD_DIM, 1, 1, 3, 2, 1, 1, 1, 1, 1, 1)
        token = 32 * blk + 16 * y3 + 8 * y2 + 2 * q4 + y0
        chan = 64 * f1 + 32 * f0 + 16 * rh + 8 * y1 + g
    else:
        raise ValueError(f"kind={kind!r}: expected 'key' or 'value'")
    return token * HEAD_DIM + chan


ELEMENT_OF_SLOT = {kind: _element_of_slot(kind) for kind in ("key", "value")}
# the inverse: element t * D + c -> its slot 4 * byte + field
SLOT_OF_ELEMENT = two_bit.register_order("nuq2", ELEMENT_OF_SLOT)


def prepare_device(device: torch.device) -> None:
    """Put the reorder's index tables on `device` now (before any capture that converts pages)."""
    two_bit.prepare_device(device, "nuq2")


def codes_to_fragment(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [..., 64, 128] in 0..3 -> int32 words [..., 512] in nuq2's fragment order."""
    return two_bit.codes_to_fragment(codes, kind, "nuq2")


def codes_from_fragment(words: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 words [..., 512] in nuq2's fragment order -> codes [..., 64, 128] (int64)."""
    return two_bit.codes_from_fragment(words, kind, "nuq2")


def used_slots_first(out_idx: torch.Tensor, out_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_idx, out_val) as the slabs hold them (positions, NO_OUTLIER unused) with each page-head's used
    slots first (a stable sort: kept as they are when they already are, as nuq2 writes them), and the
    number used int32 [N, H]. No host sync (the engine converts pages inside captured decode steps)."""
    used = out_idx != NO_OUTLIER
    counts = used.sum(-1).to(torch.int32)
    if used.shape[-1]:
        order = torch.sort((~used).to(torch.uint8), dim=-1, stable=True).indices
        val_bytes = out_val.view(torch.uint8).gather(-1, order)  # fp8 has no gather on CPU
        out_idx, out_val = out_idx.gather(-1, order).contiguous(), val_bytes.view(out_val.dtype).contiguous()
    return out_idx, out_val, counts


def slot_positions(idx: torch.Tensor) -> torch.Tensor:
    """A fragment table's slot positions (int16, NO_SLOT unused) as the slabs write them: int64, t * D + c
    or NO_OUTLIER."""
    idx = idx.long()
    return torch.where(idx == NO_SLOT, NO_OUTLIER, idx)


def _slot_deltas_from_codes(codes: torch.Tensor, centroids: torch.Tensor, out_idx: torch.Tensor,
                            out_val: torch.Tensor, kind: str, k_scale: torch.Tensor | None) -> torch.Tensor:
    """slot_deltas with the codes given in element order [N, H, P * D], in fp32 (before the table's fp16)."""
    n, heads, slots = out_idx.shape
    if not slots:
        return torch.zeros(n, heads, 0, dtype=torch.float32, device=out_idx.device)
    used = out_idx != NO_OUTLIER
    pos = torch.where(used, out_idx, 0).long()  # [N, H, S] elements t * D + c
    c = centroids.float()
    unit = c.abs().amax(-1, keepdim=True).clamp(min=1e-6)  # nuq2.centroid_unit
    delta = out_val.float() * unit - c.gather(2, codes.long().gather(2, pos))
    if kind == "key":
        if k_scale is None:
            raise ValueError("slot_deltas: keys need k_scale")
        delta = delta * k_scale.float().gather(2, pos % HEAD_DIM)
    return torch.where(used, delta, 0.0).contiguous()


def delta_table(delta: torch.Tensor) -> torch.Tensor:
    """fp32 slot deltas -> the fp16 table (saturating at +-DELTA_MAX, not inf)."""
    return delta.clamp(-DELTA_MAX, DELTA_MAX).to(torch.float16)


def slot_deltas(codes_words: torch.Tensor, centroids: torch.Tensor, out_idx: torch.Tensor,
                out_val: torch.Tensor, kind: str, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 [N, H, S]: per outlier slot, what it adds to the codebook term at its element (t, c):
    values z_slot - centroid[code]; keys scale[c] * (z_slot - centroid[code]) (the main term's key is
    mean + scale * centroid). z_slot = out_val * max |centroid| (nuq2.centroid_unit); out_idx as the
    slabs hold it (NO_OUTLIER unused); unused slots 0. Computed in fp32, rounded to fp16 (delta_table)."""
    check_kind(kind)
    n, heads = out_idx.shape[:2]
    codes = codes_from_fragment(codes_words, kind).reshape(n, heads, -1)
    return delta_table(_slot_deltas_from_codes(codes, centroids, out_idx, out_val, kind, k_scale))


def slot_values(frag: Nuq2FragmentPages, kind: str) -> torch.Tensor:
    """The slots' FP8 values [N, H, S] (0 unused), recovered from the fp16 deltas: z_slot = delta /
    scale[c] (keys) + centroid[code at (t, c)], over max |centroid|, rounded to FP8 (exact where the
    module docstring says; tests/test_gluon_nuq2_layout.py)."""
    name = "k" if kind == "key" else "v"
    pos = slot_positions(getattr(frag, f"{name}_out_idx"))
    n, heads, slots = pos.shape
    if not slots:
        return torch.zeros(n, heads, 0, dtype=torch.float8_e4m3fn, device=pos.device)
    used = pos != NO_OUTLIER
    at = torch.where(used, pos, 0)
    codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind).reshape(n, heads, -1)
    c = getattr(frag, f"{name}_centroids").double()
    z = getattr(frag, f"{name}_slot_delta").double()
    if kind == "key":
        z = z / frag.k_scale.double().gather(2, at % HEAD_DIM)
    z = z + c.gather(2, codes.gather(2, at))
    unit = c.abs().amax(-1, keepdim=True).clamp(min=1e-6)  # nuq2.centroid_unit
    val = torch.where(used, z / unit, 0.0).clamp(-FP8_MAX, FP8_MAX)
    return val.float().to(torch.float8_e4m3fn)


@dataclass
class Nuq2FragmentPages:
    """A layer's nuq2 page pools in fragment order (N pages, H kv heads); see the module docstring."""

    k_codes: torch.Tensor  # int32 [N, H, 512]
    v_codes: torch.Tensor  # int32 [N, H, 512]
    k_centroids: torch.Tensor  # fp16 [N, H, 4]
    v_centroids: torch.Tensor  # fp16 [N, H, 4]
    k_mean: torch.Tensor  # fp8 [N, H, D]
    k_scale: torch.Tensor  # fp8 [N, H, D]
    k_out_idx: torch.Tensor  # int16 [N, H, Sk]
    v_out_idx: torch.Tensor  # int16 [N, H, Sv]
    k_used: torch.Tensor  # uint8 [N, H]
    v_used: torch.Tensor  # uint8 [N, H]
    k_slot_delta: torch.Tensor  # fp16 [N, H, Sk]
    v_slot_delta: torch.Tensor  # fp16 [N, H, Sv]
    calibrated: bool = False  # the centroids came from a calibrated codebook (not stored in the slabs)
    version: int = NUQ2_FRAGMENT_VERSION

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def code_bytes_per_page_head(self) -> int:
        """What the kernel reads per page-head besides the slots: K and V codes, centroids, key mean
        and scale, the two used counts."""
        return 2 * PAGE_BYTES + 2 * 8 + 2 * HEAD_DIM + 2

    def slot_bytes(self) -> int:
        """What the kernel reads for the used slots of all pages (position and delta, 4 bytes each)."""
        return SLOT_BYTES * int(self.k_used.sum() + self.v_used.sum())


def slot_tables(frag: Nuq2FragmentPages) -> tuple:
    """The Gluon kernels' slot arguments (k_idx, k_delta, k_used, v_idx, v_delta, v_used, SK, SV): the
    positions as uint16 views (all below 0x8000, so the 16-bit loads widen them for free), or ValueError
    for tables of other dtypes or an odd number of slots (a shared-memory stage copies two slots a word)."""
    want = {"out_idx": torch.int16, "slot_delta": torch.float16, "used": torch.uint8}
    for name in ("k", "v"):
        for field, dt in want.items():
            t = getattr(frag, f"{name}_{field}")
            if t.dtype != dt:
                raise ValueError(f"nuq2 Gluon decode: {name}_{field} must be {dt} (fragment order version "
                                 f"{NUQ2_FRAGMENT_VERSION}), got {t.dtype}")
    sk, sv = frag.k_out_idx.shape[2], frag.v_out_idx.shape[2]
    if sk % 2 or sv % 2:
        raise ValueError(f"nuq2 Gluon decode: the slot tables need an even number of slots, got {sk} and {sv}")
    return (frag.k_out_idx.view(torch.uint16), frag.k_slot_delta, frag.k_used, frag.v_out_idx.view(torch.uint16),
            frag.v_slot_delta, frag.v_used, sk, sv)


def check_shape(fmt, block_size: int, head_dim: int) -> None:
    if getattr(fmt, "name", None) != "nuq2":
        raise ValueError(f"nuq2 fragment order: needs a NUQ2Format, got {type(fmt).__name__}")
    if (block_size, head_dim) != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"nuq2 fragment order (version {NUQ2_FRAGMENT_VERSION}) is defined for block_size "
                         f"{PAGE_TOKENS} and head_dim {HEAD_DIM}, got {block_size} and {head_dim}")


def kind_to_fragment(fmt, kind: str, slabs: torch.Tensor, layer: int | None = None
                     ) -> dict[str, torch.Tensor]:
    """One kind's nuq2 slabs [N, H, slab] uint8 (block_size 64, head_dim 128) -> its fragment-order
    tables, named as Nuq2FragmentPages' fields ('k_codes', ..., 'k_used', 'k_slot_delta'). No host
    sync: the engine calls it on the pages a decode step fills, inside captured steps."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    name, f = slab_fields("nuq2 fragment order", fmt, kind, slabs)
    n, heads = slabs.shape[:2]
    codes = unpack_codes(f["codes"])  # [N, H, P, D]
    out = {f"{name}_codes": codes_to_fragment(codes, kind)}
    if fmt.calibrated:
        cb = fmt.codebook(kind, layer, n * heads, slabs.device).to(torch.float16)
        out[f"{name}_centroids"] = cb.reshape(n, heads, 4).contiguous()
    else:
        out[f"{name}_centroids"] = f["centroids"].contiguous()
    if kind == "key":
        out["k_mean"], out["k_scale"] = f["chan_mean"].contiguous(), f["chan_scale"].contiguous()
    if "out_idx" in f:
        idx, val, used = used_slots_first(f["out_idx"].to(torch.int32), f["out_val"])
    else:  # no slots: empty tables
        idx = torch.zeros(n, heads, 0, dtype=torch.int32, device=slabs.device)
        val = torch.zeros(n, heads, 0, dtype=torch.float8_e4m3fn, device=slabs.device)
        used = torch.zeros(n, heads, dtype=torch.int32, device=slabs.device)
    delta = _slot_deltas_from_codes(codes.reshape(n, heads, -1), out[f"{name}_centroids"], idx, val, kind,
                                    out.get("k_scale"))
    out[f"{name}_out_idx"] = torch.where(idx == NO_OUTLIER, NO_SLOT, idx).to(torch.int16)
    out[f"{name}_used"] = used.to(torch.uint8)
    out[f"{name}_slot_delta"] = delta_table(delta)
    return out


def to_fragment_order(fmt, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      layer: int | None = None) -> Nuq2FragmentPages:
    """nuq2 slabs k_pages, v_pages [N, H, slab] uint8 (fmt's layout, block_size 64, head_dim 128)
    -> the same pages in fragment order."""
    return Nuq2FragmentPages(**kind_to_fragment(fmt, "key", k_pages, layer),
                             **kind_to_fragment(fmt, "value", v_pages, layer), calibrated=fmt.calibrated)


def from_fragment_order(fmt, frag: Nuq2FragmentPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_fragment_order: (k_pages, v_pages) nuq2 slabs [N, H, slab] uint8 (the slot
    values recovered from the deltas: slot_values)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    check_version("nuq2 fragment order", frag.version, NUQ2_FRAGMENT_VERSION)
    slabs = []
    for name, kind in (("k", "key"), ("v", "value")):
        layout = fmt.layout(kind, PAGE_TOKENS, HEAD_DIM)
        values = {"codes": pack_codes(codes_from_fragment(getattr(frag, f"{name}_codes"), kind))}
        if kind == "key":
            values["chan_mean"], values["chan_scale"] = frag.k_mean, frag.k_scale
        if not fmt.calibrated:
            values["centroids"] = getattr(frag, f"{name}_centroids")
        if any(f.name == "out_idx" for f in layout.fields):
            values["out_val"] = slot_values(frag, kind)
            values["out_idx"] = slot_positions(getattr(frag, f"{name}_out_idx")).to(torch.int32).to(torch.uint16)
        slabs.append(layout.pack(values))
    return slabs[0], slabs[1]


def dequantize_fragment(frag: Nuq2FragmentPages, kind: str, outliers: bool = True) -> torch.Tensor:
    """Pages [N, H, 64, 128] fp32 from the fragment-ordered tables, as nuq2's dequantize computes
    them (the slots' FP8 values recovered: slot_values; outliers=False: the codebook term alone, what
    the Gluon kernel's main loop reads)."""
    name = "k" if kind == "key" else "v"
    codes = codes_from_fragment(getattr(frag, f"{name}_codes"), kind)  # [N, H, P, D]
    n, heads = codes.shape[:2]
    c = getattr(frag, f"{name}_centroids").float().reshape(n * heads, 4)
    z = c.gather(1, codes.reshape(n * heads, -1))
    idx = slot_positions(getattr(frag, f"{name}_out_idx")).reshape(n * heads, -1)
    if outliers and idx.shape[1]:
        unit = c.abs().amax(-1, keepdim=True).clamp(min=1e-6)  # nuq2.centroid_unit
        val = slot_values(frag, kind).float().reshape(n * heads, -1) * unit
        used = idx != NO_OUTLIER
        N = z.shape[1]
        hit = torch.zeros(n * heads, N + 1, dtype=torch.bool, device=z.device).scatter_(1, idx.clamp(max=N), used)
        dense = torch.zeros(n * heads, N + 1, device=z.device).scatter_(1, idx.clamp(max=N), val)
        z = torch.where(hit[:, :N], dense[:, :N], z)
    z = z.reshape(n, heads, PAGE_TOKENS, HEAD_DIM)
    if kind == "key":
        z = z * frag.k_scale.float()[:, :, None] + frag.k_mean.float()[:, :, None]
    return z


FRAGMENT_FIELDS = ("k_codes", "v_codes", "k_centroids", "v_centroids", "k_mean", "k_scale", "k_out_idx", "v_out_idx",
                   "k_used", "v_used", "k_slot_delta", "v_slot_delta")


def fragment_table_shapes(fmt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per (page, kv head): each fragment table's trailing shape and dtype (what an engine pool holds)."""
    check_shape(fmt, PAGE_TOKENS, HEAD_DIM)
    sk, sv = fmt.outlier_slots("key", PAGE_TOKENS, HEAD_DIM), fmt.outlier_slots("value", PAGE_TOKENS, HEAD_DIM)
    if max(sk, sv) > MAX_SLOTS:
        raise ValueError(f"nuq2 fragment order: at most {MAX_SLOTS} outlier slots a page-head (uint8 counts), "
                         f"got {sk} key and {sv} value slots")
    fp8 = torch.float8_e4m3fn
    return {"k_codes": ((WORDS_PER_PAGE,), torch.int32), "v_codes": ((WORDS_PER_PAGE,), torch.int32),
            "k_centroids": ((4,), torch.float16), "v_centroids": ((4,), torch.float16),
            "k_mean": ((HEAD_DIM,), fp8), "k_scale": ((HEAD_DIM,), fp8),
            "k_out_idx": ((sk,), torch.int16), "v_out_idx": ((sv,), torch.int16),
            "k_used": ((), torch.uint8), "v_used": ((), torch.uint8),
            "k_slot_delta": ((sk,), torch.float16), "v_slot_delta": ((sv,), torch.float16)}


def fragment_bytes_per_page_head(fmt) -> int:
    return table_bytes(fragment_table_shapes(fmt))


def allocate_fragment_tables(fmt, num_blocks: int, num_kv_heads: int,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """Empty fragment-order pools [num_blocks, num_kv_heads, ...]: zero codes, unused slots."""
    prepare_device(device)
    out = allocate_tables(fragment_table_shapes(fmt), num_blocks, num_kv_heads, device)
    for name in ("k_out_idx", "v_out_idx"):
        out[name].fill_(NO_SLOT)
    return out


def fragment_view(fmt, tensors, page_ids: torch.Tensor | None = None, layer: int | None = None) -> Nuq2FragmentPages:
    """Nuq2FragmentPages of fmt over a pool's tables (a LayerKVCache or dict), all pages or page_ids only."""
    return Nuq2FragmentPages(**pick_pages(tensors, FRAGMENT_FIELDS, page_ids), calibrated=fmt.calibrated)
