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

The ring's bookkeeping, whatever a row holds, is the functions below the kv_residual option
(`ring_rows`, `write_ring`, `window_start`, `read_ring`, `ring_bytes_per_seq`): ResidualWindow's K and V
rings and the 2-bit MLA latent's ring of one entry a token (latent_lowbit.py, `ring`
[max_num_seqs, R, W]) both keep it through them. They see a ring as [max_num_seqs, R, *row]: the K/V
rings, stored [max_num_seqs, Hkv, R, D] for the kernels, pass their view `transpose(1, 2)`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moekv.context import Context
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


def ring_rows(start: int, end: int, size: int, device: torch.device) -> torch.Tensor:
    """The rows of positions [start, end) in a ring of `size` rows: position p at row p % size."""
    return torch.arange(start, end, device=device) % size


def ring_bytes_per_seq(size: int, elements_per_token: int) -> int:
    """Bytes a sequence's ring adds (one layer, 16-bit): `size` tokens of `elements_per_token`
    elements (K and V: 2 Hkv D; the latent: its width)."""
    return 2 * size * elements_per_token


def write_ring(rings: Sequence[torch.Tensor], step: Sequence[torch.Tensor], ctx: Context, size: int,
               one_per_seq: bool) -> None:
    """The step's tokens into the rings: rings [max_num_seqs, size, *row] (views may be), step
    [T, *row] each, one per ring, in ctx's token order. one_per_seq: each sequence writes exactly one
    token (a decode step), one indexed copy with no host sync; else each sequence's newest
    min(its tokens, size) of the step (the older ones would be overwritten anyway)."""
    if one_per_seq:
        rows = ctx.positions % size  # [B]
        for ring, x in zip(rings, step):
            ring[ctx.seq_slots, rows] = x.to(ring.dtype)
        return
    host = ctx.host_lists()
    starts = host.query_start
    for b, (end, slot) in enumerate(zip(host.context_lens, host.seq_slots)):
        lo, hi = starts[b], starts[b + 1]
        keep = min(hi - lo, size)
        if keep == 0:
            continue
        rows = ring_rows(end - keep, end, size, step[0].device)  # [keep]
        for ring, x in zip(rings, step):
            ring[slot, rows] = x[hi - keep:hi].to(ring.dtype)


def window_start(size: int, context_len: int, length: int) -> int:
    """The first of a sequence's positions [0, length) that its ring holds once `context_len` tokens
    are written (it holds [context_len - size, context_len)); `length` when it holds none of them."""
    return length if size == 0 else min(length, max(0, context_len - size))


def read_ring(ring: torch.Tensor, slot: int, start: int, end: int, size: int) -> torch.Tensor:
    """Positions [start, end) of the sequence in `slot` from its ring: ring [max_num_seqs, size, *row]
    (a view may be) -> [end - start, *row], the ring's dtype."""
    return ring[slot][ring_rows(start, end, size, ring.device)]


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
        return ring_bytes_per_seq(self.residual, 2 * num_kv_heads * head_dim)

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
        if self.residual:
            write_ring(self.ring_views(cache), (k, v), ctx, self.residual, can_stage_with_fills(k, ctx))

    @staticmethod
    def ring_views(cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rings as write_ring and read_ring see them: [max_num_seqs, R, Hkv, D] views."""
        return cache["k_residual"].transpose(1, 2), cache["v_residual"].transpose(1, 2)

    def fused_rope_write_target(self, cache, k, ctx):
        if not can_stage_with_fills(k, ctx):
            return None
        rings = (cache["k_residual"], cache["v_residual"]) if self.residual else (None, None)
        return RopeWriteTarget(cache["k_staging"], cache["v_staging"], ctx.seq_slots, True, *rings)

    def gather(self, cache, ctx, b, length, kind):
        # the ring holds the sequence's newest R positions, [context_len - R, context_len): those of
        # the first `length` read from it, the older ones from the pages (and the staged page)
        host = ctx.host_lists()
        start = window_start(self.residual, host.context_lens[b], length)
        if start >= length:
            return super().gather(cache, ctx, b, length, kind)
        parts = [super().gather(cache, ctx, b, start, kind)] if start else []
        ring = self.ring_views(cache)[0 if kind == "key" else 1]
        parts.append(read_ring(ring, host.seq_slots[b], start, length, self.residual).float())  # [n, Hkv, D]
        return torch.cat(parts)  # [length, Hkv, D] fp32


def gluon_ring(fmt: ResidualWindow, cache) -> dict:
    """GluonKernel.decode_options of a format with a window: the ring, read by the Gluon kernel
    beside the staged newest page as its 16-bit tail split (None without one)."""
    return {"residual": (cache["k_residual"], cache["v_residual"]) if fmt.residual else None}
