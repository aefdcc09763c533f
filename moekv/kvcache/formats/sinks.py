"""Sinks: each sequence's first S tokens kept in 16-bit beside its quantized pages (the attention sinks
of StreamingLLM / KVQuant's first token in 16 bits), the machinery the 2-bit formats share; not to be
confused with gpt-oss's attention sinks (a learned logit per head, `attend(..., sinks=)`).

The sinks live in a per-sequence buffer of S rows per layer, K and V (`k_sink`, `v_sink`
[max_num_seqs, Hkv, S + 1, D], the staging tensors' dtype; row S takes the writes of positions >= S,
so a decode step writes every sequence's token with one indexed copy and no branch): position p < S
of a sequence sits at row p. Its pages are written and quantized as without sinks; readers take
positions [0, S) from the buffer and the rest as before (`gather`, the reference path). No decode
kernel reads the buffer: with S > 0 every step takes the reference path, on CUDA too (a measurement
option: docs/decisions.md, "Sinks: a measurement option, not built into the kernels"). The buffer's
bytes are counted in staging_bytes_per_seq, so bits_per_element_at counts them.

A format takes sinks by listing SinkTokens first among its bases and declaring SINK_OPTION in its
engine_options; its constructor calls `set_sinks`. S = 0 leaves the format as it is.
"""
from __future__ import annotations

from typing import Any

import torch

from moekv.kvcache.formats.options import KVOption
from moekv.kvcache.formats.paged import can_stage_with_fills


def sink_refusal(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return "must be an integer >= 0 (0 = no 16-bit sinks)"
    return None


SINK_OPTION = KVOption("sink_tokens", None, "kivi2/nuq2/vq: a sequence's first tokens kept in 16-bit beside the pages, "
                       "read by the reference path only: decode steps leave the fused kernels (default: the "
                       "format's own, 0 for each)", sink_refusal, kind=int)


class SinkTokens:
    """The 16-bit copy of a sequence's first S tokens (listed before the paged base class and the
    residual window: its methods wrap theirs)."""

    # Not built on residual.py's ring, though both hold per-sequence 16-bit K/V rows [max_num_seqs, Hkv, n, D]:
    # the sinks keep fixed positions (p < S at row p; later writes land in the spare row S, hence S + 1
    # rows), replace the start of a gather (the ring's, when both are on) and are read by the reference
    # path alone; the ring moves with the sequence (p at row p % R), replaces its end, and the fused RoPE
    # store and the decode kernels write and read it. Past the zeroed pair, its byte count and an indexed
    # copy, no step is the same.

    sink_tokens: int = 0
    # no format keeps sinks by default: on domain-moe they change no perplexity (docs/decisions.md,
    # "Sinks: a measurement option, not built into the kernels")
    default_sink_tokens: int = 0

    def set_sinks(self, value: int | None) -> None:
        """S = value (None: the format's default_sink_tokens), refused unless an integer >= 0."""
        s = self.default_sink_tokens if value is None else value
        reason = sink_refusal(s)
        if reason is not None:
            raise ValueError(f"{self.name}: sink_tokens={s!r} {reason}")
        self.sink_tokens = s

    def prefix_caching_unsupported(self) -> str | None:
        if self.sink_tokens == 0:
            return super().prefix_caching_unsupported()
        return (f"its sinks (the first {self.sink_tokens} tokens in 16-bit) live in a per-sequence buffer that "
                "shared pages do not carry; use kv_sink_tokens=0 to share pages")

    def sink_bytes_per_seq(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence's sinks as allocated (one layer, K and V, 16-bit): S rows and the spare one."""
        rows = self.sink_tokens + 1 if self.sink_tokens else 0
        return 2 * num_kv_heads * rows * head_dim * 2

    def staging_bytes_per_seq(self, num_kv_heads, block_size, head_dim) -> int:
        return (super().staging_bytes_per_seq(num_kv_heads, block_size, head_dim)
                + self.sink_bytes_per_seq(num_kv_heads, head_dim))

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype):
        cache = super().allocate(num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype)
        if self.sink_tokens:
            for name in ("k", "v"):
                cache.tensors[f"{name}_sink"] = torch.zeros(max_num_seqs, num_kv_heads, self.sink_tokens + 1, head_dim,
                                                            dtype=cache["k_staging"].dtype, device=device)
        return cache

    def write(self, cache, k, v, ctx) -> None:
        super().write(cache, k, v, ctx)
        S = self.sink_tokens
        if S == 0:
            return
        if can_stage_with_fills(k, ctx):  # one token per sequence: positions >= S land in row S
            rows = ctx.positions.clamp(max=S)
            for name, x in (("k", k), ("v", v)):
                cache[f"{name}_sink"][ctx.seq_slots, :, rows] = x.to(cache[f"{name}_sink"].dtype)
            return
        host = ctx.host_lists()
        for b, (end, slot) in enumerate(zip(host.context_lens, host.seq_slots)):
            lo, hi = host.query_start[b], host.query_start[b + 1]
            first = end - (hi - lo)  # position of the step's first token of sequence b
            n = min(S, end) - first
            if n <= 0:
                continue
            for name, x in (("k", k[lo:lo + n]), ("v", v[lo:lo + n])):
                buf = cache[f"{name}_sink"]
                buf[slot, :, first:first + n] = x.transpose(0, 1).to(buf.dtype)

    def fused_rope_write_target(self, cache, k, ctx):
        return None if self.sink_tokens else super().fused_rope_write_target(cache, k, ctx)

    # the decode kernels (Triton, Gluon) do not read the buffer: with sinks every step takes the
    # reference path, on CUDA too (eager: the CUDA-graph runner reads fused_decode_unavailable)
    def fused_decode_unavailable(self, block_size, head_dim):
        if self.sink_tokens:
            return f"keeps {self.sink_tokens} sink tokens in 16-bit, which no decode kernel reads (reference path)"
        return super().fused_decode_unavailable(block_size, head_dim)

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        if self.sink_tokens:
            return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv, sinks)
        return super().attend(q, cache, ctx, scale, sliding_window, step_kv, sinks)

    def gather(self, cache, ctx, b, length, kind):
        S = min(self.sink_tokens, length)
        x = super().gather(cache, ctx, b, length, kind)
        if S == 0:
            return x
        buf = cache[("k" if kind == "key" else "v") + "_sink"][ctx.host_lists().seq_slots[b]]  # [Hkv, S + 1, D]
        return torch.cat([buf[:, :S].transpose(0, 1).float(), x[S:]])
