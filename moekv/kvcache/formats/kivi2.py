"""kivi2: KIVI's asymmetric 2-bit KV cache (Liu et al. 2024), written from the paper's description.

- Keys are quantized per *channel*: each channel gets a min and a scale over a group of 32
  tokens, because key outliers live in fixed channels (a per-token step would be set by them).
- Values are quantized per *token* in groups of 32 channels: value error mixes across channels
  through the attention weights, so per-token grouping is what bounds the output error.
- The most recent R tokens (default 128) are read in 16-bit: KIVI keeps a residual window
  unquantized, which protects the tokens attention leans on most while decoding.

Pages are quantized as soon as they are full, as in every paged format; the residual window lives
beside them in a per-sequence 16-bit ring of R tokens (`k_residual`, `v_residual`), and `gather`
substitutes the ring's tokens for the dequantized ones (a prefill chunk reads its own tokens as
computed, the ring only for earlier ones: base.with_step_kv). The ring's bytes are counted in
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

from moekv.kvcache.formats.base import (
    Field,
    FragmentPagedFormat,
    PageLayout,
    RopeWriteTarget,
    can_stage_with_fills,
    gluon_pages_wanted,
    per_shape,
)
from moekv.kvcache.formats.options import KVOption, one_of

GROUP = 32  # tokens per key group and channels per value group (KIVI's G)
LEVELS = 3  # 2-bit codes 0..3
FP16_MAX = 65504.0


class KIVI2Format(FragmentPagedFormat):
    name = "kivi2"
    default_residual = 128  # KIVI's R (EngineConfig(kv_residual=...) passes it through the registry)
    engine_options = (
        KVOption("residual", default_residual, "kivi2: newest tokens kept in 16-bit (a multiple of 32)",
                 lambda r: None if isinstance(r, int) and not isinstance(r, bool) and r >= 0 and r % GROUP == 0
                 else f"must be a multiple of {GROUP} (0 = no full-precision window)"),
        KVOption("group_size", GROUP,
                 "kivi2: tokens (keys) and channels (values) per group (32 or 64)", one_of(32, 64)),
    )

    def __init__(self, residual: int | None = None, kivi_residual: int | None = None, group_size: int = GROUP) -> None:
        if group_size not in (32, 64):
            raise ValueError(f"kivi2: group_size={group_size!r} is not supported; accepted: 32 (KIVI's default), 64")
        self.group = group_size
        if residual is not None and kivi_residual is not None and residual != kivi_residual:
            raise ValueError(f"kivi2: residual={residual!r} and kivi_residual={kivi_residual!r} disagree; give one")
        r = residual if residual is not None else kivi_residual
        r = self.default_residual if r is None else r
        if not isinstance(r, int) or isinstance(r, bool) or r < 0 or r % self.group:
            raise ValueError(f"kivi2: residual={r!r} must be an integer >= 0 and a multiple of {self.group} "
                             f"(the residual window is kept in whole {self.group}-token groups)")
        self.residual = r

    def prefix_caching_unsupported(self) -> str | None:
        if self.residual == 0:
            return None  # pages alone hold the context: shared as they are
        return (f"its residual window (the newest {self.residual} tokens in 16-bit) lives in a per-sequence ring "
                "that shared pages do not carry: a request starting from cached pages would read window "
                "tokens it never computed; use kv_residual=0 to share pages")

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

    def residual_bytes_per_seq(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence's residual ring (one layer, K and V, 16-bit)."""
        return 2 * num_kv_heads * self.residual * head_dim * 2

    def staging_bytes_per_seq(self, num_kv_heads, block_size, head_dim) -> int:
        return (super().staging_bytes_per_seq(num_kv_heads, block_size, head_dim)
                + self.residual_bytes_per_seq(num_kv_heads, head_dim))

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

    # -- the Gluon decode kernel's page layout (moekv/ops/gluon/kivi2_layout.py) -------------------------
    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape keep their pages in the Gluon kivi2 kernel's fragment order
        (converted from the slabs when pages are written), by the format's decode_kernel
        (base.gluon_pages_wanted). Covered: block_size 64, head_dim 128, group 32."""
        covered = (block_size, head_dim, self.group) == (64, 128, 32)
        return gluon_pages_wanted(self.decode_kernel, covered, device,
                                  "kivi2's Gluon kernel covers block_size 64, head_dim 128 and "
                                  f"group 32, got block_size {block_size}, head_dim {head_dim}, group {self.group}")

    def fragment_layout(self):
        from moekv.ops.gluon import kivi2_layout

        return kivi2_layout

    def gluon_decode(self, q, cache, ctx, scale, sliding_window, staged):
        """The staged newest page and the residual ring as the kernel's extra split."""
        from moekv.ops.gluon.kivi2_decode import kivi2_decode_attention

        ring = (cache["k_residual"], cache["v_residual"]) if self.residual else None
        return kivi2_decode_attention(q, self.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
                                      staged=staged, residual=ring, sliding_window=sliding_window)

    # -- residual ring ---------------------------------------------------------------------------
    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype):
        cache = super().allocate(num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype)
        ring_dtype = cache["k_staging"].dtype
        for name in ("k", "v"):
            # [max_num_seqs, Hkv, R, D]: position p of a sequence sits at row p % R
            cache.tensors[f"{name}_residual"] = torch.zeros(max_num_seqs, num_kv_heads, self.residual, head_dim,
                                                            dtype=ring_dtype, device=device)
        return cache

    def write(self, cache, k, v, ctx) -> None:
        super().write(cache, k, v, ctx)  # full pages quantized, partial page staged
        if self.residual == 0:
            return
        if can_stage_with_fills(k, ctx):  # one token per sequence: one indexed copy, no host sync
            rows = ctx.positions % self.residual  # [B]
            for name, x in (("k", k), ("v", v)):
                ring = cache[f"{name}_residual"]
                ring[ctx.seq_slots, :, rows] = x.to(ring.dtype)
            return
        host = ctx.host_lists()
        starts = host.query_start
        for b, (end, slot) in enumerate(zip(host.context_lens, host.seq_slots)):
            lo, hi = starts[b], starts[b + 1]
            keep = min(hi - lo, self.residual)  # older tokens of this step would be overwritten anyway
            if keep == 0:
                continue
            rows = torch.arange(end - keep, end, device=k.device) % self.residual  # [keep]
            for name, x in (("k", k[hi - keep:hi]), ("v", v[hi - keep:hi])):  # x [keep, Hkv, D]
                ring = cache[f"{name}_residual"]
                ring[slot, :, rows] = x.transpose(0, 1).to(ring.dtype)

    def fused_rope_write_target(self, cache, k, ctx):
        if not can_stage_with_fills(k, ctx):
            return None
        rings = (cache["k_residual"], cache["v_residual"]) if self.residual else (None, None)
        return RopeWriteTarget(cache["k_staging"], cache["v_staging"], ctx.seq_slots, True, *rings)

    def gather(self, cache, ctx, b, length, kind):
        # the ring holds the sequence's newest R positions, [context_len - R, context_len): those of
        # the first `length` read from it, the older ones from the pages (and the staged page)
        start = max(0, ctx.host_lists().context_lens[b] - self.residual)
        if self.residual == 0 or start >= length:
            return super().gather(cache, ctx, b, length, kind)
        parts = [super().gather(cache, ctx, b, start, kind)] if start else []
        ring = cache[("k" if kind == "key" else "v") + "_residual"][ctx.host_lists().seq_slots[b]]  # [Hkv, R, D]
        rows = torch.arange(start, length, device=ring.device) % self.residual  # [length - start]
        parts.append(ring[:, rows].transpose(0, 1).float())
        return torch.cat(parts)  # [length, Hkv, D] fp32


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
