"""The reference attention every format can fall back on: each sequence's K/V gathered (dequantized)
into dense tensors and attended with the uncompressed path's masking and GQA. The paged formats'
attend_reference and the plain formats' CPU path both run through dense_attention."""
from __future__ import annotations

import torch

from moekv.context import Context
from moekv.ops.reference import causal_attention_ref

# a step's k, v [T, Hkv, D] as the attention layer computed them (k after RoPE): KVFormat.attend
StepKV = tuple[torch.Tensor, torch.Tensor]


def is_decode_only(q: torch.Tensor, ctx: Context) -> bool:
    """One query token per sequence (every query_lens == 1)."""
    if q.shape[0] != ctx.num_seqs:
        return False
    if ctx.max_query_len is not None:
        return ctx.max_query_len == 1
    return bool((ctx.query_start_loc[1:] - ctx.query_start_loc[:-1] == 1).all())


def with_step_kv(gather, ctx: Context, step_kv: StepKV | None, staged: dict | None = None):
    """`gather(b, length) -> (k, v) [length, Hkv, D]` over the cache, with each prefill chunk's own
    positions taken from the step's k, v as computed (step_kv, [T, Hkv, D]: see KVFormat.attend).

    A sequence with Tq > 1 queries reads its first length - Tq positions from the cache as stored
    (earlier chunks: dequantized pages, the staged page, a format's 16-bit window) and its last Tq,
    which this step computed, exactly: a compressed cache quantizes a chunk's pages when it writes
    them, and attending to those quantized copies would let a prompt's tokens see low-bit versions
    of their neighbours, an error that compounds through the layers into the K/V later layers
    store. A one-token query (decode) reads its token from the cache, as the fused decode kernels
    do. With step_kv None: `gather` itself.

    staged (LayerKVCache.staged_before_step): where a chunk starts inside a page that its write
    has just completed and quantized, the page's earlier positions as they were staged before the
    step; the chunk reads them so, in 16 bits, as every step before it did, not through the
    page's fresh quantization. Without it a prompt's K/V would depend on where the scheduler cut
    it inside a page (a chunk of 8 tokens leaves them in the staged page, one of 2048 does not):
    docs/decisions.md, "Depth-0 passkeys on the CPU"."""
    if step_kv is None:
        return gather
    k_step, v_step = step_kv
    host = ctx.host_lists()
    starts = host.query_start

    def read(b: int, length: int):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo < 2:
            return gather(b, length)
        first = length - (hi - lo)  # the sequence's tokens cached before this step
        k_new, v_new = k_step[lo:hi], v_step[lo:hi]
        if first == 0:
            return k_new, v_new
        k_old, v_old = gather(b, first)
        rows = (staged or {}).get(host.seq_slots[b], {})
        if "k" in rows and "v" in rows and rows["k"][0] + rows["k"][1].shape[1] == first:
            page_start = rows["k"][0]
            k_old, v_old = (torch.cat([old[:page_start], rows[name][1].transpose(0, 1).to(old.dtype)])
                            for old, name in ((k_old, "k"), (v_old, "v")))
        return torch.cat([k_old, k_new.to(k_old.dtype)]), torch.cat([v_old, v_new.to(v_old.dtype)])

    return read


def dense_attention(q: torch.Tensor, ctx: Context, gather, scale: float, sliding_window: int | None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over K/V that `gather(b, length) -> (k, v) [length, Hkv, D]` reconstructs per
    sequence: each sequence's queries through causal_attention_ref, the masking and GQA of the
    uncompressed path, with no host sync of its own (the step's tables come from ctx.host_lists).
    sinks [Hq]: each head's sink logit (KVFormat.attend), or None."""
    out = torch.empty_like(q)
    host = ctx.host_lists()
    starts = host.query_start
    for b, length in enumerate(host.context_lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k, v = gather(b, length)
        out[lo:hi] = causal_attention_ref(q[lo:hi], k, v, scale, sliding_window, sinks)
    return out

