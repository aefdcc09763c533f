"""Split-K paged decode attention over nuq2 pages in fragment order, with a Gluon kernel.

nuq2 keys are k = mean + scale * z with z = centroid[code] (or an outlier slot's value), per
channel per page; values are v = centroid[code] (or a slot's value). Per 64-token page the Gluon
kernel (nuq2_kernel.py) computes, exactly as this module's reference does:

  codebook term: the keys' channel affine folded into q, q.k = (q * scale) . centroid[code] +
    q . mean (the second a per-page constant per query head); scores and values straight from
    2-bit codes dequantized in registers into mma_v2 operand fragments;
  outlier slots, folded into the same tile as one-hot products (tensor-core shaped): with slot j at
    element (t_j, c_j) and its q-independent deltas kd_j = scale[c_j] (z_slot - centroid), dv_j =
    z_slot - centroid (nuq2_layout.slot_deltas),
        S^T += OneHot_K @ W,  W[j, n] = q[n, c_j] kd_j          (before the softmax)
        O^T += Dv^T @ (OneHot_V @ P^T),  Dv^T[c, j] = dv_j [c == c_j]   (after P)
  online softmax in base 2; each split writes its partial (o, lse) as moekv/ops/decode/paged.py's
    reduce reads them.

The staged 16-bit tail (the engine's newest page, kept in bf16 until it fills: tokens from
((len - 1) // 64) * 64 on) is one more split of the same launch when `staged` is given, and a
sliding window skips the pages before it and masks inside the first one, as the Triton kernel does.
With a residual window (`residual`: the format's ring of the newest R tokens, [S, Hkv, R, 128] at the
staging's slots) the tail reads them from the ring, and the pages end where it begins (tokens [0,
min(((len - 1) // 64) * 64, max(len - R, 0))), the last page read in part), as kivi2's; the tail is then
read by tail_splits splits, each a contiguous share of it (launch.plan_splits: several at batch 1,
where one program walking the whole ring would be the launch's longest).

`nuq2_decode_split_reference` is the oracle (plain PyTorch, float64 in tests, the same one-hot
algebra); `nuq2_decode_attention` runs the Gluon kernel and the reduce on an NVIDIA GPU (sm_80+;
Gluon has no CPU or interpreter backend).

Shapes: q [B, Hq, D]; block_tables [B, max_pages] int32 (physical page ids); context_lens [B]
(tokens; without staging the last page may be partly valid); G = Hq / Hkv in {1, 2, 4, 8};
staged = (k_stage, v_stage, seq_slots): [S, Hkv, 64, 128] 16-bit and [B] slot ids; partials
part_o [B, Hq, NS (+ tail_splits staged), D] (normalised) and part_lse (log2 of the split's softmax mass in
units of the base-2 scores s * scale * log2(e)); an empty split has o = 0 and lse = -inf.
"""
from __future__ import annotations

import math

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.checks import Residual, Staged, check_extras, check_inputs, check_residual, check_tail_splits
from moekv.ops.gluon.launch import (  # noqa: F401 (NO_WINDOW, default_num_splits, MAX_SPLITS re-exported)
    MAX_SPLITS,
    NO_WINDOW,
    TARGET_PROGRAMS,
    check_launch,
    default_num_splits,
    gluon_missing,
    plan_launch,
    reduce_on_device,
    register_cap,
    ring_args,
)
from moekv.ops.gluon.nuq2_layout import HEAD_DIM, PAGE_TOKENS, Nuq2FragmentPages, codes_from_fragment, slot_tables
from moekv.ops.gluon.splits import (
    masked,
    quantized_tokens,
    ring_tail_scores,
    split_ranges,
    staged_scores,
    tail_shares,
    window_start,
)


# -- splits -------------------------------------------------------------------------------------------
def split_pages(num_pages: int, num_splits: int, split: int) -> tuple[int, int]:
    """Pages [p0, p1) of a split: the sequence's pages cut into num_splits contiguous shares."""
    per = -(-num_pages // num_splits)
    p0 = min(split * per, num_pages)
    return p0, min(p0 + per, num_pages)


# -- the reference (what the kernel computes) ----------------------------------------------------------
def _one_hot_tokens(idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """idx [n, H, S] slot positions t * D + c -> [n, H, S, 64]: 1 at each used slot's token."""
    tok = torch.arange(PAGE_TOKENS, device=idx.device)
    return ((idx.long() // HEAD_DIM)[..., None] == tok).to(dtype)  # NO_OUTLIER // D = 511: no token


def _one_hot_channels(idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    chan = torch.arange(HEAD_DIM, device=idx.device)
    used = idx.long() < PAGE_TOKENS * HEAD_DIM
    return (((idx.long() % HEAD_DIM)[..., None] == chan) & used[..., None]).to(dtype)


def _page_scores(q_b: torch.Tensor, frag: Nuq2FragmentPages, pages: torch.Tensor, G: int,
                 outliers: bool) -> torch.Tensor:
    """Scores (before the softmax scale) of one sequence's pages: q_b [Hq, D] -> [n, Hkv, G, 64] =
    (q * scale) . centroid[code] + q . mean (+ OneHot_K @ W, the key slots), in q_b's dtype."""
    codes = codes_from_fragment(frag.k_codes[pages], "key")  # [n, Hkv, P, D]
    n, H = codes.shape[:2]
    dt = q_b.dtype
    c = frag.k_centroids[pages].to(dt).reshape(n * H, 4)
    z = c.gather(1, codes.reshape(n * H, -1)).reshape(n, H, PAGE_TOKENS, HEAD_DIM)
    qg = q_b.reshape(H, G, HEAD_DIM)
    q_scaled = qg[None] * frag.k_scale[pages].to(dt)[:, :, None, :]  # [n, H, G, D]
    bias = torch.einsum("hgd,nhd->nhg", qg, frag.k_mean[pages].to(dt))
    s = torch.einsum("nhgd,nhtd->nhgt", q_scaled, z) + bias[..., None]
    if outliers and frag.k_out_idx.shape[2]:
        idx = frag.k_out_idx[pages]  # [n, H, Sk]
        q_at = torch.einsum("hgd,nhjd->nhjg", qg, _one_hot_channels(idx, dt))  # q[n, c_j] per slot
        w = q_at * frag.k_slot_delta[pages].to(dt)[..., None]  # W [n, H, Sk, G]
        s = s + torch.einsum("nhjt,nhjg->nhgt", _one_hot_tokens(idx, dt), w)
    return s


def _page_values(frag: Nuq2FragmentPages, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codebook values [n, Hkv, 64, D]: centroid[code]."""
    codes = codes_from_fragment(frag.v_codes[pages], "value")
    n, H = codes.shape[:2]
    c = frag.v_centroids[pages].to(dtype).reshape(n * H, 4)
    return c.gather(1, codes.reshape(n * H, -1)).reshape(n, H, PAGE_TOKENS, HEAD_DIM)


def nuq2_decode_split_reference(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, num_splits: int,
                                outliers: bool = True, staged: Staged | None = None,
                                sliding_window: int | None = None, residual: Residual | None = None,
                                tail_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials, split by split, in q's dtype: codebook term plus (outliers) the
    slots' one-hot products, then (staged) the 16-bit tail as splits num_splits .. num_splits +
    tail_splits - 1 (with `residual`, the ring's newest R tokens among it), each its share (tail_shares)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits)
    check_extras(staged, sliding_window, B, Hkv)
    R = check_residual(residual, staged, Hkv, "nuq2")
    check_tail_splits(tail_splits, R)
    Hq, dt = q.shape[1], q.dtype
    ns_total = num_splits + (tail_splits if staged is not None else 0)
    part_o = torch.zeros(B, Hq, ns_total, HEAD_DIM, dtype=dt, device=q.device)
    part_lse = torch.full((B, Hq, ns_total), -math.inf, dtype=dt, device=q.device)
    qk2 = scale * LOG2E

    def partial(b, sp, s, v, extra=None):  # s [H, G, T] base-2 scores (-inf masked), v [H, T, D]
        m = s.amax(-1, keepdim=True)
        p = torch.exp2(s - m)
        mass = p.sum(-1)
        o = torch.einsum("hgt,htd->hgd", p, v)
        if extra is not None:
            o = o + extra(p)
        part_o[b, :, sp] = (o / mass[..., None]).reshape(Hq, HEAD_DIM)
        part_lse[b, :, sp] = (m[..., 0] + torch.log2(mass)).reshape(Hq)

    for b, length in enumerate(context_lens.tolist()):
        quantized = quantized_tokens(length, staged is not None, R)
        first = window_start(length, sliding_window)
        for sp, p0, p1 in split_ranges(quantized, first, num_splits):
            pages = block_tables[b, p0:p1].long()
            n = p1 - p0
            s = masked(_page_scores(q[b], frag, pages, G, outliers) * qk2, p0, p1, quantized, first)  # [n, H, G, 64]
            s = s.permute(1, 2, 0, 3).reshape(Hkv, G, n * PAGE_TOKENS)
            v = _page_values(frag, pages, dt).permute(1, 0, 2, 3).reshape(Hkv, n * PAGE_TOKENS, HEAD_DIM)
            extra = None
            if outliers and frag.v_out_idx.shape[2]:
                idx = frag.v_out_idx[pages]  # [n, H, Sv]
                hot_v = _one_hot_tokens(idx, dt)  # OneHot_V [n, H, Sv, 64]
                dv_t = _one_hot_channels(idx, dt) * frag.v_slot_delta[pages].to(dt)[..., None]  # [n, H, Sv, D]

                def extra(p, hot_v=hot_v, dv_t=dv_t, n=n):  # O^T += Dv^T @ (OneHot_V @ P^T), page by page
                    p_slots = torch.einsum("nhjt,hgnt->nhjg", hot_v, p.reshape(Hkv, G, n, PAGE_TOKENS))
                    return torch.einsum("nhjd,nhjg->hgd", dv_t, p_slots)
            partial(b, sp, s, v, extra)
        if staged is not None and R:
            for part, t0, t1 in tail_shares(max(quantized, first), length, tail_splits):
                partial(b, num_splits + part, *ring_tail_scores(q[b].reshape(Hkv, G, HEAD_DIM), staged, residual, b,
                                                                t0, length, first, qk2, t1))
        elif staged is not None:
            partial(b, num_splits, *staged_scores(q[b].reshape(Hkv, G, HEAD_DIM), staged, b, quantized, length, first,
                                                  qk2))
    return part_o, part_lse


def reduce_partials(part_o: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Merge the splits: [B, Hq, NS, D], [B, Hq, NS] -> [B, Hq, D] (what decode_attention's reduce computes)."""
    w = torch.exp2(part_lse - part_lse.amax(-1, keepdim=True))
    return (w[..., None] * part_o).sum(2) / w.sum(-1)[..., None]


# -- the GPU path ------------------------------------------------------------------------------------
# ptxas's cap: with SMEM 160 ties 128 and wins at (1, 128k) (12 programs an SM: one wave of 197 splits:
# docs/decisions.md, "Pages through shared memory where the launch fills the GPU"); no cap is slower (more
# programs an SM hide more latency: "nuq2's outlier slots folded into the tile loop as one-hot MMAs")
DEFAULT_MAX_REGISTERS = 160
# the kernel's PREFETCH (prefetch.py): none; its page is bound by its instructions, so a prefetch costs more
# than it hides (docs/decisions.md, "Prefetch and whole waves for the Gluon launches")
DEFAULT_PREFETCH = 0
# the first slot chunk unconditionally: its loads do not wait for the used counts (docs/decisions.md,
# "nuq2's outlier slots folded into the tile loop as one-hot MMAs")
DEFAULT_SLOT_CHUNK0 = True
# the kernel's SMEM: the next page's codes and side data staged in shared memory by cp.async (two
# stages) instead of the codes' register double buffer and the side data's loads at the page's start
# (docs/decisions.md, "Pages through shared memory where the launch fills the GPU")
DEFAULT_SMEM = True


def nuq2_decode_partials(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                         max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                         sliding_window: int | None = None, slot_chunk0: bool = DEFAULT_SLOT_CHUNK0,
                         prefetch: int = DEFAULT_PREFETCH, smem: bool = DEFAULT_SMEM,
                         residual: Residual | None = None, tail_splits: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (part_o, part_lse), fp32 (CUDA only); with `staged`, splits
    num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (and `residual`'s ring: its newest R
    tokens), each a share of it (tail_splits: None for launch.plan_splits' rule; more than 1 needs the
    ring). max_registers: ptxas's cap (0 / None: its choice); slot_chunk0:
    the first 16 slots of each kind unconditionally (loads not behind the used counts; ~35 more
    registers), else chunks only while used slots remain; smem: the next page's codes and side data
    through shared memory (cp.async, two stages; ~9 kB a program), the same partials bit for bit."""
    B, Hkv, G = check_launch("nuq2", q, frag, block_tables, context_lens, num_splits, staged, sliding_window)
    R = check_residual(residual, staged, Hkv, "nuq2")
    try:
        from moekv.ops.gluon.nuq2_kernel import nuq2_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("nuq2", e) from e
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers, R,
                      tail_splits)
    k_ring, v_ring, ring_strides = ring_args(run, residual)
    nuq2_decode_kernel[run.grid](
        frag.k_codes, frag.v_codes, frag.k_centroids.view(torch.int32), frag.v_centroids.view(torch.int32),
        frag.k_mean, frag.k_scale, *slot_tables(frag),
        q.contiguous(), block_tables, block_tables.stride(0), context_lens, run.seq_slots,
        run.k_stage, run.v_stage, *run.stage_strides, k_ring, v_ring, *ring_strides, R,
        run.part_o, run.part_lse, scale * LOG2E, run.window, 0, run.num_splits, run.ns_total,
        HKV=Hkv, G=G, STAGED=staged is not None, CHUNK0=bool(slot_chunk0), PREFETCH=prefetch, SMEM=bool(smem),
        RING=R > 0, num_warps=1, **register_cap(max_registers))
    return run.part_o, run.part_lse


def nuq2_decode_attention(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                          max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                          sliding_window: int | None = None, out: torch.Tensor | None = None,
                          slot_chunk0: bool = DEFAULT_SLOT_CHUNK0, prefetch: int = DEFAULT_PREFETCH,
                          smem: bool = DEFAULT_SMEM, residual: Residual | None = None,
                          sinks: torch.Tensor | None = None, tail_splits: int | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over nuq2 pages in fragment order (outlier slots included,
    exact) and, with `staged`, the 16-bit tail (and `residual`'s ring, in tail_splits programs) -> [B, Hq,
    128] in q's dtype: the Gluon kernel and the reduce, two launches, no host sync. CUDA only. sinks [Hq]:
    each head's sink logit, joining the reduce."""
    part_o, part_lse = nuq2_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers,
                                            staged, sliding_window, slot_chunk0, prefetch, smem, residual,
                                            tail_splits)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q) if out is None else out, sinks)
