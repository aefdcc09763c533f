"""Paged flash-decoding for `tiered` (moekv/kvcache/formats/tiered.py): one launch over pages of both tiers.

A tiered layer keeps two physical pools, FP8 slabs (fp8_e4m3) and low slabs (nuq2), and maps each
logical page (the block manager's id, what block_tables hold) to a tier and, for FP8, a slot in the
FP8 pool. The format mirrors that map into two int32 device tensors, `page_tier` [N] (1 FP8, 2 low,
0 none) and `page_slot` [N] (the FP8 slot, -1 otherwise), which this kernel reads per tile.

The kernel is `_paged_decode_kernel`'s (moekv/ops/decode/paged.py) split-K loop specialised to
two readers: tiles never span pages (BLOCK_N <= P), so each tile is one page of one tier and a
uniform branch on the page's tier picks the FP8 readers (row-scaled codes) or the nuq2 ones
(centroid lookup, the keys' channel affine folded into q, outlier-slot corrections). Both branches
accumulate in nuq2's planar column order (tile column 4j + s = channel s*D/4 + j): the FP8 value
tile is loaded with its channels (rows of its token-major slab) in that order, which keeps its loads
contiguous along the tokens, and the FP8 keys use q in natural order (a score is order-free).

Attention mass: with EMIT_MASS, each tile writes, per query head, the sum of its probabilities
relative to the split's running max at that tile, sum_n 2^(s_n - m), and that m; with the final
log2-sum-exp L of the head, the tile's share of the head's attention is sum * 2^(m - L).
`tiered_decode_attention` returns the per-(sequence, page) sum over all query heads, what the
format's reference path (`TieredFormat.attend_reference`) adds to its per-page scores, or (the
engine's path, `mass_into`) adds it at each page's id into the format's device accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops import tiers
from moekv.ops.decode.common import (
    LOG2E,
    NO_WINDOW,
    SWAP_MIN_ROWS,
    TL_DTYPES,
    check_block_n,
    per_head,
    per_token,
    pow2_at_least,
    prefetch_slab,
    reduce_head,
    softmax_step,
    split_share,
    store_partial,
    tail_tile_step,
    tail_values_in_acc_order,
    tile_scores,
    tokens_axis,
    weighted_values,
)
from moekv.ops.decode.fp8 import fp8_key_tile, fp8_row_scale
from moekv.ops.decode.interpreter import patch_interpreter_index
from moekv.ops.decode.launch import (
    decode_tuning,
    format_tuning,
    launch_split_kernel,
    num_splits_for,
    register_cap,
    sm_count,
)
from moekv.ops.decode.nuq2 import (
    nuq2_key_fix,
    nuq2_key_fold,
    nuq2_key_tile,
    nuq2_value_fix,
    nuq2_value_tile,
)
from moekv.ops.decode.paged import check_sinks, reduce_partials, strides

TIER_FP8 = tl.constexpr(tiers.TIER_FP8)  # jit code reads a global only as a constexpr


@triton.jit
def _fp8_value_tile_planar(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                           P: tl.constexpr, SCALE_OFF: tl.constexpr):
    """fp8_e4m3 value slab (codes e4m3 [D, P] token-major at 0, scale fp16 [P] at SCALE_OFF), a tile
    inside one page, with tile column 4j + s holding channel s*D/4 + j (nuq2's planar order): the
    slab's rows are read in that order, each still contiguous along the tokens. Unmasked loads (as
    fp8_value_tile): tokens past the context weigh 0 through their scale, 0 where not valid."""
    d = tl.arange(0, D)
    ch = (d % 4) * (D // 4) + d // 4
    r = tl.arange(0, BLOCK_N)
    codes = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    row0 = tl.multiple_of(page_base + tok0, 16)
    x_t = tl.load(codes + (row0 + (ch * P)[:, None] + r[None, :]))  # [D, BLOCK_N]
    return tl.trans(x_t.to(tl.float16)), fp8_row_scale(pool, base, tok, valid, SCALE_OFF)


@triton.jit
def _tiered_decode_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, Hq, D]
    kf_pool, vf_pool, stride_kfp, stride_kfh, stride_vfp, stride_vfh,  # FP8 pools [F, Hkv, slab] uint8
    kl_pool, vl_pool, stride_klp, stride_klh, stride_vlp, stride_vlh,  # low (nuq2) pools [N, Hkv, slab] uint8
    block_tables, stride_bt, context_lens, seq_slots,  # [B, max_pages] int32, [B] int32, [B] int64
    page_tier, page_slot,  # [N] int32: tier of each logical page, its FP8 slot
    k_stage, v_stage, stride_ss, stride_sh, stride_st,  # [S, Hkv, P, D]
    part_o, part_lse,  # [B, Hq, ns_total, D] fp32, [B, Hq, ns_total] fp32
    tile_sum, tile_max, max_tiles,  # [B, Hq, max_tiles] fp32 (EMIT_MASS)
    qk_scale, window, num_splits, ns_total,
    F_KS: tl.constexpr, F_VS: tl.constexpr,  # FP8 key / value scale offsets
    K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, K4: tl.constexpr, K5: tl.constexpr,
    V0: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr, V3: tl.constexpr,
    K_FIX: tl.constexpr, V_FIX: tl.constexpr,  # nuq2 outlier-slot hooks, or None
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr, TAIL_DOT: tl.constexpr, ASM: tl.constexpr,
    EMIT_MASS: tl.constexpr, PREFETCH: tl.constexpr,  # L2 prefetch distance in tiles (0: off)
    KF_SLAB: tl.constexpr, VF_SLAB: tl.constexpr, KL_SLAB: tl.constexpr, VL_SLAB: tl.constexpr,  # bytes
    SWAP_AB: tl.constexpr,  # transposed products (DecodeSpec.swap_ab)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    rows = tl.arange(0, G_PAD)
    row_ok = rows < G
    d = tl.arange(0, D)
    q_rows = q_ptr + b * stride_qb + (h * G + rows)[:, None] * stride_qh  # [G_PAD, 1]
    q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)

    length = tl.load(context_lens + b)
    quantized = (length // P) * P  # full pages; the partly filled newest one is staged
    first = tl.maximum(length - window, 0)

    m = tl.full([G_PAD], -1e30, tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    if SWAP_AB:
        acc = tl.zeros([D, G_PAD], tl.float32)
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    planar = (d % 4) * (D // 4) + d // 4  # the channel of each planar tile column
    out_col = planar  # every program's accumulator columns (the tail's too)
    head = (b * (NUM_KV_HEADS * G) + h * G + rows).to(tl.int64)  # [G_PAD]
    if split < num_splits:
        q_pl = tl.load(q_rows + planar[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_fp8 = q.to(DOT)
        t0, t1 = split_share(first, quantized, split, num_splits, BLOCK_N)
        bt_row = block_tables + b.to(tl.int64) * stride_bt
        for t in range(t0, t1):
            start = t * BLOCK_N
            pos = start + n_off
            valid = (pos < quantized) & (pos >= first)
            tok = pos % P
            tok0 = start % P
            page = tl.load(bt_row + start // P).to(tl.int64)
            if PREFETCH > 0:
                # the slabs of the tile PREFETCH ahead into L2, of its tier (a slot >= 0: FP8): the
                # loads behind the tier branch below are not pipelined, so each waits a memory
                # latency; from L2 that wait is shorter
                ahead = tl.load(bt_row + tl.minimum(t + PREFETCH, t1 - 1) * BLOCK_N // P).to(tl.int64)
                a_slot = tl.load(page_slot + ahead).to(tl.int64)
                in_fp8 = a_slot >= 0
                prefetch_slab(kf_pool, a_slot * stride_kfp + h * stride_kfh, KF_SLAB, in_fp8)
                prefetch_slab(vf_pool, a_slot * stride_vfp + h * stride_vfh, VF_SLAB, in_fp8)
                prefetch_slab(kl_pool, ahead * stride_klp + h * stride_klh, KL_SLAB, a_slot < 0)
                prefetch_slab(vl_pool, ahead * stride_vlp + h * stride_vlh, VL_SLAB, a_slot < 0)
            tier = tl.load(page_tier + page)
            if tier == TIER_FP8:
                slot = tl.load(page_slot + page).to(tl.int64)
                kb = slot * stride_kfp + h * stride_kfh
                k, k_scale = fp8_key_tile(kf_pool, kb, tok, kb, tok0, valid, D, BLOCK_N, P, ASM, F_KS, 0, 0, 0, 0, 0)
                s = tile_scores(q_fp8, k, None, DOT, SWAP_AB) * per_token(k_scale, SWAP_AB)
                m, l, p, alpha = softmax_step(s, valid, m, l, qk_scale, SWAP_AB)
                vb = slot * stride_vfp + h * stride_vfh
                v, v_scale = _fp8_value_tile_planar(vf_pool, vb, tok, vb, tok0, valid, D, BLOCK_N, P, F_VS)
                v_max = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
                pv = weighted_values(p, v, DOT, SWAP_AB, v_scale / v_max) * v_max
            else:
                kb = page * stride_klp + h * stride_klh
                k, k_unused = nuq2_key_tile(kl_pool, kb, tok, kb, tok0, valid, D, BLOCK_N, P, ASM,
                                            K0, K1, K2, K3, K4, K5)
                s = tl.zeros([G_PAD, BLOCK_N], tl.float32)
                if K_FIX is not None:
                    s = K_FIX(kl_pool, kb, tok0, q_rows, row_ok, s, D, BLOCK_N, P, DOT, K0, K1, K2, K3, K4, K5)
                q_page, bias = nuq2_key_fold(kl_pool, kb, q_pl, D, P, K0, K1, K2, K3, K4, K5)
                vb = page * stride_vlp + h * stride_vlh
                if SWAP_AB:  # the outlier hooks take [G_PAD, ...] tensors
                    s = tl.trans(s)
                s = tile_scores(q_page, k, s, DOT, SWAP_AB) + per_head(bias, SWAP_AB)
                m, l, p, alpha = softmax_step(s, valid, m, l, qk_scale, SWAP_AB)
                v, v_unused = nuq2_value_tile(vl_pool, vb, tok, vb, tok0, valid, D, BLOCK_N, P, ASM,
                                              V0, V1, V2, V3, 0, 0)
                pv = weighted_values(p, v, DOT, SWAP_AB)
                if V_FIX is not None and SWAP_AB:
                    pv = tl.trans(V_FIX(vl_pool, vb, tok0, tl.trans(p), tl.trans(pv), D, BLOCK_N, P, DOT,
                                        V0, V1, V2, V3, 0, 0))
                elif V_FIX is not None:
                    pv = V_FIX(vl_pool, vb, tok0, p, pv, D, BLOCK_N, P, DOT, V0, V1, V2, V3, 0, 0)
            acc = acc * per_head(alpha, SWAP_AB) + pv
            if EMIT_MASS:  # this tile's probabilities relative to m (the running max after it)
                tl.store(tile_sum + head * max_tiles + t, tl.sum(p, axis=tokens_axis(SWAP_AB)), mask=row_ok)
                tl.store(tile_max + head * max_tiles + t, m, mask=row_ok)
    if split == ns_total - 1:
        # the staged tail [quantized, length): 16-bit, no mass (the reference counts full pages
        # only); read by the last split after its pages, or by a program of its own (separate_tail).
        # q and the keys in channel order, the values permuted to acc's planar columns
        q_tail = q.to(TAIL_DOT)
        slot = tl.load(seq_slots + b)
        stage_base = slot * stride_ss + h * stride_sh
        for start in range(tl.maximum(quantized, first), length, BLOCK_N):
            t_pos = start + n_off
            t_valid = t_pos < length
            stage_row = stage_base + (t_pos % P)[:, None] * stride_st
            t_k = tl.load(k_stage + stage_row + d[None, :], mask=t_valid[:, None], other=0.0).to(TAIL_DOT)
            t_v = tl.load(v_stage + stage_row + d[None, :], mask=t_valid[:, None], other=0.0).to(TAIL_DOT)
            t_v = tail_values_in_acc_order(t_v, 4, BLOCK_N, D)
            m, l, acc = tail_tile_step(q_tail, t_k, t_v, t_valid, m, l, acc, qk_scale, SWAP_AB, TAIL_DOT)
    if SWAP_AB:
        acc = tl.trans(acc)
    store_partial(part_o, part_lse, head, split, ns_total, out_col, row_ok, m, l, acc, D)


def tiered_decode_attention(q: torch.Tensor, tensors, page_tier: torch.Tensor, page_slot: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, seq_slots: torch.Tensor,
                            scale: float, sliding_window: int | None, fp8_fmt, nuq2_fmt, emit_mass: bool = True,
                            num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4,
                            num_stages: int = 2, use_asm: bool | None = None, prefetch: int | None = None,
                            out: torch.Tensor | None = None, mass_into: torch.Tensor | None = None,
                            swap_ab: bool | None = None, max_registers: int | None = None,
                            separate_tail: bool = False, sinks: torch.Tensor | None = None):
    """Decode attention of q [B, Hq, D] over a tiered layer (tensors: its LayerKVCache or a dict with
    k_fp8, v_fp8, k_low, v_low, k_staging, v_staging). Returns (out [B, Hq, D] in q's dtype,
    mass [B, max_pages] fp32 or None): mass[b, i] = the attention probability summed over all query
    heads on the i-th full page of sequence b (0 for the partly filled page and pages past the context).

    fp8_fmt / nuq2_fmt: the tiers' formats (TieredFormat.hi / .lo; nuq2 with page codebooks).
    prefetch: L2 prefetch distance in tiles (None: the tuning's for 'tiered'; 0: off; compiled kernels only).
    mass_into: a [num_pages] fp32 accumulator (the format's mass_dev): the mass is added there at
    each page's id instead of returned (then None), in the same launch that computes it.
    swap_ab (None: the tuning's for 'tiered'), max_registers (ptxas's cap; None: register_cap('tiered', P), 0: none) and
    separate_tail, sinks: as paged_decode_attention's (the mass is over the keys alone, without the
    sink's share of each head's softmax)."""
    B, Hq, D = q.shape
    kf, vf, kl, vl = tensors["k_fp8"], tensors["v_fp8"], tensors["k_low"], tensors["v_low"]
    k_stage, v_stage = tensors["k_staging"], tensors["v_staging"]
    Hkv, P = kl.shape[1], k_stage.shape[2]
    G = Hq // Hkv
    if G * Hkv != Hq or D & (D - 1) or D < 16:
        raise ValueError(f"tiered decode: needs Hq % Hkv == 0 and a power-of-two head_dim >= 16 "
                         f"(Hq={Hq}, Hkv={Hkv}, D={D})")
    if nuq2_fmt.calibrated:
        raise ValueError("tiered decode: the low tier's nuq2 must use page codebooks")
    interpret = not isinstance(_tiered_decode_kernel, triton.runtime.jit.JITFunction)
    if interpret:
        patch_interpreter_index()
    block_n = min(block_n or (16 if interpret else decode_tuning().block_n), P)
    check_block_n("tiered decode", block_n)
    if P % block_n:
        raise ValueError(f"tiered decode: block_n={block_n} must divide block_size={P} (its tiles lie in one page)")
    if use_asm is None:
        use_asm = not interpret
    use_asm = bool(use_asm) and not interpret and block_n * D // 4 >= 4 * 32 * num_warps
    if q.stride(-1) != 1:
        q = q.contiguous()
    max_pages = block_tables.shape[1]
    max_tiles = max_pages * (P // block_n)
    if emit_mass:  # the kernel writes every tile of the window's full pages; the mass programs read only those
        tile_sum = torch.empty(B, Hq, max_tiles, dtype=torch.float32, device=q.device)
        tile_max = torch.empty(B, Hq, max_tiles, dtype=torch.float32, device=q.device)
    koff = fp8_fmt.layout("key", P, D).offsets
    voff = fp8_fmt.layout("value", P, D).offsets
    lk = nuq2_fmt.layout("key", P, D).offsets
    lv = nuq2_fmt.layout("value", P, D).offsets
    k_slots = nuq2_fmt.outlier_slots("key", P, D)
    v_slots = nuq2_fmt.outlier_slots("value", P, D)
    kparams = (lk["centroids"], lk.get("out_val", 0), lk.get("out_idx", 0), k_slots, lk["chan_mean"], lk["chan_scale"])
    vparams = (lv["centroids"], lv.get("out_val", 0), lv.get("out_idx", 0), v_slots)
    dot = tl.float32 if interpret else tl.float16
    tail_dot = tl.float32 if interpret else TL_DTYPES[k_stage.dtype]
    if swap_ab is None:
        swap_ab = format_tuning("tiered").swap_ab
    G_PAD = max(SWAP_MIN_ROWS if swap_ab else 16, triton.next_power_of_2(G))
    if prefetch is None:
        prefetch = format_tuning("tiered").prefetch
    if interpret:  # inline PTX
        prefetch = 0
    slabs = [t.stride(1) * t.element_size() if prefetch else 0 for t in (kf, vf, kl, vl)]
    window = NO_WINDOW if sliding_window is None else int(sliding_window)

    def kernel_args(num_splits):
        ns_total = num_splits + (1 if separate_tail else 0)
        part_o = torch.empty(B, Hq, ns_total, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, ns_total, dtype=torch.float32, device=q.device)
        sums, maxes = (tile_sum, tile_max) if emit_mass else (part_lse, part_lse)
        return part_o, part_lse, ns_total, (
            q, *strides(q, 2),
            kf, vf, *strides(kf, 2), *strides(vf, 2),
            kl, vl, *strides(kl, 2), *strides(vl, 2),
            block_tables, *strides(block_tables, 1), context_lens, seq_slots,
            page_tier, page_slot,
            k_stage, v_stage, *strides(k_stage, 3),
            part_o, part_lse, sums, maxes, max_tiles,
            scale * LOG2E, window, num_splits, ns_total,
            koff["scale"], voff["scale"], *kparams, *vparams,
            nuq2_key_fix if k_slots else None, nuq2_value_fix if v_slots else None,
            Hkv, G, G_PAD, D, P, block_n, dot, tail_dot, use_asm, emit_mass, int(prefetch), *slabs, bool(swap_ab))

    cap_is_default = max_registers is None
    if cap_is_default:
        max_registers = register_cap("tiered", P)
    max_registers = int(max_registers or 0)
    max_context = max_pages * P

    def launch_key(regs):  # as paged_decode_attention's: what the compiled kernel depends on
        return ("tiered", q.dtype, kf.dtype, kl.dtype, k_stage.dtype, D, G, Hkv, P, block_n, koff["scale"],
                voff["scale"], kparams, vparams, use_asm, emit_mass, int(prefetch), bool(slabs[0]), bool(swap_ab),
                num_warps, num_stages, regs, q.device)

    part_o, part_lse, ns_total = launch_split_kernel(
        _tiered_decode_kernel, kernel_args, launch_key,
        num_splits_for(B, Hkv, max_context, block_n, sm_count(q.device)), num_splits, max_registers,
        cap_is_default, B, Hkv, max_context, block_n, num_warps, num_stages, interpret, q.device)
    if out is None:
        out = torch.empty_like(q)
    ns_pad = max(2, triton.next_power_of_2(ns_total))
    if not emit_mass:
        reduce_partials(part_o, part_lse, out, ns_total, False, sinks)
        return out, None
    check_sinks(sinks, Hq, q.device)
    mass = mass_into if mass_into is not None else torch.empty(B, max_pages, dtype=torch.float32, device=q.device)
    block_pages = mass_block_pages(Hq, P // block_n)
    # one launch: programs [0, Hq) of each sequence merge a head's splits, the rest sum the page mass
    reduce_and_mass_kernel[(B, Hq + triton.cdiv(max_pages, block_pages))](
        part_o, part_lse, out, out.stride(0), out.stride(1),
        tile_sum, tile_max, mass, context_lens, block_tables, block_tables.stride(0), window,
        ns_total, max_tiles, max_pages, Hq, ns_pad, D, P // block_n, P, block_n, block_pages,
        mass_into is not None, sinks, sinks is not None, num_warps=4)
    return out, (None if mass_into is not None else mass)


def mass_block_pages(num_heads: int, tiles_per_page: int) -> int:
    """Pages per mass program of reduce_and_mass_kernel: about 2048 (head, tile) pairs each (16 a thread)."""
    return max(1, 2048 // (triton.next_power_of_2(num_heads) * tiles_per_page))


@triton.jit
def reduce_and_mass_kernel(part_o, part_lse, out, stride_ob, stride_oh,
                            tile_sum, tile_max, mass, context_lens, block_tables, stride_bt, window,
                            ns_total, max_tiles, max_pages,
                            NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr, TPP: tl.constexpr,
                            P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_PAGES: tl.constexpr,
                            ACCUMULATE: tl.constexpr, sinks=None, HAS_SINKS: tl.constexpr = False):
    """Grid (B, NUM_HEADS + mass programs). Program (b, j < NUM_HEADS) merges head j's splits
    (reduce_head); program (b, NUM_HEADS + k) writes the mass of pages [k*BLOCK_PAGES, ...) of
    sequence b (page_mass_block). One launch instead of two: at batch 1 a second launch is one more
    step of each layer's dependency chain (docs/decisions.md, "tiered: the split merge and the page
    mass in one launch")."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    if j < NUM_HEADS:
        reduce_head(part_o, part_lse, out, stride_ob, stride_oh, ns_total, b, j, sinks, NUM_HEADS, NS_PAD, D,
                    HAS_SINKS)
    else:
        page_mass_block(part_lse, tile_sum, tile_max, mass, context_lens, block_tables, stride_bt, window,
                        ns_total, max_tiles, max_pages, b, j - NUM_HEADS,
                        NUM_HEADS, NS_PAD, TPP, P, BLOCK_N, BLOCK_PAGES, ACCUMULATE)


@triton.jit
def page_mass_block(part_lse, tile_sum, tile_max, mass, context_lens, block_tables, stride_bt, window,
                    ns_total, max_tiles, max_pages, b, block,
                    NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, TPP: tl.constexpr, P: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_PAGES: tl.constexpr, ACCUMULATE: tl.constexpr):
    """mass[b, i] for the pages i of `block` = sum over query heads h and the tiles t of page i of
    tile_sum[b, h, t] * 2^(tile_max[b, h, t] - lse[b, h]), lse the head's final log2-sum-exp over
    its splits; 0 for the partly filled page and pages past the context. Only the tiles the decode
    kernel wrote are read (full pages from the window's first tile on: tile_sum and tile_max are not
    initialised). ACCUMULATE: add it to mass[block_tables[b, i]] instead (the format's per-page
    accumulator, [N]). All heads at once: a loop over them waits a memory latency per head (32 at
    Mixtral's shape), which at batch 1 takes longer than the decode kernel itself."""
    pages = block * BLOCK_PAGES + tl.arange(0, BLOCK_PAGES)
    length = tl.load(context_lens + b)
    full = length // P
    first_tile = tl.maximum(length - window, 0) // BLOCK_N  # split_share's first tile
    tiles = pages[:, None] * TPP + tl.arange(0, TPP)[None, :]  # [BLOCK_PAGES, TPP]
    ok = (pages < full)[:, None] & (tiles < max_tiles) & (tiles >= first_tile)
    heads = tl.arange(0, pow2_at_least(NUM_HEADS))
    rows = (b * NUM_HEADS + heads).to(tl.int64)  # [H]
    s = tl.arange(0, NS_PAD)
    part = tl.load(part_lse + rows[:, None] * ns_total + s[None, :],
                   mask=(heads < NUM_HEADS)[:, None] & (s < ns_total)[None, :], other=float("-inf"))
    top = tl.max(part, axis=1)
    some = top > float("-inf")  # not a padding head, nor a head with no token
    top = tl.where(some, top, 0.0)  # (no inf - inf)
    lse = tl.where(some, top + tl.log2(tl.where(some, tl.sum(tl.exp2(part - top[:, None]), axis=1), 1.0)), 0.0)
    ok3 = ok[None, :, :] & (heads < NUM_HEADS)[:, None, None]  # [H, BLOCK_PAGES, TPP]
    at = rows[:, None, None] * max_tiles + tiles[None, :, :]
    t_sum = tl.load(tile_sum + at, mask=ok3, other=0.0)
    t_max = tl.load(tile_max + at, mask=ok3, other=float("-inf"))
    per_head = tl.sum(t_sum * tl.exp2(t_max - lse[:, None, None]), axis=2)  # [H, BLOCK_PAGES]; masked: 0 * 0
    acc = tl.sum(per_head, axis=0)
    if ACCUMULATE:
        page_id = tl.load(block_tables + b.to(tl.int64) * stride_bt + pages, mask=pages < full, other=0)
        tl.atomic_add(mass + page_id, acc, mask=pages < full)
    else:
        tl.store(mass + b * max_pages + pages, acc, mask=pages < max_pages)
