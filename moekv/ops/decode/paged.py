"""Paged flash-decoding: one query token per sequence against its paged (possibly compressed) KV.

One kernel serves every KV format. A format describes how to read its pages with a `DecodeSpec`
(moekv/ops/decode/common.py): a *tile reader* for keys and one for values (Triton functions, one module
per format beside this one) that load the bytes of BLOCK_N tokens from their pages and dequantize them
in registers, plus where the newest unquantized tokens live. The kernel does the rest:

- grid (B * Hkv, NUM_SPLITS [+ 1]): program (b, h, s) owns KV head h of sequence b and the s-th
  contiguous share of its quantized pages (flash-decoding split-K); with a staged format one more
  program per (b, h) reads the 16-bit tail (the newest page, partly filled or just full, in the staging tensor,
  and kivi2's residual ring) so that it costs no extra launch;
- all G = Hq / Hkv query heads of the GQA group are the rows of one `tl.dot` against each tile
  (padded to 16 rows, the smallest MMA), so a page is read once per group;
- online softmax in base 2; each program writes its normalised partial output and log-sum-exp;
  `_reduce_kernel` merges the partials of each (b, query head);
- a sliding window skips the tiles before it and masks inside the first one.

How the launch is shaped (splits, register cap) is moekv/ops/decode/launch.py's.

Reference: `moekv.ops.reference.decode_attention_ref` (dense attention of each query over its
sequence's dequantized K/V, i.e. what `KVFormat.attend_reference` computes); for plain pages that
is `paged_attention_ref`, for compressed ones `dense_attention` over `PagedQuantFormat.gather`.

Shape legend: B = sequences (= tokens: one query each), Hq / Hkv = query / KV heads, G = Hq/Hkv,
D = head_dim, P = block_size, S = staging slots, R = residual ring rows, NS = splits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moekv.ops.decode.common import (
    LOG2E,
    NO_WINDOW,
    NUM_TABLES,
    SWAP_MIN_ROWS,
    TL_DTYPES,
    DecodeSpec,
    check_block_n,
    per_head,
    per_token,
    prefetch_slab,
    reduce_head,
    softmax_step,
    split_share,
    store_partial,
    tail_tile_step,
    tail_values_in_acc_order,
    tile_scores,
    weighted_values,
)
from moekv.ops.decode.interpreter import patch_interpreter_index
from moekv.ops.decode.launch import (
    decode_tuning,
    default_num_splits,
    launch_split_kernel,
    occupancy_key,
    sm_count,
)
from moekv.ops.pdl import let_dependents_launch, pdl_enabled


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
    log2_theta,  # log2 of the RoPE base (K_ROPE)
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
    K_ROPE: tl.constexpr,  # pages hold keys before RoPE: the key reader rotates them (DecodeSpec.key_rope)
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
                prefetch_slab(k_pool, ahead * stride_kp + h * stride_kh, K_SLAB)
                prefetch_slab(v_pool, ahead * stride_vp + h * stride_vh, V_SLAB)
            kb = page * stride_kp + h * stride_kh
            kpb = page_pg * stride_kp + h * stride_kh
            if K_ROPE:  # keys stored before RoPE: the reader rotates them by their positions
                if TABLES:
                    k, k_scale = K_TILE(k_pool, kb, tok, kpb, tok0, valid, D, BLOCK_N, P, ASM, K0, K1, K2, K3, K4,
                                        K5, pos, log2_theta, tab0, tab1, tab2, tab3)
                else:
                    k, k_scale = K_TILE(k_pool, kb, tok, kpb, tok0, valid, D, BLOCK_N, P, ASM, K0, K1, K2, K3, K4,
                                        K5, pos, log2_theta)
            elif TABLES:
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
                s = tile_scores(q_page, k, s, DOT, SWAP_AB) + per_head(bias, SWAP_AB)
            else:
                s = tile_scores(q_main, k, s, DOT, SWAP_AB)  # fp32
            if K_SCALED:
                s = s * per_token(k_scale, SWAP_AB)
            for o in tl.static_range(K_NO):  # outlier channels: s += q[:, channel] * (exact - tile value)
                ch_pg, ch_tok, delta = K_OUT(k_pool, kb, tok, kpb, tok0, valid, o, D, BLOCK_N, P,
                                             K0, K1, K2, K3, K4, K5)
                q_at = per_head(q_heads, SWAP_AB)
                if NPG == 1:  # q at the page's channel, in the heads' axis of s
                    q_col = tl.load(q_at + ch_pg, mask=per_head(rows < G, SWAP_AB), other=0.0).to(tl.float32)
                else:  # q at each token's channel, shaped as s
                    q_col = tl.load(q_at + per_token(ch_tok, SWAP_AB), mask=per_head(rows < G, SWAP_AB),
                                    other=0.0).to(tl.float32)
                s += q_col * per_token(delta, SWAP_AB)
            m, l, p, alpha = softmax_step(s, valid, m, l, qk_scale, SWAP_AB)

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
                pv = weighted_values(p, v, DOT, SWAP_AB, v_scale / v_max) * v_max
            else:
                pv = weighted_values(p, v, DOT, SWAP_AB)
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
            acc = acc * per_head(alpha, SWAP_AB) + pv
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
def _reduce_kernel(part_o, part_lse, out, stride_ob, stride_oh, ns_total, sinks,
                   NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """One program per (b, query head): reduce_head."""
    let_dependents_launch(PDL)  # the o projection may become resident (ops/pdl.py)
    reduce_head(part_o, part_lse, out, stride_ob, stride_oh, ns_total, tl.program_id(0), tl.program_id(1), sinks,
                NUM_HEADS, NS_PAD, D, HAS_SINKS)


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Attention sinks are one logit per query head, on the attention's device."""
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or sinks.device != device):
        raise ValueError(f"sinks must be [Hq={num_heads}] on {device}, got {tuple(sinks.shape)} on {sinks.device}")


def reduce_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, ns_total: int, pdl: bool,
                    sinks: torch.Tensor | None = None) -> None:
    """out [B, Hq, D] = the merge of each (sequence, query head)'s ns_total partials (_reduce_kernel); pdl:
    let the next kernel launch early (ops/pdl.py); sinks [Hq]: each head's sink logit, or None."""
    B, Hq, D = out.shape
    check_sinks(sinks, Hq, out.device)
    _reduce_kernel[(B, Hq)](part_o, part_lse, out, out.stride(0), out.stride(1), ns_total,
                            part_lse if sinks is None else sinks,  # unused without sinks: any tensor stands in
                            Hq, max(2, triton.next_power_of_2(ns_total)), D, pdl, sinks is not None, num_warps=4)


def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The first n strides of t, in the kernels' argument order (0s for an operand the launch does not use)."""
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def reader_constexprs(spec: DecodeSpec) -> tuple:
    """The kernel's arguments K_TILE .. V_PL: the two readers' hooks, layout params and flags."""
    k, v = spec.key, spec.value
    return (k.fn, v.fn, k.outlier_fn or k.fn, v.outlier_fn or v.fn, *k.constexprs(), *v.constexprs(),
            k.row_scaled, v.row_scaled, k.outliers, v.outliers, k.fold_fn, k.fix_fn, v.fix_fn, k.planes, v.planes)


def paged_decode_attention(q: torch.Tensor, tensors, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           seq_slots: torch.Tensor | None, scale: float, sliding_window: int | None,
                           spec: DecodeSpec, num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, use_asm: bool | None = None,
                           prefetch: int | None = None, out: torch.Tensor | None = None,
                           swap_ab: bool | None = None, max_registers: int | None = None,
                           separate_tail: bool = False, sinks: torch.Tensor | None = None,
                           rope_theta: float | None = None) -> torch.Tensor:
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
    (as spec.tail_in_last_split=False asks), else where the spec says; sinks [Hq]: each head's
    sink logit (gpt-oss), entering where the splits are merged, or None; rope_theta: the RoPE base
    keys stored before RoPE are rotated by (spec.key_rope; None: tensors.rope_theta, a LayerKVCache's)."""
    B, Hq, D = q.shape
    k_pool, v_pool = tensors[spec.k_pool], tensors[spec.v_pool]
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq or D & (D - 1) or D < 16:
        raise ValueError(f"decode kernel: needs Hq % Hkv == 0 and a power-of-two head_dim >= 16 "
                         f"(Hq={Hq}, Hkv={Hkv}, D={D})")
    P = tensors["k_staging"].shape[2] if spec.staged else k_pool.shape[2]
    interpret = not isinstance(_paged_decode_kernel, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1
    if interpret:
        patch_interpreter_index()
    block_n = block_n or (16 if interpret else decode_tuning().block_n)
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
    dot = tl.float32 if interpret else TL_DTYPES[spec.dot_dtype]
    tail_dot = tl.float32 if interpret else TL_DTYPES[k_stage.dtype if spec.staged else q.dtype]
    stage_strides = strides(k_stage if spec.staged else None, 3)
    ring_strides = strides(k_ring if spec.residual else None, 3)
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
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
    log2_theta = 0.0
    if spec.key_rope:
        if rope_theta is None:
            rope_theta = getattr(tensors, "rope_theta", None)
        if rope_theta is None or not rope_theta > 1:
            raise ValueError(f"decode kernel: keys stored before RoPE need the model's rope_theta > 1 (pass "
                             f"rope_theta, or a LayerKVCache with rope_theta set), got {rope_theta!r}")
        if spec.key.fold_fn is not None or spec.key.fix_fn is not None or spec.key.outliers:
            raise ValueError("decode kernel: a key_rope spec's key reader gives the whole tile (no fold_fn, "
                             "fix_fn or outlier channels): the tile is rotated before its product with q")
        log2_theta = math.log2(rope_theta)

    def kernel_args(num_splits):
        ns_total = num_splits + (1 if spec.staged and not tail_in_last else 0)
        part_o = torch.empty(B, Hq, ns_total, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, ns_total, dtype=torch.float32, device=q.device)
        return part_o, part_lse, ns_total, (
            q, *strides(q, 2),
            k_pool, v_pool, *strides(k_pool, 2), *strides(v_pool, 2),
            block_tables, *strides(block_tables, 1), context_lens, seq_slots,
            k_stage, v_stage, *stage_strides,
            k_ring, v_ring, *ring_strides,
            part_o, part_lse,
            scale * LOG2E, window, num_splits, ns_total,
            *tables, *tab_strides, log2_theta,
            *reader_constexprs(spec),
            Hkv, G, G_PAD, D, P, block_n, spec.staged, spec.residual, dot, tail_dot, use_asm, has_tables,
            int(prefetch), k_slab if prefetch else 0, v_slab if prefetch else 0, bool(swap_ab), tail_in_last,
            spec.key_rope)

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
        default_num_splits(spec, B, Hkv, max_context, block_n, sm_count(q.device)), num_splits, max_registers,
        cap_is_default, B, Hkv, max_context, block_n, num_warps, num_stages, interpret, q.device)
    if out is None:
        out = torch.empty_like(q)
    reduce_partials(part_o, part_lse, out, ns_total, pdl_enabled(q.device), sinks)
    return out
