"""kivi2: KIVI's asymmetric 2-bit KV cache (Liu et al. 2024), written from the paper's description.

- Keys are quantized per *channel*: each channel gets a min and a scale over a group of 32
  tokens, because key outliers live in fixed channels (a per-token step would be set by them).
- Values are quantized per *token* in groups of 32 channels: value error mixes across channels
  through the attention weights, so per-token grouping is what bounds the output error.
- The most recent R tokens (default 128) are read in 16-bit: KIVI keeps a residual window
  unquantized, which protects the tokens attention leans on most while decoding.

Pages are quantized as soon as they are full, as in every paged format; the residual window lives
beside them in a per-sequence 16-bit ring of R tokens (residual.py, shared with nuq2 and vq), and
`gather` substitutes the ring's tokens for the dequantized ones (a prefill chunk reads its own tokens
as computed, the ring only for earlier ones: dense.with_step_kv). The ring's bytes are counted in
`staging_bytes_per_seq`. The group G is KIVI's 32 by default; the engine's kv_group_size sets
it (32 or 64: G = 64 halves the scales and zeros, 2.5 bits/element instead of 3, which puts
kivi2 at nuq2's bits for a like-for-like comparison). R must be a multiple of G, so the ring is
whole token-groups (a kernel reads it in tiles of a key group and never splits one at the wrap).

Slab of one (page, kv_head), P = block_size (a multiple of 32), D = head_dim (a multiple of 32):
    key:   codes uint8 [P, D/4], scale fp16 [P/32, D], zero fp16 [P/32, D]
    value: codes uint8 [P, D/4], scale fp16 [P, D/32], zero fp16 [P, D/32]
Codes are packed four per byte along head_dim, channel 4j+i in bits 2i..2i+1 of byte j, so a
kernel unpacks with uniform shifts by 0, 2, 4, 6.
"""
from __future__ import annotations

import torch

from moekv.kvcache.formats.fragment import FragmentPagedFormat, GluonKernel
from moekv.kvcache.formats.options import KVOption, one_of
from moekv.kvcache.formats.paged import Field, PageLayout, per_shape
from moekv.kvcache.formats.residual import ResidualWindow, gluon_ring, residual_option
from moekv.kvcache.formats.sinks import SINK_OPTION, SinkTokens

GROUP = 32  # tokens per key group and channels per value group (KIVI's G)
LEVELS = 3  # 2-bit codes 0..3
FP16_MAX = 65504.0


def _gluon_covers(fmt: KIVI2Format, block_size: int, head_dim: int) -> str | None:
    if (block_size, head_dim, fmt.group) == (64, 128, 32):
        return None
    return ("kivi2's Gluon kernel covers block_size 64, head_dim 128 and group 32, "
            f"got block_size {block_size}, head_dim {head_dim}, group {fmt.group}")


class KIVI2Format(SinkTokens, ResidualWindow, FragmentPagedFormat):
    name = "kivi2"
    # its pages converted from the slabs into the kernel's fragment order when written (kivi2_layout.py)
    gluon_kernel = GluonKernel("moekv.ops.gluon.kivi2_layout", "moekv.ops.gluon.kivi2_decode:kivi2_decode_attention",
                               _gluon_covers, decode_options=gluon_ring)
    default_residual = 128  # KIVI's R, taken where kv_residual is None (its default)
    engine_options = (
        residual_option("kivi2", GROUP),  # whole key groups (the constructor checks the group it takes)
        KVOption("group_size", GROUP,
                 "kivi2: tokens (keys) and channels (values) per group (32 or 64)", one_of(32, 64)),
        SINK_OPTION,
    )

    def __init__(self, residual: int | None = None, kivi_residual: int | None = None, group_size: int = GROUP,
                 sink_tokens: int | None = None) -> None:
        if group_size not in (32, 64):
            raise ValueError(f"kivi2: group_size={group_size!r} is not supported; accepted: 32 (KIVI's default), 64")
        self.group = group_size
        if residual is not None and kivi_residual is not None and residual != kivi_residual:
            raise ValueError(f"kivi2: residual={residual!r} and kivi_residual={kivi_residual!r} disagree; give one")
        # the residual window is kept in whole key groups
        self.set_residual(residual if residual is not None else kivi_residual, self.default_residual, self.group)
        self.set_sinks(sink_tokens)

    def value_group(self, head_dim: int) -> int:
        """Channels per value group: G, or the whole head when it is narrower than G."""
        return min(self.group, head_dim)

    # -- layout ----------------------------------------------------------------------------------
    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        if block_size % self.group:
            raise ValueError(f"kivi2: block_size={block_size} must be a multiple of {self.group} "
                             f"(keys are quantized per channel over groups of {self.group} tokens)")
        if head_dim % self.value_group(head_dim):
            raise ValueError(f"kivi2: head_dim={head_dim} must be a multiple of {self.value_group(head_dim)} "
                             f"(values are quantized per token over groups of channels)")
        codes = Field("codes", torch.uint8, (block_size, head_dim // 4))
        if kind == "key":
            side = (block_size // self.group, head_dim)  # per (token group, channel)
        else:
            side = (block_size, head_dim // self.value_group(head_dim))  # per (token, channel group)
        return PageLayout([codes, Field("scale", torch.float16, side), Field("zero", torch.float16, side)])

    # -- quantize / dequantize -------------------------------------------------------------------
    def quantize(self, x, kind, layer=None):
        # x [n, Hkv, P, D] fp32
        n, heads, P, D = x.shape
        if kind == "key":
            groups = x.reshape(n, heads, P // self.group, self.group, D)  # reduce over the group's tokens (dim 3)
            codes, scale, zero = _asym_quantize(groups, dim=3)  # scale, zero [n, Hkv, P/32, D]
        else:
            gv = self.value_group(D)
            groups = x.reshape(n, heads, P, D // gv, gv)  # reduce over the group's channels
            codes, scale, zero = _asym_quantize(groups, dim=4)  # scale, zero [n, Hkv, P, D/32]
        return {"codes": _pack_crumbs(codes.reshape(n, heads, P, D)), "scale": scale, "zero": zero}

    def dequantize(self, fields, kind, layer=None):
        codes = _unpack_crumbs(fields["codes"]).float()  # [n, Hkv, P, D]
        n, heads, P, D = codes.shape
        scale, zero = fields["scale"].float(), fields["zero"].float()
        if kind == "key":  # scale, zero [n, Hkv, P/32, D] broadcast over each group's 32 tokens
            groups = codes.view(n, heads, P // self.group, self.group, D) * scale[:, :, :, None] + zero[:, :, :, None]
        else:  # scale, zero [n, Hkv, P, D/32] broadcast over each group's 32 channels
            gv = self.value_group(D)
            groups = codes.view(n, heads, P, D // gv, gv) * scale[..., None] + zero[..., None]
        return groups.reshape(n, heads, P, D)

    def decode_spec(self, block_size, head_dim):
        from moekv.ops.decode.kivi2 import kivi2_spec  # the tile readers take G (32 or 64) as a parameter

        return kivi2_spec(self, block_size, head_dim)


def _asym_quantize(groups: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-bit asymmetric codes of `groups` with one (scale, min) per slice reduced over `dim`.
    Returns codes (uint8, groups' shape) and fp16 scale, zero (dim removed)."""
    lo = groups.amin(dim)
    hi = groups.amax(dim)
    # codes are computed against the fp16 values the kernel will see
    zero = lo.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    scale = ((hi - zero.float()) / LEVELS).clamp(0, FP16_MAX).to(torch.float16)
    s, z = scale.float().unsqueeze(dim), zero.float().unsqueeze(dim)
    # scale 0 (constant slice): every code 0, so it decodes to exactly the stored minimum
    codes = torch.where(s > 0, ((groups - z) / torch.where(s > 0, s, 1.0)).round().clamp(0, LEVELS), 0.0)
    return codes.to(torch.uint8), scale, zero


def _pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] uint8 in 0..3 -> [..., D/4]: channel 4j+i in bits 2i..2i+1 of byte j."""
    return codes[..., 0::4] | (codes[..., 1::4] << 2) | (codes[..., 2::4] << 4) | (codes[..., 3::4] << 6)


def _unpack_crumbs(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/4] uint8 -> codes [..., D]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 0x3).flatten(-2)
