"""A residual window: each sequence's newest R tokens kept in 16-bit beside its quantized pages (KIVI's
residual; kivi2, nuq2 and vq take it), the machinery they share.

The window lives in a per-sequence ring of R rows per layer, K and V (`k_residual`, `v_residual`
[max_num_seqs, Hkv, R, D], the staging tensors' dtype): position p of a sequence sits at row p % R.
Every token is written to the ring as well as to the staging page (pages are still quantized when
they fill), so the ring always holds the positions [context_len - R, context_len). Readers take a
position from the ring when it lies in that range, from the pages (or the staging page) otherwise:
`gather` (the reference path) here; the decode kernels read the ring as part of their 16-bit tail
split (moekv/ops/decode/paged.py: DecodeSpec.residual; the Gluon kernels' tail splits, each a share of
it, ops/gluon/common.py ring_tail_tiles), tokens [min(newest page's start, max(len - R, 0)), len). A
prefill chunk reads its own tokens as computed (dense.with_step_kv), the ring only for earlier ones. The
ring's bytes are counted in staging_bytes_per_seq, so bits_per_element_at counts them.

A format takes the window by listing ResidualWindow before its paged base class and declaring
`residual_option(...)` in its engine_options; its constructor calls `set_residual`. R = 0 leaves the
format as it is without a ring: no tensors, no writes, the base class's reads.
"""
from __future__ import annotations

from typing import Any

import torch

from moekv.kvcache.formats.interface import RopeWriteTarget
from moekv.kvcache.formats.options import KVOption
from moekv.kvcache.formats.paged import can_stage_with_fills


def residual_refusal(value: Any, multiple: int = 1) -> str | None:
    """Why `value` is no residual window R (an integer >= 0, a multiple of `multiple`; None: the
    format's default), or None."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % multiple:
        return ("must be an integer >= 0 (0 = no 16-bit window)" if multiple == 1 else
                f"must be a multiple of {multiple} (0 = no 16-bit window)")
    return None


def residual_option(formats: str, multiple: int = 1) -> KVOption:
    """kv_residual as `formats` declare it: default None (each format's own; the registry wants one
    default for every format that takes it), R refused unless a multiple of `multiple`."""
    rule = f", a multiple of {multiple}" if multiple > 1 else ""
    return KVOption("residual", None, f"{formats}: newest tokens kept in 16-bit beside the pages{rule} "
                    "(default: the format's own, 0: none)", lambda value: residual_refusal(value, multiple), kind=int)


RESIDUAL_OPTION = residual_option("nuq2/vq")  # kivi2 declares its own: whole key groups


class ResidualWindow:
    """The ring of a format's newest R tokens (listed before the paged base class: its methods wrap
    the base class's)."""

    # Not shared with sinks.py's buffer, though both hold per-sequence 16-bit K/V rows: the ring moves
    # with the sequence (every position p lands at row p % R, a prefill chunk keeps its newest R), the
    # fused RoPE store writes it and the decode kernels read it as part of their 16-bit tail; the sinks
    # keep the first S positions for good, are read by the reference path only and sit above this class
    # (their gather wraps this one's).

    residual: int = 0

    def set_residual(self, value: int | None, default: int, multiple: int = 1) -> None:
        """R = value (None: default), refused unless an integer >= 0 and a multiple of `multiple`."""
        r = default if value is None else value
        reason = residual_refusal(r, multiple)
        if reason is not None:
            raise ValueError(f"{self.name}: residual={r!r} {reason}")
        self.residual = r

    def prefix_caching_unsupported(self) -> str | None:
        if self.residual == 0:
            return super().prefix_caching_unsupported()  # pages alone hold the context
        return (f"its residual window (the newest {self.residual} tokens in 16-bit) lives in a per-sequence ring "
                "that shared pages do not carry: a request starting from cached pages would read window "
                "tokens it never computed; use kv_residual=0 to share pages")

    def residual_bytes_per_seq(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence's residual ring (one layer, K and V, 16-bit)."""
        return 2 * num_kv_heads * self.residual * head_dim * 2

    def staging_bytes_per_seq(self, num_kv_heads, block_size, head_dim) -> int:
        return (super().staging_bytes_per_seq(num_kv_heads, block_size, head_dim)
                + self.residual_bytes_per_seq(num_kv_heads, head_dim))

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype):
        cache = super().allocate(num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype)
        if self.residual == 0:
            return cache
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


def gluon_ring(fmt: ResidualWindow, cache) -> dict:
    """GluonKernel.decode_options of a format with a window: the ring, read by the Gluon kernel
    beside the staged newest page as its 16-bit tail split (None without one)."""
    return {"residual": (cache["k_residual"], cache["v_residual"]) if fmt.residual else None}
