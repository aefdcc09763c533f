"""Paged flash-decoding: one query token per sequence against its paged (possibly compressed) KV.

One kernel serves every KV format. A format describes how to read its pages with a `DecodeSpec`:
a *tile reader* for keys and one for values (Triton functions, moekv/ops/decode_tiles.py) that
load the bytes of BLOCK_N tokens from their pages and dequantize them in registers, plus where
the newest unquantized tokens live. The kernel does the rest:

- grid (B * Hkv, NUM_SPLITS [+ 1]): program (b, h, s) owns KV head h of sequence b and the s-th
  contiguous share of its quantized pages (flash-decoding split-K); with a staged format one more
  program per (b, h) reads the 16-bit tail (the newest page, partly filled or just full, in the staging tensor,
  and kivi2's residual ring) so that it costs no extra launch;
- all G = Hq / Hkv query heads of the GQA group are the rows of one `tl.dot` against each tile
  (padded to 16 rows, the smallest MMA), so a page is read once per group;
- online softmax in base 2; each program writes its normalised partial output and log-sum-exp;
  `_reduce_kernel` merges the partials of each (b, query head);
- a sliding window skips the tiles before it and masks inside the first one.

Reference: `moekv.ops.reference.decode_attention_ref` (dense attention of each query over its
sequence's dequantized K/V, i.e. what `KVFormat.attend_reference` computes); for plain pages that
is `paged_attention_ref`, for compressed ones `dense_attention` over `PagedQuantFormat.gather`.

Shape legend: B = sequences (= tokens: one query each), Hq / Hkv = query / KV heads, G = Hq/Hkv,
D = head_dim, P = block_size, S = staging slots, R = residual ring rows, NS = splits.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekv.ops.pdl import let_dependents_launch, pdl_enabled, prefetch_l2

LOG2E = 1.4426950408889634
SWAP_MIN_ROWS = 8  # query rows of a group under swap_ab (the n8 of mma.m16n8k16)
NO_WINDOW = 1 << 30  # a window longer than any context
NUM_PARAMS = 6  # constexpr slots a tile reader gets for its layout (field offsets, group sizes)
NUM_TABLES = 4  # DecodeSpec.tables: per-layer tensors outside the pages (codebooks, channel scales)


@dataclass(frozen=True)
class TileReader:
    """How to read one of K or V (the signatures are in moekv/ops/decode_tiles.py).

    fn -> (x [BLOCK_N, D], row_scale [BLOCK_N]): the tile, dequantized in registers. A row-scaled
    reader leaves a per-token factor out of x (the kernel folds it into the scores for keys and
    into the probabilities for values). outlier_fn -> (channel per page [NPG], channel per token
    [BLOCK_N], delta [BLOCK_N]) for each of `outliers` slots: the exact value minus what x holds at
    that channel, added by the kernel to the scores (keys) or the output (values) instead of
    patching every element of x.
    """

    fn: object  # a @triton.jit function
    params: tuple[int, ...] = ()
    row_scaled: bool = False
    outlier_fn: object = None  # a @triton.jit function, or None
    outliers: int = 0
    # planes > 1: column planes*j + i of the tile holds channel i*(D/planes) + j (codes stored in
    # planes, unpacked without a shuffle); the kernel reads q and writes the output in that order
    planes: int = 1
    # keys only: fold a per-channel affine of the page into q, for tiles inside one page (NPG == 1):
    # fold_fn -> (q' [G_PAD, D], bias [G_PAD]) with scores = q' @ x^T + bias; fn must then leave
    # the affine out of x (it keeps it in tiles spanning pages)
    fold_fn: object = None
    # a per-tile correction after the product (sparse outliers at arbitrary positions): keys
    # fix_fn(..., s) -> s [G_PAD, BLOCK_N]; values fix_fn(..., p, pv) -> pv [G_PAD, D] (tile order)
    fix_fn: object = None

    def constexprs(self) -> tuple[int, ...]:
        return tuple(self.params) + (0,) * (NUM_PARAMS - len(self.params))


@dataclass(frozen=True)
class DecodeSpec:
    """What the decode kernel needs to know about a format (built by `KVFormat.decode_spec`)."""

    key: TileReader
    value: TileReader
    k_pool: str = "k_pages"  # cache tensors holding the pages ([N, Hkv, ...], a slab per (page, head))
    v_pool: str = "v_pages"
    dot_dtype: torch.dtype = torch.float16  # what the tile readers produce (MMA operand type)
    # the newest page (partly filled, or full: a decode step quantizes the pages it fills after all
    # layers have attended) is read from k_staging / v_staging ([S, Hkv, P, D])
    staged: bool = False
    residual: int = 0  # kivi2: the newest R tokens are read from k_residual / v_residual ([S, Hkv, R, D])
    # per-layer tables outside the pages (e.g. vq's codebooks): up to NUM_TABLES tensors [Hkv, ...],
    # each contiguous per head, or a function of the cache (a LayerKVCache: its .layer) returning
    # them. When there are any, every hook (fn, fold_fn, fix_fn; not outlier_fn) takes their
    # pointers at its program's KV head as NUM_TABLES trailing arguments (T0..T3, unused ones stand-ins)
    tables: object = ()
    # ask L2 for the slabs of the tile this many tiles ahead (0: off): see paged_decode_attention
    prefetch: int = 0
    # splits per (sequence, KV head) = num_splits_for's x this (default_num_splits)
    split_factor: int = 1
    # transposed products (scores [BLOCK_N, G], output [D, G]): the group is the MMA's N, padded to
    # SWAP_MIN_ROWS instead of M's 16
    swap_ab: bool = False
    # ptxas's register cap for the kernel (.maxnreg; None: its own choice): more programs per SM
    max_registers: int | None = None
    # the last split reads the 16-bit tail after its pages (False: a program of its own per head,
    # dispatched after the splits' programs; see paged_decode_attention's separate_tail)
    tail_in_last_split: bool = True


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# The products in either orientation (SWAP_AB): scores [G_PAD, BLOCK_N] = q @ k^T and output
# [G_PAD, D] = p @ v, or (SWAP_AB) scores [BLOCK_N, G_PAD] = k @ q^T and output [D, G_PAD] = v^T @ p.
@triton.jit
def _per_token(x, SWAP_AB: tl.constexpr):
    """A [BLOCK_N] vector broadcast along the tokens axis of the scores."""
    if SWAP_AB:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _per_head(x, SWAP_AB: tl.constexpr):
    """A [G_PAD] vector broadcast along the heads axis of the scores (and of the output)."""
    if SWAP_AB:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


# The operands are cast to DOT inside, the first operand of the product first: the order of the
# casts changes how Triton schedules the loop (shared memory, registers, spills), and this keeps
# each orientation's compiled kernel as it was when it was measured.
@triton.jit
def _scores(q, k, acc, DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """q [G_PAD, D] against k [BLOCK_N, D], added to acc (or None)."""
    if SWAP_AB:
        s = tl.dot(k.to(DOT), tl.trans(q.to(DOT)), acc)
    else:
        s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), acc)
    return s


@triton.jit
def _weighted_values(p, v, DOT: tl.constexpr, SWAP_AB: tl.constexpr, token_scale=None):
    """Probabilities p (the scores' orientation; times token_scale [BLOCK_N] when given) times
    v [BLOCK_N, D]."""
    if SWAP_AB:
        v_t = tl.trans(v.to(DOT))
        if token_scale is not None:
            p = p * token_scale[:, None]
        o = tl.dot(v_t, p.to(DOT))
    else:
        if token_scale is not None:
            p = p * token_scale[None, :]
        o = tl.dot(p.to(DOT), v.to(DOT))
    return o


@triton.constexpr_function
def tokens_axis(swap_ab):
    """The axis of the tokens in the scores (and probabilities): 0 under SWAP_AB, else 1."""
    return 0 if swap_ab else 1


@triton.jit
def _softmax_step(s, valid, m, l, qk_scale, SWAP_AB: tl.constexpr = False):
    """Online softmax over one tile's raw scores s (fp32, before the scale; [G_PAD, BLOCK_N], or
    [BLOCK_N, G_PAD] under SWAP_AB): returns the new running max m and sum l [G_PAD], the tile's
    probabilities p and the factor alpha that rescales what was accumulated before (all base 2)."""
    s = tl.where(_per_token(valid, SWAP_AB), s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=tokens_axis(SWAP_AB)))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - _per_head(m_new, SWAP_AB))
    l = l * alpha + tl.sum(p, axis=tokens_axis(SWAP_AB))
    return m_new, l, p, alpha


@triton.jit
def _tail_tiles(q_tail, m, l, acc, b, h, seq_slots, k_stage, v_stage, stride_ss, stride_sh, stride_st,
                k_ring, v_ring, stride_rs, stride_rh, stride_rt, quantized, first, length, qk_scale,
                D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr, V_PL: tl.constexpr,
                SWAP_AB: tl.constexpr, TAIL_DOT: tl.constexpr):
    """The 16-bit tail [quantized, length) of a sequence's KV head: the staging page, then (kivi2)
    the residual ring, into the online softmax (m, l, acc). q_tail and the keys in channel order;
    the values loaded whole, then permuted to acc's columns (planar when V_PL > 1)."""
    n_off = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    slot = tl.load(seq_slots + b)
    stage_base = slot * stride_ss + h * stride_sh
    ring_base = slot * stride_rs + h * stride_rh
    for start in range(tl.maximum(quantized, first), length, BLOCK_N):
        t_pos = start + n_off
        t_valid = t_pos < length
        if RESIDUAL > 0:
            in_ring = t_pos >= length - RESIDUAL
            at_stage = t_valid & (~in_ring)
            at_ring = t_valid & in_ring
            ring_row = ring_base + (t_pos % RESIDUAL)[:, None] * stride_rt
            t_k = tl.load(k_ring + ring_row + d[None, :], mask=at_ring[:, None], other=0.0).to(TAIL_DOT)
            t_v = tl.load(v_ring + ring_row + d[None, :], mask=at_ring[:, None], other=0.0).to(TAIL_DOT)
        else:
            at_stage = t_valid
            t_k = tl.zeros([BLOCK_N, D], TAIL_DOT)
            t_v = tl.zeros([BLOCK_N, D], TAIL_DOT)
        stage_row = stage_base + (t_pos % P)[:, None] * stride_st
        t_k += tl.load(k_stage + stage_row + d[None, :], mask=at_stage[:, None], other=0.0).to(TAIL_DOT)
        t_v += tl.load(v_stage + stage_row + d[None, :], mask=at_stage[:, None], other=0.0).to(TAIL_DOT)
        if V_PL > 1:
            t_v = tail_values_in_acc_order(t_v, V_PL, BLOCK_N, D)
        m, l, acc = tail_tile_step(q_tail, t_k, t_v, t_valid, m, l, acc, qk_scale, SWAP_AB, TAIL_DOT)
    return m, l, acc


@triton.jit
def tail_values_in_acc_order(t_v, PL: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """A tail value tile [BLOCK_N, D] from channel order to a planar format's accumulator columns
    (column PL * j + s holds channel s * D / PL + j): permuted in registers, after whole-row loads."""
    return tl.reshape(tl.permute(tl.reshape(t_v, (BLOCK_N, PL, D // PL)), (0, 2, 1)), (BLOCK_N, D))


@triton.jit
def tail_tile_step(q_tail, t_k, t_v, t_valid, m, l, acc, qk_scale, SWAP_AB: tl.constexpr, TAIL_DOT: tl.constexpr):
    """One tile of the 16-bit tail (t_k, t_v [BLOCK_N, D] in TAIL_DOT): the online softmax's new
    (m, l, acc), acc [G_PAD, D], or [D, G_PAD] under SWAP_AB."""
    t_s = _scores(q_tail, t_k, None, TAIL_DOT, SWAP_AB)
    m, l, t_p, t_alpha = _softmax_step(t_s, t_valid, m, l, qk_scale, SWAP_AB)
    acc = acc * _per_head(t_alpha, SWAP_AB) + _weighted_values(t_p, t_v, TAIL_DOT, SWAP_AB)
    return m, l, acc


@triton.constexpr_function
def pow2_at_least(n):
    """The smallest power of two >= n (>= 1), for tl.arange lengths in jit code."""
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def split_share(first, quantized, split, num_splits, BLOCK_N: tl.constexpr):
    """Tiles [t0, t1) of a split: the tiles of tokens [first, quantized) cut into num_splits
    contiguous shares (flash-decoding split-K; the window's first tile is where the share starts)."""
    first_tile = first // BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(quantized, BLOCK_N) - first_tile, 0)
    per_split = tl.cdiv(num_tiles, num_splits)
    t0 = first_tile + split * per_split
    return t0, tl.minimum(t0 + per_split, first_tile + num_tiles)


@triton.jit
def _prefetch_slab(pool, offset, SLAB: tl.constexpr, enabled=True):
    """Ask L2 for the SLAB bytes at element `offset` of `pool` (a (page, head) slab), one prefetch
    per 128-byte line; none where `enabled` (a scalar condition) is false."""
    LINES: tl.constexpr = (SLAB + 127) // 128
    line = tl.arange(0, pow2_at_least(LINES))
    start = (pool + offset).to(tl.pointer_type(tl.uint8), bitcast=True)
    prefetch_l2(tl.where((line < LINES) & enabled, (start + line * 128).to(tl.int64, bitcast=True), 0))


@triton.jit
def _paged_decode_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, Hq, D]
    k_pool, v_pool, stride_kp, stride_kh, stride_vp, stride_vh,  # [N, Hkv, slab] (elements of their dtype)
    block_tables, stride_bt, context_lens, seq_slots,  # [B, max_pages] int32, [B] int32, [B] int64
    k_stage, v_stage, stride_ss, stride_sh, stride_st,  # [S, Hkv, P, D] (STAGED)
    k_ring, v_ring, stride_rs, stride_rh, stride_rt,  # [S, Hkv, R, D] (RESIDUAL > 0)
    part_o, part_lse,  # [B, Hq, ns_total, D] fp32, [B, Hq, ns_total] fp32
    qk_scale, window,  # softmax scale * log2(e); sliding window (NO_WINDOW = none)
    num_splits, ns_total,  # shares of the pages; programs per head (the last one also reads the 16-bit tail)
    tab0, tab1, tab2, tab3, stride_t0, stride_t1, stride_t2, stride_t3,  # DecodeSpec.tables [Hkv, ...] (TABLES)
    K_TILE: tl.constexpr, V_TILE: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, K4: tl.constexpr, K5: tl.constexpr,
    V0: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr, V3: tl.constexpr, V4: tl.constexpr, V5: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, K_NO: tl.constexpr, V_NO: tl.constexpr,
    K_FOLD: tl.constexpr, K_FIX: tl.constexpr, V_FIX: tl.constexpr,  # None or @triton.jit hooks
    K_PL: tl.constexpr, V_PL: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGED: tl.constexpr, RESIDUAL: tl.constexpr,
    DOT: tl.constexpr, TAIL_DOT: tl.constexpr, ASM: tl.constexpr, TABLES: tl.constexpr,
    PREFETCH: tl.constexpr, K_SLAB: tl.constexpr, V_SLAB: tl.constexpr, SWAP_AB: tl.constexpr,
    TAIL_IN_LAST: tl.constexpr,  # the last split reads the 16-bit tail (else a program of its own)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    rows = tl.arange(0, G_PAD)  # query heads h*G + rows of the group (rows >= G are padding)
    d = tl.arange(0, D)
    q_rows = q_ptr + b * stride_qb + (h * G + rows)[:, None] * stride_qh  # [G_PAD, 1]
    q_heads = q_ptr + b * stride_qb + (h * G + rows) * stride_qh  # [G_PAD] (the outlier channels' q)
    q = tl.load(q_rows + d[None, :], mask=(rows < G)[:, None], other=0.0).to(tl.float32)

    length = tl.load(context_lens + b)
    quantized = length  # tokens [0, quantized) live in pages
    if STAGED:
        quantized = ((length - 1) // P) * P  # the newest page, even when full, is in staging
    if RESIDUAL > 0:
        quantized = tl.minimum(quantized, tl.maximum(length - RESIDUAL, 0))
    first = tl.maximum(length - window, 0)  # the sliding window's oldest token

    m = tl.full([G_PAD], -1e30, tl.float32)  # finite start: a fully masked tile cannot give inf - inf
    l = tl.zeros([G_PAD], tl.float32)
    if SWAP_AB:  # transposed products: tokens and channels are the MMA's M, the group its N
        acc = tl.zeros([D, G_PAD], tl.float32)
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N  # tokens of one page in a tile
    NPG: tl.constexpr = BLOCK_N // PP  # pages a tile spans
    out_col = d  # the partial's column of each accumulator column (every program's, the tail's too)
    if V_PL > 1:
        out_col = (d % V_PL) * (D // V_PL) + d // V_PL
    if TABLES:  # the tables of this program's KV head
        tab0 += h * stride_t0
        tab1 += h * stride_t1
        tab2 += h * stride_t2
        tab3 += h * stride_t3
    if split < num_splits:
        if K_PL > 1:  # q's channels in the key tile's column order
            kcol = (d % K_PL) * (D // K_PL) + d // K_PL
            q = tl.load(q_rows + kcol[None, :], mask=(rows < G)[:, None], other=0.0).to(tl.float32)
        q_main = q.to(DOT)
        t0, t1 = split_share(first, quantized, split, num_splits, BLOCK_N)
        bt_row = block_tables + b.to(tl.int64) * stride_bt
        for t in range(t0, t1):
            start = t * BLOCK_N
            pos = start + n_off  # [BLOCK_N] token positions
            valid = (pos < quantized) & (pos >= first)
            tok = pos % P
            tok0 = start % P  # first row of the tile in its page (0 when pages are shorter than tiles)
            if NPG == 1:
                # the tile lies in one page: scalar page ids tell the compiler the addresses are uniform
                page = tl.load(bt_row + start // P).to(tl.int64)
                page_pg = page
            else:  # each token's page, and each page's id
                page = tl.load(bt_row + pos // P, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]
                pg = start // P + tl.arange(0, NPG)
                page_pg = tl.load(bt_row + pg, mask=pg * P < quantized, other=0).to(tl.int64)  # [NPG]
            if PREFETCH > 0 and NPG == 1:
                # the slabs of the tile PREFETCH ahead into L2 (the last tile's page when past the
                # share): the readers' small loads that Triton does not pipeline (scales, outlier
                # slots) then wait for L2, not HBM
                ahead = tl.load(bt_row + tl.minimum(t + PREFETCH, t1 - 1) * BLOCK_N // P).to(tl.int64)
                _prefetch_slab(k_pool, ahead * stride_kp + h * stride_kh, K_SLAB)
                _prefetch_slab(v_pool, ahead * stride_vp + h * stride_vh, V_SLAB)
            kb = page * stride_kp + h * stride_kh
            kpb = page_pg * stride_kp + h * stride_kh
            if TABLES:
                k, k_scale = K_TILE(k_pool, kb, tok, kpb, tok0, valid, D, BLOCK_N, P, ASM, K0, K1, K2, K3, K4, K5,
                                    tab0, tab1, tab2, tab3)
            else:
                k, k_scale = K_TILE(k_pool, kb, tok, kpb, tok0, valid, D, BLOCK_N, P, ASM, K0, K1, K2, K3, K4, K5)
            s = tl.zeros([G_PAD, BLOCK_N], tl.float32)
            if K_FIX is not None:
                # the sparse corrections first, as the product's accumulator: their branches then
                # carry one tensor in the MMA's layout (fixed after the product, each branch carried
                # s in every layout the softmax and P @ V want: 255 registers and spills for nuq2)
                if TABLES:
                    s = K_FIX(k_pool, kpb, tok0, q_rows, rows < G, s, D, BLOCK_N, P, DOT, K0, K1, K2, K3, K4, K5,
                              tab0, tab1, tab2, tab3)
                else:
                    s = K_FIX(k_pool, kpb, tok0, q_rows, rows < G, s, D, BLOCK_N, P, DOT, K0, K1, K2, K3, K4, K5)
            if SWAP_AB:  # s [BLOCK_N, G_PAD] from here on
                s = tl.trans(s)
            if K_FOLD is not None and NPG == 1:  # the page's channel affine, applied to q instead
                if TABLES:
                    q_page, bias = K_FOLD(k_pool, kpb, q, D, P, K0, K1, K2, K3, K4, K5, tab0, tab1, tab2, tab3)
                else:
                    q_page, bias = K_FOLD(k_pool, kpb, q, D, P, K0, K1, K2, K3, K4, K5)
                s = _scores(q_page, k, s, DOT, SWAP_AB) + _per_head(bias, SWAP_AB)
            else:
                s = _scores(q_main, k, s, DOT, SWAP_AB)  # fp32
            if K_SCALED:
                s = s * _per_token(k_scale, SWAP_AB)
            for o in tl.static_range(K_NO):  # outlier channels: s += q[:, channel] * (exact - tile value)
                ch_pg, ch_tok, delta = K_OUT(k_pool, kb, tok, kpb, tok0, valid, o, D, BLOCK_N, P,
                                             K0, K1, K2, K3, K4, K5)
                q_at = _per_head(q_heads, SWAP_AB)
                if NPG == 1:  # q at the page's channel, in the heads' axis of s
                    q_col = tl.load(q_at + ch_pg, mask=_per_head(rows < G, SWAP_AB), other=0.0).to(tl.float32)
                else:  # q at each token's channel, shaped as s
                    q_col = tl.load(q_at + _per_token(ch_tok, SWAP_AB), mask=_per_head(rows < G, SWAP_AB),
                                    other=0.0).to(tl.float32)
                s += q_col * _per_token(delta, SWAP_AB)
            m, l, p, alpha = _softmax_step(s, valid, m, l, qk_scale, SWAP_AB)

            vb = page * stride_vp + h * stride_vh
            vpb = page_pg * stride_vp + h * stride_vh
            if TABLES:
                v, v_scale = V_TILE(v_pool, vb, tok, vpb, tok0, valid, D, BLOCK_N, P, ASM, V0, V1, V2, V3, V4, V5,
                                    tab0, tab1, tab2, tab3)
            else:
                v, v_scale = V_TILE(v_pool, vb, tok, vpb, tok0, valid, D, BLOCK_N, P, ASM, V0, V1, V2, V3, V4, V5)
            if V_SCALED:
                # per-token value scales go into the probabilities, normalised by the tile's largest
                # so that p * scale stays far from fp16's subnormals, and restored on the product
                v_max = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
                pv = _weighted_values(p, v, DOT, SWAP_AB, v_scale / v_max) * v_max
            else:
                pv = _weighted_values(p, v, DOT, SWAP_AB)
            if SWAP_AB and (V_NO > 0 or V_FIX is not None):  # the value hooks take [G_PAD, ...]
                p = tl.trans(p)
                pv = tl.trans(pv)
            for o in tl.static_range(V_NO):  # outlier channels: out[:, channel] += sum_n p * delta
                ch_pg, ch_tok, delta = V_OUT(v_pool, vb, tok, vpb, tok0, valid, o, D, BLOCK_N, P,
                                             V0, V1, V2, V3, V4, V5)
                if NPG == 1:
                    pv += tl.where(d[None, :] == ch_pg, tl.sum(p * delta[None, :], axis=1)[:, None], 0.0)
                else:
                    per_page = tl.sum(tl.reshape(p * delta[None, :], (G_PAD, NPG, PP)), axis=2)  # [G_PAD, NPG]
                    hit = d[None, None, :] == ch_pg[None, :, None]  # [1, NPG, D]
                    pv += tl.sum(tl.where(hit, per_page[:, :, None], 0.0), axis=1)
            if V_FIX is not None:
                if TABLES:
                    pv = V_FIX(v_pool, vpb, tok0, p, pv, D, BLOCK_N, P, DOT, V0, V1, V2, V3, V4, V5,
                               tab0, tab1, tab2, tab3)
                else:
                    pv = V_FIX(v_pool, vpb, tok0, p, pv, D, BLOCK_N, P, DOT, V0, V1, V2, V3, V4, V5)
            if SWAP_AB and (V_NO > 0 or V_FIX is not None):
                pv = tl.trans(pv)
            acc = acc * _per_head(alpha, SWAP_AB) + pv
    else:  # the tail's own program (TAIL_IN_LAST off: ns_total = num_splits + 1), q in channel order
        if not TAIL_IN_LAST:
            m, l, acc = _tail_tiles(q.to(TAIL_DOT), m, l, acc, b, h, seq_slots, k_stage, v_stage, stride_ss, stride_sh,
                                    stride_st, k_ring, v_ring, stride_rs, stride_rh, stride_rt, quantized, first,
                                    length, qk_scale, D, P, BLOCK_N, RESIDUAL, V_PL, SWAP_AB, TAIL_DOT)
    if STAGED and TAIL_IN_LAST:  # the tail (kivi2: staging page and residual ring) exists only when STAGED
        if split == ns_total - 1:  # the last split, after its pages; q reloaded in channel order
            q_tail = tl.load(q_rows + d[None, :], mask=(rows < G)[:, None], other=0.0).to(TAIL_DOT)
            m, l, acc = _tail_tiles(q_tail, m, l, acc, b, h, seq_slots, k_stage, v_stage, stride_ss, stride_sh,
                                    stride_st, k_ring, v_ring, stride_rs, stride_rh, stride_rt, quantized, first,
                                    length, qk_scale, D, P, BLOCK_N, RESIDUAL, V_PL, SWAP_AB, TAIL_DOT)

    head = (b * (NUM_KV_HEADS * G) + h * G + rows).to(tl.int64)  # [G_PAD]
    if SWAP_AB:
        acc = tl.trans(acc)
    store_partial(part_o, part_lse, head, split, ns_total, out_col, rows < G, m, l, acc, D)


@triton.jit
def store_partial(part_o, part_lse, head, split, ns_total, out_col, row_ok, m, l, acc, D: tl.constexpr):
    """A split's normalised partial output (columns out_col of each head's row) and its
    log2-sum-exp; an empty share writes (0, -inf). head [G_PAD] int64, row_ok masks padding rows."""
    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(part_o + (head * ns_total + split)[:, None] * D + out_col[None, :], o, mask=row_ok[:, None])
    tl.store(part_lse + head * ns_total + split, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(part_o, part_lse, out, stride_ob, stride_oh, ns_total,
                   NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    """One program per (b, query head): reduce_head."""
    let_dependents_launch(PDL)  # the o projection may become resident (ops/pdl.py)
    reduce_head(part_o, part_lse, out, stride_ob, stride_oh, ns_total, tl.program_id(0), tl.program_id(1),
                NUM_HEADS, NS_PAD, D)


@triton.jit
def reduce_head(part_o, part_lse, out, stride_ob, stride_oh, ns_total, b, hq,
                NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr):
    """out[b, hq] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    head = (b * NUM_HEADS + hq).to(tl.int64)
    s = tl.arange(0, NS_PAD)
    d = tl.arange(0, D)
    lse = tl.load(part_lse + head * ns_total + s, mask=s < ns_total, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # [NS_PAD]; empty shares weigh 0
    o = tl.load(part_o + (head * ns_total + s)[:, None] * D + d[None, :], mask=(s < ns_total)[:, None], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out + b * stride_ob + hq * stride_oh + d, res.to(out.dtype.element_ty))


def check_block_n(kernel: str, block_n: int) -> None:
    """Tiles are a power of two >= 16 tokens (the MMA's smallest); `kernel` names the launcher in the error."""
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{kernel}: block_n={block_n} must be a power of two >= 16 (the MMA's smallest tile)")


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Enough programs to fill the GPU about twice, each with at least 2 tiles of work, and twice
    that with 64 or more (sequence, KV head) pairs. At batch 1, 4k on the H200, 32 splits of 2 tiles
    ran in 8.7 us where 16 of 4 took 9.9 (results/h200/decode_step_kernels.json). At batch >= 16,
    doubling gave 0-25% (nuq2, 2 programs per SM: 1.95 -> 1.47 ms at 16 x 32k; bf16 2.45 -> 2.07 at
    64 x 32k: it evens out the last wave of programs) and cost at batch 1
    (results/h200/decode_attention.json); filling 4x instead (5 splits at 16 x 32k, 1.6 waves of 3
    programs per SM) was 5-10% slower than either."""
    want = math.ceil(2 * num_sms / max(1, batch * num_kv_heads))
    if batch * num_kv_heads >= 64:
        want *= 2
    return max(1, min(want, math.ceil(max_context / (2 * block_n)), 128))


def default_num_splits(spec: DecodeSpec, batch: int, num_kv_heads: int, max_context: int, block_n: int,
                       num_sms: int) -> int:
    """The splits of a launch whose occupancy is unknown (the interpreter, or a kernel that could
    not be compiled ahead): num_splits_for's x spec.split_factor, at most one tile each."""
    splits = num_splits_for(batch, num_kv_heads, max_context, block_n, num_sms) * spec.split_factor
    return max(1, min(splits, math.ceil(max_context / block_n)))


WAVE_FILL = 0.95  # wave_splits: the share of the last wave of programs that must be busy


@functools.lru_cache(maxsize=4096)  # called for every layer of an eager step, with the same numbers
def wave_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int,
                programs_per_sm: int) -> int:
    """Splits chosen by how full the last wave of programs is: the fewest, from 2, at which the
    B * Hkv * splits programs fill whole waves of num_sms * programs_per_sm to WAVE_FILL (all the
    first wave holds when that is the one), each split at least 2 tiles (at most 128); where none
    does (short contexts at small batch), the fullest. On the H200 the decode kernels' time
    followed the last wave's fill more than their instruction count (session 12,
    results/h200/decode_attention_splits_*.json): fp8 with 5
    programs per SM at (16, 32k) took 311 us with 5 or 10 splits (0.97 of a wave) against 357 with
    8 or 12 (0.78); int4 at (1, 128k) 159 us with 66 (one wave of 4 per SM) against 228 with 33."""
    pairs = max(1, batch * num_kv_heads)
    slots = num_sms * max(1, programs_per_sm)
    cap = max(1, min(128, math.ceil(max_context / (2 * block_n))))
    best, best_fill = cap, -1.0
    for splits in range(min(2, cap), cap + 1):
        programs = pairs * splits
        fill = programs / (slots * math.ceil(programs / slots))
        if fill >= WAVE_FILL:  # within one wave: as many as it holds
            return min(cap, slots // pairs) if programs <= slots else splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def launch_split_kernel(kernel_fn, kernel_args, launch_key, default_splits: int, num_splits: int | None,
                        max_registers: int, cap_is_default: bool, batch: int, num_kv_heads: int, max_context: int,
                        block_n: int, num_warps: int, num_stages: int, interpret: bool, device: torch.device):
    """Launch a split-K decode kernel (both decode launchers) on grid (batch * num_kv_heads, ns_total)
    and return (part_o, part_lse, ns_total). kernel_args(num_splits) -> (part_o, part_lse, ns_total,
    args); launch_key(regs): what the compiled kernel under cap regs depends on. Compiled: splits
    and cap by choose_launch at the kernel's occupancy (compiled once per key, before the launch);
    interpreted: num_splits or default_splits, no cap."""
    if interpret:
        num_splits, max_registers = num_splits or default_splits, 0
    else:
        def occupancy(regs):  # compiled once per key, before the first launch
            key = launch_key(regs)
            if key not in _OCCUPANCY:
                *_, ns_total, args = kernel_args(default_splits)
                _OCCUPANCY[key] = compiled_occupancy(kernel_fn, args, (batch * num_kv_heads, ns_total), num_warps,
                                                     num_stages, regs, device)
            return _OCCUPANCY[key]

        num_splits, max_registers = choose_launch(num_splits, max_registers, cap_is_default, occupancy, batch,
                                                  num_kv_heads, max_context, block_n, _sm_count(device))
    part_o, part_lse, ns_total, args = kernel_args(num_splits)
    LAST_LAUNCH.update(num_splits=num_splits, max_registers=max_registers or None, grid=(batch * num_kv_heads, ns_total))
    kernel_fn[(batch * num_kv_heads, ns_total)](*args, num_warps=num_warps, num_stages=num_stages,
                                                **({"maxnreg": max_registers} if max_registers else {}))
    return part_o, part_lse, ns_total


def programs_per_sm(n_regs: int, shared: int, num_warps: int, max_regs: int, max_shared: int) -> int:
    """How many programs of a kernel (n_regs registers a thread, `shared` bytes of shared memory,
    num_warps warps) an SM holds at once: the least of what its max_regs registers (allocated per
    warp in units of 256), its shared memory (max_shared, the opt-in limit of one block, + the 1 KiB
    the driver reserves per block) and its 64 warps allow. H200 (65536, 232448): fp8's kernel at 128
    registers and 38 KiB holds 4, at 96 registers 5."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = max_regs // max(1, regs_per_warp * num_warps)
    by_smem = (max_shared + 1024) // (shared + 1024)
    return max(1, min(by_regs, by_smem, 64 // num_warps))


def _kernel_programs_per_sm(kernel, num_warps: int, device: torch.device) -> int:
    """programs_per_sm of a compiled Triton kernel on `device`."""
    kernel._init_handles()  # loads the binary: n_regs is known from then on
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return programs_per_sm(kernel.n_regs, kernel.metadata.shared, num_warps, props["max_num_regs"],
                           props["max_shared_mem"])


def compiled_occupancy(kernel_fn, args, grid, num_warps: int, num_stages: int, max_registers: int,
                       device: torch.device) -> tuple[int, int]:
    """(programs per SM, spill bytes) of kernel_fn compiled (JITFunction.warmup, not launched) for
    (args, grid, launch options) under ptxas's register cap max_registers (0: none)."""
    options = {"maxnreg": int(max_registers)} if max_registers else {}
    kernel = kernel_fn.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **options)
    return _kernel_programs_per_sm(kernel, num_warps, device), int(kernel.n_spills)


# A format's default register cap buys programs per SM with spills (loop invariants reloaded from
# L1). Where each split has only a few tiles the extra programs are not there to be had (the grid
# already fits in one wave) or not worth the longer reduce, and the reloads sit on a short loop's
# critical path: session 13 at batch 1 (results/h200/decode_attention_caps_session13_b1.json), with
# 2 tiles a split at 4k, tiered 19.7 us uncapped against 22.3 capped, nuq2 16.6 / 17.1; with ~6
# at 32k, int4 43.8 / 48.3 (66 splits against 82); with >= 10, nuq2 88.0 / 79.0 and at 128k
# every capped format faster. So a default cap whose kernel spills is dropped below this many tiles.
MIN_CAPPED_TILES = 8


def choose_launch(num_splits: int | None, max_registers: int, cap_is_default: bool, occupancy, batch: int,
                  num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, max_registers) of a compiled decode launch. occupancy(max_registers) -> (programs
    per SM, spill bytes) of the kernel under that cap. Splits not given are wave_splits' at the
    kernel's occupancy; a default cap (not one the caller asked for) whose kernel spills is dropped
    when a split would get fewer than MIN_CAPPED_TILES tiles, and the splits chosen again without it."""
    chosen = num_splits is None
    capped = None  # (programs per SM, spills) under max_registers, asked for only where needed
    if chosen:
        capped = occupancy(max_registers)
        num_splits = wave_splits(batch, num_kv_heads, max_context, block_n, num_sms, capped[0])
    tiles = -(-max_context // block_n)
    if cap_is_default and max_registers and -(-tiles // num_splits) < MIN_CAPPED_TILES \
            and (capped or occupancy(max_registers))[1]:
        max_registers = 0
        if chosen:
            num_splits = wave_splits(batch, num_kv_heads, max_context, block_n, num_sms, occupancy(0)[0])
    return num_splits, max_registers


def occupancy_key(spec: DecodeSpec, tables, q, k_pool, v_pool, G: int, P: int, block_n: int, num_warps: int,
                  num_stages: int, use_asm: bool, prefetch: int, swap_ab: bool,
                  max_registers: int | None = None, tail_in_last: bool = True) -> tuple:
    """What the compiled decode kernel (and so its programs per SM) depends on. A spec is rebuilt
    for every call and its tables may be a new closure, so the key is built from its parts; the
    readers' hooks are module-level functions, keyed by id (hashing a JITFunction costs ~1 us, and
    this runs for every layer of an eager step)."""
    hooks = tuple(id(f) for r in (spec.key, spec.value) for f in (r.fn, r.outlier_fn, r.fold_fn, r.fix_fn))
    readers = tuple((r.params, r.outliers, r.planes, r.row_scaled) for r in (spec.key, spec.value))
    return (hooks, readers, spec.dot_dtype, spec.staged, spec.residual, tuple(t.dtype for t in tables), q.dtype,
            q.shape[-1], k_pool.dtype, v_pool.dtype, G, P, block_n, num_warps, num_stages, bool(use_asm),
            int(prefetch), bool(swap_ab), max_registers, bool(tail_in_last), q.device)


_OCCUPANCY: dict = {}  # launch key -> (programs per SM, spill bytes) (launch_split_kernel)
LAST_LAUNCH: dict = {}  # what the last decode launch (paged or tiered) chose (num_splits, max_registers, grid)


_SM_COUNT: dict[int, int] = {}
_INTERPRETER_PATCHED = False


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop bounds
    with int(array), which numpy >= 2.3 refuses: a `range` bounded by a loaded value fails. Read
    the element instead (only under TRITON_INTERPRET=1; compiled kernels are untouched)."""
    global _INTERPRETER_PATCHED
    if _INTERPRETER_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _INTERPRETER_PATCHED = True


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def paged_decode_attention(q: torch.Tensor, tensors, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           seq_slots: torch.Tensor | None, scale: float, sliding_window: int | None,
                           spec: DecodeSpec, num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, use_asm: bool | None = None,
                           prefetch: int | None = None, out: torch.Tensor | None = None,
                           swap_ab: bool | None = None, max_registers: int | None = None,
                           separate_tail: bool = False) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] (one query per sequence, its last position) over each
    sequence's context_lens[b] tokens, read through `spec` from `tensors` (a LayerKVCache or a
    dict of its tensors). Returns [B, Hq, D] in q's dtype.

    Under TRITON_INTERPRET=1 (CPU tensors) every dot is done in fp32 (the
    interpreter's bf16 dot is wrong, see DESIGN.md section 6). num_splits, block_n, num_warps,
    num_stages: launch shape (None: chosen here; the splits by `wave_splits` from the compiled
    kernel's programs per SM, compiled once per `occupancy_key` before the first launch, or
    `default_num_splits` under the interpreter); use_asm: let tile readers use inline PTX
    (default: on CUDA, where every thread holds whole 4-byte groups of codes); prefetch: ask L2
    for the slabs of the tile this many tiles ahead (0: off; None: spec.prefetch; compiled
    kernels with tiles inside one page only); swap_ab: scores as k @ q^T (None: spec.swap_ab);
    max_registers: ptxas's register cap (None: spec.max_registers; 0: none; compiled kernels only);
    separate_tail: the 16-bit tail of a staged format in a program of its own, after the splits'
    (as spec.tail_in_last_split=False asks: the layout before session 14), else where the spec says.
    """
    B, Hq, D = q.shape
    k_pool, v_pool = tensors[spec.k_pool], tensors[spec.v_pool]
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq or D & (D - 1) or D < 16:
        raise ValueError(f"decode kernel: needs Hq % Hkv == 0 and a power-of-two head_dim >= 16 (Hq={Hq}, Hkv={Hkv}, D={D})")
    P = tensors["k_staging"].shape[2] if spec.staged else k_pool.shape[2]
    interpret = not isinstance(_paged_decode_kernel, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1
    if interpret:
        _patch_interpreter_index()
    block_n = block_n or (16 if interpret else 64)
    check_block_n("decode kernel", block_n)
    if use_asm is None:
        use_asm = not interpret
    use_asm = bool(use_asm) and not interpret and block_n * D // 4 >= 4 * 32 * num_warps
    if q.stride(-1) != 1:
        q = q.contiguous()
    if spec.staged:
        k_stage, v_stage = tensors["k_staging"], tensors["v_staging"]
    else:  # unused: any tensor of the right kind stands in
        k_stage = v_stage = q
    if spec.residual:
        k_ring, v_ring = tensors["k_residual"], tensors["v_residual"]
    else:
        k_ring = v_ring = k_stage
    if seq_slots is None:
        seq_slots = context_lens
    dot = tl.float32 if interpret else _TL_DTYPES[spec.dot_dtype]
    tail_dot = tl.float32 if interpret else _TL_DTYPES[k_stage.dtype if spec.staged else q.dtype]
    st = k_stage.stride() if spec.staged else (0, 0, 0, 0)
    rt = k_ring.stride() if spec.residual else (0, 0, 0, 0)
    if swap_ab is None:
        swap_ab = spec.swap_ab
    G_PAD = max(SWAP_MIN_ROWS if swap_ab else 16, triton.next_power_of_2(G))
    tables = tuple(spec.tables(tensors) if callable(spec.tables) else spec.tables)
    if len(tables) > NUM_TABLES or any(t.shape[0] != Hkv for t in tables):
        raise ValueError(f"decode kernel: up to {NUM_TABLES} tables of [Hkv={Hkv}, ...], got "
                         f"{[tuple(t.shape) for t in tables]}")
    has_tables = len(tables) > 0
    if prefetch is None:
        prefetch = spec.prefetch
    if interpret or P < block_n:  # inline PTX; one page per tile
        prefetch = 0
    k_slab, v_slab = k_pool.stride(1) * k_pool.element_size(), v_pool.stride(1) * v_pool.element_size()
    tab_strides = [t.stride(0) for t in tables] + [0] * (NUM_TABLES - len(tables))
    tables = tables + (q,) * (NUM_TABLES - len(tables))  # unused: any tensor stands in

    tail_in_last = spec.tail_in_last_split and not separate_tail

    def kernel_args(num_splits):
        ns_total = num_splits + (1 if spec.staged and not tail_in_last else 0)
        part_o = torch.empty(B, Hq, ns_total, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, ns_total, dtype=torch.float32, device=q.device)
        return part_o, part_lse, ns_total, (
            q, q.stride(0), q.stride(1),
            k_pool, v_pool, k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            block_tables, block_tables.stride(0), context_lens, seq_slots,
            k_stage, v_stage, st[0], st[1], st[2],
            k_ring, v_ring, rt[0], rt[1], rt[2],
            part_o, part_lse,
            scale * LOG2E, NO_WINDOW if sliding_window is None else int(sliding_window), num_splits, ns_total,
            *tables, *tab_strides,
            spec.key.fn, spec.value.fn, spec.key.outlier_fn or spec.key.fn, spec.value.outlier_fn or spec.value.fn,
            *spec.key.constexprs(), *spec.value.constexprs(),
            spec.key.row_scaled, spec.value.row_scaled, spec.key.outliers, spec.value.outliers,
            spec.key.fold_fn, spec.key.fix_fn, spec.value.fix_fn, spec.key.planes, spec.value.planes,
            Hkv, G, G_PAD, D, P, block_n, spec.staged, spec.residual, dot, tail_dot, use_asm, has_tables,
            int(prefetch), k_slab if prefetch else 0, v_slab if prefetch else 0, bool(swap_ab), tail_in_last)

    max_context = block_tables.shape[1] * P
    # ptxas's register cap (.maxnreg): more programs per SM, at the risk of spills
    cap_is_default = max_registers is None
    if cap_is_default:
        max_registers = spec.max_registers
    max_registers = int(max_registers or 0)

    def launch_key(regs):  # the compile, and so its occupancy, under register cap regs
        return occupancy_key(spec, tables, q, k_pool, v_pool, G, P, block_n, num_warps, num_stages, use_asm,
                             prefetch, swap_ab, regs, tail_in_last)

    part_o, part_lse, ns_total = launch_split_kernel(
        _paged_decode_kernel, kernel_args, launch_key,
        default_num_splits(spec, B, Hkv, max_context, block_n, _sm_count(q.device)), num_splits, max_registers,
        cap_is_default, B, Hkv, max_context, block_n, num_warps, num_stages, interpret, q.device)
    if out is None:
        out = torch.empty_like(q)
    _reduce_kernel[(B, Hq)](part_o, part_lse, out, out.stride(0), out.stride(1), ns_total,
                            Hq, max(2, triton.next_power_of_2(ns_total)), D, pdl_enabled(q.device), num_warps=4)
    return out
