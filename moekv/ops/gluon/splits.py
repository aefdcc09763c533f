"""How the Gluon kernels' split references (the *_decode_split_reference of nuq2, int4, kivi2, vq, tiered) walk a
sequence, as the kernels do: tokens [0, quantized) from pages, the rest from the 16-bit tail; the
window's oldest token; the splits' contiguous page ranges (pages wholly before the window skipped);
a page range's invalid positions; the staged tail's scores (and with a residual window's ring, its
tokens and the shares of the programs reading them: tail_tokens, ring_tail_scores, tail_shares); one
split's softmax partial; and the whole split walk of a format whose pages reduce to a scores and a
values function (`split_reference`)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.tables import HEAD_DIM, PAGE_TOKENS


def quantized_tokens(length: int, staged: bool, R: int = 0) -> int:
    """Tokens [0, quantized) are read from pages; the rest is the 16-bit tail: the newest page (even
    when full) and, with a residual ring of R tokens (kivi2, nuq2, vq), the newest R (the Triton kernels' rule)."""
    if not staged:
        return length
    return min(((length - 1) // PAGE_TOKENS) * PAGE_TOKENS, max(length - R, 0))


def window_start(length: int, sliding_window: int | None) -> int:
    """The oldest token the sliding window keeps (0 without one)."""
    return max(length - sliding_window, 0) if sliding_window is not None else 0


def shares(lo: int, hi: int, parts: int, unit: int = 1) -> list[tuple[int, int, int]]:
    """(part, a, b) of the parts that hold items: [lo, hi) cut into `parts` contiguous shares of a
    multiple of `unit` items in part order (the last shorter; the parts past hi hold none)."""
    per = -(-(-(-max(hi - lo, 0) // parts)) // unit) * unit
    cut = []
    for part in range(parts):
        a = min(lo + part * per, hi)
        b = min(a + per, hi)
        if a < b:
            cut.append((part, a, b))
    return cut


def split_ranges(quantized: int, first: int, num_splits: int) -> list[tuple[int, int, int]]:
    """(split, p0, p1) of the splits that hold pages: the pages of tokens [first, quantized) cut into
    num_splits contiguous shares (none when no page token is valid)."""
    num_pages = -(-quantized // PAGE_TOKENS)
    page_lo = num_pages if first >= quantized else min(first // PAGE_TOKENS, num_pages)
    return shares(page_lo, num_pages, num_splits)


def masked(s: torch.Tensor, p0: int, p1: int, quantized: int, first: int) -> torch.Tensor:
    """Scores s [n, H, G, 64] of pages p0..p1 with the positions outside [first, quantized) at -inf."""
    pos = torch.arange(p0 * PAGE_TOKENS, p1 * PAGE_TOKENS, device=s.device).reshape(p1 - p0, 1, 1, PAGE_TOKENS)
    return s.masked_fill((pos >= quantized) | (pos < first), -math.inf)


def staged_scores(qg: torch.Tensor, staged, b: int, quantized: int, length: int, first: int,
                  qk2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's staged tail [quantized, length) (rows of its staging page): base-2 scores
    [H, G, T] (before the window at -inf) and values [H, T, D], in qg's dtype; qg [H, G, D]."""
    k_stage, v_stage, seq_slots = staged
    slot = int(seq_slots[b])
    t = torch.arange(quantized, length, device=qg.device)
    k = k_stage[slot][:, : length - quantized].to(qg.dtype)  # [H, T, D]
    v = v_stage[slot][:, : length - quantized].to(qg.dtype)
    s = torch.einsum("hgd,htd->hgt", qg, k) * qk2
    return s.masked_fill(t < first, -math.inf), v


def tail_shares(lo: int, length: int, tail_splits: int) -> list[tuple[int, int, int]]:
    """(part, t0, t1) of the tail programs that hold tokens: the tail [lo, length) cut into tail_splits
    contiguous shares of a multiple of 16 tokens (the kernels' step), as the kernels cut it
    (common.tail_share); the other programs' shares are empty."""
    return shares(lo, length, tail_splits, 16)


def tail_tokens(staged, residual, b: int, quantized: int, length: int,
                dtype: torch.dtype, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit tail [quantized, length) of sequence b (or its tokens [quantized, end)): (k, v) [H, T,
    D], rows of the residual ring (k_ring, v_ring [S, H, R, D], row t % R) where t >= length - R, of the
    staging page elsewhere."""
    k_stage, v_stage, seq_slots = staged
    slot = int(seq_slots[b])
    t = torch.arange(quantized, length if end is None else end, device=k_stage.device)
    k = k_stage[slot][:, t % PAGE_TOKENS].to(dtype)
    v = v_stage[slot][:, t % PAGE_TOKENS].to(dtype)
    if residual is not None and residual[0].shape[2]:
        R = residual[0].shape[2]
        ring = (t >= length - R)[None, :, None]
        k = torch.where(ring, residual[0][slot][:, t % R].to(dtype), k)
        v = torch.where(ring, residual[1][slot][:, t % R].to(dtype), v)
    return k, v


def ring_tail_scores(qg: torch.Tensor, staged, residual, b: int, quantized: int, length: int, first: int,
                     qk2: float, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """staged_scores with a residual ring: the tail [quantized, length) (or its tokens [quantized, end))
    from tail_tokens."""
    k, v = tail_tokens(staged, residual, b, quantized, length, qg.dtype, end)
    t = torch.arange(quantized, length if end is None else end, device=qg.device)
    s = torch.einsum("hgd,htd->hgt", qg, k) * qk2
    return s.masked_fill(t < first, -math.inf), v


def softmax_partial(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's partial from base-2 scores s [H, G, T] and values v [H, T, D]: o [H * G, D]
    normalised and lse [H * G] (log2 of the softmax mass)."""
    m = s.amax(-1, keepdim=True)
    p = torch.exp2(s - m)
    mass = p.sum(-1)
    o = torch.einsum("hgt,htd->hgd", p, v) / mass[..., None]
    return o.reshape(-1, HEAD_DIM), (m[..., 0] + torch.log2(mass)).reshape(-1)


def split_reference(q: torch.Tensor, Hkv: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    num_splits: int, staged, sliding_window: int | None,
                    page_scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    page_values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], residual=None,
                    tail_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gluon kernel's partials (o normalised, lse in base 2), split by split, in q's dtype, for a format
    whose pages give page_scores(qg [H, G, D], pages) -> scores [n, H, G, 64] (before the softmax scale)
    and page_values(p [n, H, G, 64], pages) -> sum over the pages of P @ V [H, G, D]; with `staged`,
    splits num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (the staging page's tokens from
    `quantized_tokens` on, and with `residual` (k_ring, v_ring) the ring's newest R tokens), each its share
    (tail_shares; more than one share needs the ring). The inputs are checked by the caller."""
    B, Hq = q.shape[:2]
    dt = q.dtype
    ns_total = num_splits + (tail_splits if staged is not None else 0)
    part_o = torch.zeros(B, Hq, ns_total, HEAD_DIM, dtype=dt, device=q.device)
    part_lse = torch.full((B, Hq, ns_total), -math.inf, dtype=dt, device=q.device)
    qk2 = scale * LOG2E
    for b, length in enumerate(context_lens.tolist()):
        R = residual[0].shape[2] if residual is not None else 0
        quantized = quantized_tokens(length, staged is not None, R)
        first = window_start(length, sliding_window)
        qg = q[b].reshape(Hkv, Hq // Hkv, HEAD_DIM)
        for sp, p0, p1 in split_ranges(quantized, first, num_splits):
            pages = block_tables[b, p0:p1].long()
            s = masked(page_scores(qg, pages) * qk2, p0, p1, quantized, first)  # [n, H, G, P]
            m = s.amax(dim=(0, 3), keepdim=True)  # [1, H, G, 1] (finite: every page holds a valid token)
            p = torch.exp2(s - m)
            mass = p.sum(dim=(0, 3))  # [H, G]
            part_o[b, :, sp] = (page_values(p, pages) / mass[..., None]).reshape(Hq, HEAD_DIM)
            part_lse[b, :, sp] = (m[0, :, :, 0] + torch.log2(mass)).reshape(Hq)
        if staged is not None and R:
            for part, t0, t1 in tail_shares(max(quantized, first), length, tail_splits):
                part_o[b, :, num_splits + part], part_lse[b, :, num_splits + part] = softmax_partial(
                    *ring_tail_scores(qg, staged, residual, b, t0, length, first, qk2, t1))
        elif staged is not None:
            part_o[b, :, num_splits], part_lse[b, :, num_splits] = softmax_partial(
                *staged_scores(qg, staged, b, quantized, length, first, qk2))
    return part_o, part_lse
