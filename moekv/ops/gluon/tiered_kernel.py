"""The Gluon kernel of tiered decode attention: FP8 pages and nuq2 pages in one launch, per-page
attention mass out (see tiered_decode.py for the reference and the launcher, fp8_layout.py and
nuq2_layout.py for the two fragment orders it reads).

nuq2_kernel.py's design (one warp per program (b * Hkv + h, split), one 64-token page per tile,
swap-AB mma_v2 products, split-K partials, the staged 16-bit tail as one more split, sliding windows)
with a uniform branch per page on `page_tier` (1 FP8, else nuq2):
  nuq2 page: nuq2_kernel.page_tile as it is (codes looked up into the A operand, the keys' affine
    folded into q, outlier slots as one-hot products); the next page's codes load while this page
    computes (register double buffering), masked off when the next page is FP8 (no bytes read);
  FP8 page: fp8_kernel.fp8_page, 4 steps of 16 tokens (K [16, 128] and V^T [128, 16] as A operands,
    as the staged tail is read: a whole page's fp16 tiles would not fit in registers beside the
    prefetched nuq2 codes), e4m3 converted in registers, the row scales on the scores and on P.
Attention mass (EMIT_MASS): per page, per query head, the sum of the page's probabilities relative to
the split's running max after it, sum_n 2^(s_n - m), and that m (tile_sum, tile_max [B, Hq, max_pages]);
the page's probabilities are accumulated from 0 for each page (exact, not a difference of running
sums). moekv/ops/decode/tiered.py's reduce_and_mass_kernel (TPP = 1: a tile is a page) turns them
into each page's share with the head's final log2-sum-exp.
Staged tail: tiered stores a page when it fills, so only the partly filled newest page is staged:
tokens from (len // 64) * 64 on (nuq2's Gluon kernel: from ((len - 1) // 64) * 64 on).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moekv.ops import tiers
from moekv.ops.gluon.common import PAGE, split_range, staged_tile, store_split
from moekv.ops.gluon.fp8_kernel import fp8_page
from moekv.ops.gluon.nuq2_kernel import (
    ROWS,
    WORDS,
    allocate_stages,
    page_tile,
    scaled_q_and_bias,
    stage_page,
    used_count,
)

TIER_FP8 = gl.constexpr(tiers.TIER_FP8)  # jit code reads a global only as a constexpr


@gluon.jit
def _tiered_sequence(context_lens, window, HKV: gl.constexpr, STAGED: gl.constexpr):
    """(b, h, split, length, quantized, first): as common.program_sequence, with tiered's staging rule
    (STAGED: the partly filled newest page only, tokens from (len // 64) * 64 on)."""
    bh = gl.program_id(0)
    split = gl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    length = gl.load(context_lens + b)
    quantized = length
    if STAGED:
        quantized = (length // PAGE) * PAGE
    first = gl.maximum(length - window, 0)
    return b, h, split, length, quantized, first


@gluon.jit
def tiered_decode_kernel(k_codes, v_codes, k_tables, v_tables, k_mean, k_scale,
                         k_idx, k_delta, k_used, v_idx, v_delta, v_used, SK, SV,
                         kf_w, vf_w, kf_h, vf_h, page_tier, page_slot,
                         q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                         k_stage, v_stage, stride_ss, stride_sh, stride_st,
                         part_o, part_lse, tile_sum, tile_max, max_tiles, qk_scale, window, zero, num_splits, ns_total,
                         HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr, CHUNK0: gl.constexpr,
                         EMIT_MASS: gl.constexpr, FW: gl.constexpr, F_KS: gl.constexpr, F_VS: gl.constexpr,
                         FP8_PREFETCH: gl.constexpr = False, SMEM: gl.constexpr = False):
    """The low tier: nuq2_decode_kernel's tables (k_codes ... SV: int16 slot positions, fp16 deltas, uint8 used
    counts) over all N logical pages. The FP8
    tier: kf_w, vf_w int32 and kf_h, vf_h fp16 views of the FP8 pools [F, HKV, slab] (FW int32 words a
    slab, codes in FP8 fragment order, row scales at byte offsets F_KS / F_VS); page_tier [N] int32
    (1: FP8), page_slot [N] int32 (the FP8 slot). q, block_tables, context_lens, staging and partials
    as nuq2_decode_kernel's (STAGED: tokens from (len // 64) * 64 on are staged); tile_sum, tile_max
    fp32 [B, HKV * G, max_tiles] (EMIT_MASS: one entry per page). SMEM: the next page, when it is a nuq2
    page, staged in shared memory by cp.async as nuq2_decode_kernel's SMEM does (FP8 pages stay global
    loads)."""
    D: gl.constexpr = 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    LK4: gl.constexpr = gl.BlockedLayout([ROWS, 4, 4, 4], [1, 32, 1, 1], [1, 1, 1, 1], [2, 1, 3, 0])
    LV4: gl.constexpr = gl.BlockedLayout([ROWS, 4, 4, 4], [1, 32, 1, 1], [1, 1, 1, 1], [2, 1, 0, 3])
    LK2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LK4))
    LV2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LV4))
    # FP8 code tiles [4 rows, 128 words, 4 bytes (broadcast)], register order (byte, word, row)
    L3: gl.constexpr = gl.BlockedLayout([4, 4, 4], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])

    b, h, split, length, quantized, first = _tiered_sequence(context_lens, window, HKV, STAGED)
    p0, p1 = split_range(first, quantized, split, num_splits, PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)

    if split < num_splits:
        qd = gl.arange(0, D, layout=gl.SliceLayout(1, QL))
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
        q_t = gl.load(q_ptr + (head0 + qn[None, :]) * D + qd[:, None],
                      mask=(qn[None, :] < G) & (qd[:, None] < D), other=0.0).to(gl.float32)
        q_t = gl.convert_layout(q_t.to(gl.float16), LB)
        chan = gl.arange(0, D, layout=gl.SliceLayout(1, LB))
        chan_a = gl.arange(0, D, layout=gl.SliceLayout(0, LA))

        kr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LK2))
        kw = gl.arange(0, 128, layout=gl.SliceLayout(0, LK2))
        k_off = kr[:, None] * 128 + kw[None, :]
        vr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LV2))
        vw = gl.arange(0, 128, layout=gl.SliceLayout(0, LV2))
        v_off = ((vr % 2) * 256 + (vr // 2) * 128)[:, None] + vw[None, :]
        shift_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LK4)))) * 2
        shift_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(shift_k, 0), 0), 0)
        shift_k = shift_k + gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LK4)))), 0), 0), 3)
        shift_v = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LV4)))) * 2
        shift_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(shift_v, 0), 0), 0)
        shift_v = shift_v + gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LV4)))), 0), 0), 3)

        s0 = gl.zeros([PAGE, 8], gl.float32, layout=MMA)
        l0 = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
        mean_template = gl.zeros([PAGE, D], gl.float16, layout=LA)

        last = gl.maximum(p1 - 1, 0)
        pid = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64)
        tier = gl.load(page_tier + pid)
        page = pid * HKV + h
        if SMEM:  # two shared-memory stages of nuq2 pages, a page ahead (nothing staged for FP8 pages)
            k_smem, v_smem, chan_smem, slot_smem, word_smem = allocate_stages()
            if tier != TIER_FP8:
                stage_page(k_smem, v_smem, chan_smem, slot_smem, word_smem, p0 % 2, page, k_codes, v_codes, k_off,
                            v_off, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx, v_delta,
                            v_used, SK, SV, CHUNK0)
            else:
                async_copy.commit_group()
        else:  # register double buffering of the nuq2 codes (loads masked off for FP8 pages)
            kx = gl.load(k_codes + page * WORDS + k_off, mask=(k_off < WORDS) & (tier != TIER_FP8), other=0)
            vx = gl.load(v_codes + page * WORDS + v_off, mask=(v_off < WORDS) & (tier != TIER_FP8), other=0)
        for pg in range(p0, p1):
            pid_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64)
            tier_n = gl.load(page_tier + pid_n)
            page_n = pid_n * HKV + h
            low_n = tier_n != TIER_FP8
            if SMEM:
                async_copy.wait_group(0)  # this page's stage (this lane's copies) ...
                gl.thread_barrier()  # ... and every lane's; every lane is done with the other stage
                if low_n:
                    stage_page(k_smem, v_smem, chan_smem, slot_smem, word_smem, (pg + 1) % 2, page_n, k_codes,
                                v_codes, k_off, v_off, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used,
                                v_idx, v_delta, v_used, SK, SV, CHUNK0)
                else:
                    async_copy.commit_group()
            if tier == TIER_FP8:
                slot = gl.load(page_slot + pid).to(gl.int64) * HKV + h
                m_new, l_pg, acc = fp8_page(kf_w, vf_w, kf_h, vf_h, slot * FW, slot * (2 * FW), F_KS, F_VS, q_t,
                                             m_i, acc, qk_scale, length - pg * PAGE, first - pg * PAGE,
                                             LA, LB, MMA, L3, FP8_PREFETCH)
                if not SMEM:  # the next page's nuq2 codes load after this page (no registers to spare beside it)
                    kx_n = gl.load(k_codes + page_n * WORDS + k_off, mask=(k_off < WORDS) & low_n, other=0)
                    vx_n = gl.load(v_codes + page_n * WORDS + v_off, mask=(v_off < WORDS) & low_n, other=0)
            elif SMEM:
                cur = pg % 2
                side = chan_smem.index(cur)
                scale = gl.expand_dims(side.slice(0, D).load(gl.SliceLayout(1, LB)).to(gl.float16), 1)
                mean = gl.expand_dims(side.slice(D, D).load(gl.SliceLayout(0, LA)).to(gl.float16), 0)
                q_scaled, bias = scaled_q_and_bias(q_t, scale, mean, mean_template, s0)
                nk = used_count(k_used + page)
                nv = used_count(v_used + page)
                m_new, l_pg, acc = page_tile(None, None, None, None, zero, shift_k, shift_v, q_scaled, bias, m_i, l0,
                                              acc, qk_scale, length - pg * PAGE, first - pg * PAGE, k_idx + page * SK,
                                              k_delta + page * SK, nk, SK, v_idx + page * SV, v_delta + page * SV,
                                              nv, SV, q_ptr, head0, G, CHUNK0, LA, LB, MMA, k_smem.index(cur),
                                              v_smem.index(cur), slot_smem.index(cur), word_smem.index(cur), LK2, LV2)
            else:
                kx_n = gl.load(k_codes + page_n * WORDS + k_off, mask=(k_off < WORDS) & low_n, other=0)
                vx_n = gl.load(v_codes + page_n * WORDS + v_off, mask=(v_off < WORDS) & low_n, other=0)
                scale = gl.expand_dims(gl.load(k_scale + page * D + chan).to(gl.float16), 1)
                mean = gl.expand_dims(gl.load(k_mean + page * D + chan_a).to(gl.float16), 0)
                q_scaled, bias = scaled_q_and_bias(q_t, scale, mean, mean_template, s0)
                nk = used_count(k_used + page)
                nv = used_count(v_used + page)
                m_new, l_pg, acc = page_tile(kx, vx, k_tables + page * 2, v_tables + page * 2, zero, shift_k,
                                              shift_v, q_scaled, bias, m_i, l0, acc, qk_scale, length - pg * PAGE,
                                              first - pg * PAGE, k_idx + page * SK, k_delta + page * SK, nk, SK,
                                              v_idx + page * SV, v_delta + page * SV, nv, SV, q_ptr, head0, G,
                                              CHUNK0, LA, LB, MMA)
            l_i = l_i * gl.exp2(m_i - m_new) + l_pg
            m_i = m_new
            if EMIT_MASS:  # the page's probabilities relative to the running max after it, and that max
                at = (head0 + on) * max_tiles + pg
                gl.store(tile_sum + at, l_pg, mask=on < G)
                gl.store(tile_max + at, m_i, mask=on < G)
            if not SMEM:
                kx = kx_n
                vx = vx_n
            pid = pid_n
            tier = tier_n
            page = page_n
        if SMEM:
            async_copy.wait_group(0)  # the last page's copy (of a page it does not read)
    elif STAGED:
        slot = gl.load(seq_slots + b).to(gl.int64)
        base = slot * stride_ss + h * stride_sh
        m_i, l_i, acc = staged_tile(k_stage + base, v_stage + base, stride_st, q_ptr, head0, m_i, l_i, acc,
                                     qk_scale, length - quantized, first - quantized, G, LA, LB, MMA)

    store_split(part_o, part_lse, acc, m_i, l_i, head0, split, ns_total, G, MMA)
