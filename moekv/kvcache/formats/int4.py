"""int4: asymmetric uniform 4-bit codes in groups along head_dim, with per-page outlier channels.

Per (token, group of `group_size` channels) an fp16 scale and an fp16 minimum; codes are packed
two per byte, the even channel in the low nibble, so a kernel unpacks a byte with one shift and
one mask. The top ~1% of channels of each (page, kv_head) by magnitude (at least one) are kept in
bf16 beside the codes (they are the page's largest values: bf16 cannot overflow where fp16 could,
and its relative step 2^-9 is far below the 4-bit one), their uint8 indices in the slab. They are
chosen per page from the data, so no calibration is needed. Outlier channels are left out of their
group's min/max (one large
channel would otherwise stretch the step of the whole group) and are overwritten on dequantize.

Slab of one (page, kv_head), P = block_size, D = head_dim, G = group_size, O = outlier channels:
    codes        uint8    [P, D/2]
    scale        float16  [P, D/G]
    zero         float16  [P, D/G]   (the group's minimum)
    outlier_val  bfloat16 [P, O]
    outlier_idx  uint8    [O]        (last, so its few bytes open no 16-byte alignment gap)
Bits per element count every slab byte, padding included: 6.0 at (P, D) = (16, 32), 5.5 at
(16, 128) with G = 32, 5.0 at (16, 128) with G = 64.
"""
from __future__ import annotations

import torch

from moekv.kvcache.formats.base import Field, FragmentPagedFormat, PageLayout, gluon_pages_wanted, per_shape
from moekv.kvcache.formats.options import KVOption, one_of

LEVELS = 15  # 4-bit codes 0..15
FP16_MAX = 65504.0
GROUP_SIZES = (32, 64)
MAX_HEAD_DIM = 256  # outlier indices are uint8


class Int4Format(FragmentPagedFormat):
    name = "int4"
    engine_options = (KVOption("group_size", 32, "int4: channels per scale group", one_of(*GROUP_SIZES)),)

    def __init__(self, group_size: int = 32, outlier_fraction: float = 0.01) -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4: group_size={group_size!r} is not supported; accepted: {list(GROUP_SIZES)}")
        if not 0.0 <= outlier_fraction < 1.0:
            raise ValueError(f"int4: outlier_fraction={outlier_fraction!r} must be in [0, 1)")
        self.group_size = group_size
        self.outlier_fraction = outlier_fraction

    # -- layout ----------------------------------------------------------------------------------
    def num_outliers(self, head_dim: int) -> int:
        """Outlier channels per (page, kv_head): ~1% of head_dim, at least one."""
        return max(1, round(self.outlier_fraction * head_dim))

    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        if head_dim % self.group_size:
            raise ValueError(f"int4: head_dim={head_dim} is not divisible by group_size={self.group_size}; "
                             f"use a group_size that divides head_dim (accepted: {list(GROUP_SIZES)})")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"int4: head_dim={head_dim} exceeds {MAX_HEAD_DIM} (outlier indices are uint8)")
        groups, outliers = head_dim // self.group_size, self.num_outliers(head_dim)
        return PageLayout([Field("codes", torch.uint8, (block_size, head_dim // 2)),
                           Field("scale", torch.float16, (block_size, groups)),
                           Field("zero", torch.float16, (block_size, groups)),
                           Field("outlier_val", torch.bfloat16, (block_size, outliers)),
                           Field("outlier_idx", torch.uint8, (outliers,))])

    # -- quantize / dequantize -------------------------------------------------------------------
    def quantize(self, x, kind, layer=None):
        # x [n, Hkv, P, D] fp32
        n, heads, P, D = x.shape
        idx = _outlier_channels(x, self.num_outliers(D))  # [n, Hkv, O]
        is_outlier = torch.zeros_like(x, dtype=torch.bool).scatter_(
            -1, idx[:, :, None, :].expand(n, heads, P, -1), True)  # [n, Hkv, P, D]
        groups = x.reshape(n, heads, P, D // self.group_size, self.group_size)  # [n, Hkv, P, Ng, G]
        excluded = is_outlier.reshape(groups.shape)
        lo = torch.where(excluded, torch.inf, groups).amin(-1)  # [n, Hkv, P, Ng]
        hi = torch.where(excluded, -torch.inf, groups).amax(-1)
        lo = torch.where(torch.isfinite(lo), lo, 0.0)  # a group made only of outliers
        hi = torch.where(torch.isfinite(hi), hi, lo)
        # the kernel sees the fp16 values, so codes are computed against exactly those
        zero = lo.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
        scale = ((hi - zero) / LEVELS).clamp(0, FP16_MAX).to(torch.float16).float()
        safe = torch.where(scale > 0, scale, 1.0)  # scale 0: constant group, every code 0 -> exact zero
        codes = ((groups - zero[..., None]) / safe[..., None]).round().clamp(0, LEVELS)
        codes = torch.where(scale[..., None] > 0, codes, 0.0)
        codes = torch.where(excluded, 0.0, codes).to(torch.uint8).reshape(n, heads, P, D)
        outlier_val = x.gather(-1, idx[:, :, None, :].expand(n, heads, P, -1))  # [n, Hkv, P, O]
        return {"codes": _pack_nibbles(codes), "scale": scale, "zero": zero,
                "outlier_val": outlier_val.to(torch.bfloat16), "outlier_idx": idx.to(torch.uint8)}

    def dequantize(self, fields, kind, layer=None):
        codes = _unpack_nibbles(fields["codes"]).float()  # [n, Hkv, P, D]
        n, heads, P, D = codes.shape
        scale, zero = fields["scale"].float()[..., None], fields["zero"].float()[..., None]  # [n, Hkv, P, Ng, 1]
        x = (codes.view(n, heads, P, D // self.group_size, self.group_size) * scale + zero).reshape(n, heads, P, D)
        idx = fields["outlier_idx"].long()[:, :, None, :].expand(n, heads, P, -1)  # [n, Hkv, P, O]
        return x.scatter_(-1, idx, fields["outlier_val"].float())

    def decode_spec(self, block_size, head_dim):
        from moekv.ops.decode.int4 import int4_spec

        return int4_spec(self, block_size, head_dim)


    # -- the Gluon decode kernel's page layout (moekv/ops/gluon/int4_layout.py) --------------------------
    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape keep their pages in the Gluon int4 kernel's fragment order
        (converted from the slabs when pages are written), by the format's decode_kernel
        (base.gluon_pages_wanted). Covered: block_size 64, head_dim 128, group_size 32, 1-4 outlier
        channels."""
        covered = ((block_size, head_dim, self.group_size) == (64, 128, 32)
                   and 1 <= self.num_outliers(head_dim) <= 4)
        return gluon_pages_wanted(self.decode_kernel, covered, device,
                                  "int4's Gluon kernel covers block_size 64, head_dim 128, "
                                  f"group_size 32 and 1-4 outlier channels, got block_size {block_size}, "
                                  f"head_dim {head_dim}, group_size {self.group_size}, "
                                  f"{self.num_outliers(head_dim)} outlier channels")

    fragment_marker = "k_out_delta"

    def fragment_layout(self):
        from moekv.ops.gluon import int4_layout

        return int4_layout

    def gluon_decode(self, q, cache, ctx, scale, sliding_window, staged):
        from moekv.ops.gluon.int4_decode import int4_decode_attention

        return int4_decode_attention(q, self.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
                                     staged=staged, sliding_window=sliding_window)


def _outlier_channels(x: torch.Tensor, count: int) -> torch.Tensor:
    """x [n, Hkv, P, D] -> the `count` channels of largest |x| over the page's tokens [n, Hkv, O],
    sorted so the stored indices are deterministic."""
    magnitude = x.abs().amax(dim=2)  # [n, Hkv, D]
    return magnitude.topk(count, dim=-1).indices.sort(dim=-1).values


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] uint8 in 0..15 -> [..., D/2]: even channel in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 -> codes [..., D]."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 0x0F).flatten(-2)
