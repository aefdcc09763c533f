"""The Gluon kernel of kivi2 decode attention (see kivi2_decode.py for the algebra and the reference,
kivi2_layout.py for the fragment order it reads).

One warp per program, program (b * Hkv + h, split): the split's pages of sequence b, KV head h, one
64-token page per step, in two halves of 32 tokens (one key group each). Swap-AB products on mma_v2
(m16n8k16), the group's query heads as N (padded to 8):
    S^T_h [32, 8]  = K_h [32, 128] @ (ks[h] * q)^T [128, 8] + Z_h [32, 128] @ q^T [128, 8]
    O^T_g [32, 8] += V^T_{g,h} [32, 32] @ (vs[h, g] * P_h^T) [32, 8]      (per channel group g, half h)
    W [16, 8]     += vz_h^T [4 -> 16, 32] @ P_h^T                           (the values' zeros)
K_h and V^T_{g,h} are A operands dequantized in registers: one 128-bit load per thread per 512-byte
row (the page's 4 key rows and 4 value rows), each byte's 2-bit field turned into fp16 0, 1, 2 or 3
by a prmt lookup (nuq2's _centroid_pairs with the constant table 0, 1, 2, 3), then a reshape/permute
to the tile that moves no data (convert_layout(assert_trivial=True) checks it at compile time). The
keys' per-channel scale multiplies q (one fp16 [128, 8] B operand a half); their zeros are an MMA
whose A operand holds the half's zero row in every row (q . kz[h] per head, already in the scores'
layout, seeding the accumulator). The values' per-token scale multiplies P^T per group (fp16), their
zeros go through one [16, 32] @ P^T MMA a half, accumulated apart and added per group at the end
(int4's _store_groups).
The 16-bit tail [quantized, length) (kivi2_decode.quantized_tokens: the residual ring's newest R tokens
and the staged page's older ones) is one more split of the same launch (STAGED): 16 tokens a step, K
[16, 128] and V^T [128, 16] loaded straight into the A-operand layout from the ring or the staging.
A sliding window (`window`, a huge value for none) starts the page range at the page holding the
window's first token and masks the tokens before it. Gluon compiles for NVIDIA GPUs only.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekv.ops.gluon.int4_kernel import _by_group, _store_groups
from moekv.ops.gluon.nuq2_kernel import (
    _as_b_operand,
    _centroid_pairs,
    _per_lane,
    _program,
    _q_operand,
    _softmax_step,
    _split_range,
    _store_lse,
    _store_tail_partial,
    _tail_aranges,
)

PAGE = gl.constexpr(64)
HALF = gl.constexpr(32)  # tokens of a key group: half a page
WORDS = gl.constexpr(512)  # int32 words of codes per page-head
KSIDE = gl.constexpr(256)  # fp16 key scales (or zeros) per page-head: 2 token groups x 128 channels
VSIDE = gl.constexpr(256)  # fp16 value scales (or zeros) per page-head: 64 tokens x 4 groups
CODE_LO = gl.constexpr(0x3C000000)  # the prmt table of the codes: fp16 0.0 | 1.0 << 16 ...
CODE_HI = gl.constexpr(0x42004000)  # ... and fp16 2.0 | 3.0 << 16


@gluon.jit
def _key_half(kx, shift_k, t_lo, t_hi, LA: gl.constexpr):
    """A half's two rows of key words [2, 128] -> its codes K_h [32 tokens, 128 channels] (fp16) in
    the A-operand layout."""
    kf = _centroid_pairs(gl.expand_dims(gl.expand_dims(kx, 2), 3), shift_k, t_lo, t_hi)  # [2, 128, 4, 4]
    kf = gl.reshape(kf, [2, 8, 4, 2, 2, 2, 2, 2, 2])  # blk, g, q4, y3, y2, y1, y0, f1, f0
    kf = gl.permute(kf, [0, 5, 1, 7, 8, 3, 4, 2, 6])  # blk, y1, g | f1, f0, y3, y2, q4, y0
    return gl.convert_layout(gl.reshape(kf, [HALF, 128]), LA, assert_trivial=True)


@gluon.jit
def _value_tile(vx, shift, t_lo, t_hi, LA: gl.constexpr):
    """A half's two rows of value words [2, 128] and group g's shift (2 g, [1, 1, 4]: the bytes of a
    word) -> V^T_{g,h} [32 channels, 32 tokens] (fp16 codes) in the A-operand layout."""
    vf = _centroid_pairs(gl.expand_dims(vx, 2), shift, t_lo, t_hi)  # [2, 128, 4]
    vf = gl.reshape(vf, [2, 8, 4, 2, 2, 2, 2])  # rh, g, q4, y3, y2, y1, y0
    vf = gl.permute(vf, [0, 5, 1, 3, 4, 2, 6])  # rh, y1, g | y3, y2, q4, y0
    return gl.convert_layout(gl.reshape(vf, [HALF, HALF]), LA, assert_trivial=True)


@gluon.jit
def _half_scores(kx, shift_k, t_lo, t_hi, k_scale, k_zero, page, hf: gl.constexpr, q_t, chan_b, chan_a,
                 z_template, s0, LA: gl.constexpr):
    """S^T_h [32, 8] = K_h @ (ks[h] * q)^T + (q . kz[h]) in every row."""
    ks = gl.load(k_scale + page * KSIDE + hf * 128 + chan_b)
    kz = gl.load(k_zero + page * KSIDE + hf * 128 + chan_a)
    bias = gl.nvidia.ampere.mma_v2(gl.broadcast(gl.expand_dims(kz, 0), z_template)[0], q_t, s0)
    return gl.nvidia.ampere.mma_v2(_key_half(kx, shift_k, t_lo, t_hi, LA), q_t * gl.expand_dims(ks, 1), bias)


@gluon.jit
def _half_values(acc0, acc1, acc2, acc3, zx, vx, shift_v, t_lo, t_hi, v_scale, v_zero, page, hf: gl.constexpr, pb,
                 rv, cv, za_r, za_t, LA: gl.constexpr, LB: gl.constexpr):
    """O^T_g += V^T_{g,h} @ (vs[h, g] * P_h^T) for the 4 groups; zx += vz_h^T @ P_h^T."""
    sv0, sv1, sv2, sv3 = _by_group(v_scale + hf * (HALF * 4), page, rv, cv, gl.SliceLayout(1, LB))
    acc0 = gl.nvidia.ampere.mma_v2(_value_tile(vx, shift_v, t_lo, t_hi, LA), pb * gl.expand_dims(sv0, 1), acc0)
    acc1 = gl.nvidia.ampere.mma_v2(_value_tile(vx, shift_v + 2, t_lo, t_hi, LA), pb * gl.expand_dims(sv1, 1), acc1)
    acc2 = gl.nvidia.ampere.mma_v2(_value_tile(vx, shift_v + 4, t_lo, t_hi, LA), pb * gl.expand_dims(sv2, 1), acc2)
    acc3 = gl.nvidia.ampere.mma_v2(_value_tile(vx, shift_v + 6, t_lo, t_hi, LA), pb * gl.expand_dims(sv3, 1), acc3)
    # the zeros' tile [16, 32]: rows 0..3 = vz^T of the half's tokens, the rest 0
    zt = gl.load(v_zero + page * VSIDE + (hf * HALF + gl.expand_dims(za_t, 0)) * 4 + gl.expand_dims(za_r, 1),
                 mask=gl.expand_dims(za_r < 4, 1) & gl.expand_dims(za_t < HALF, 0), other=0.0)
    zx = gl.nvidia.ampere.mma_v2(zt, pb, zx)
    return acc0, acc1, acc2, acc3, zx


@gluon.jit
def _tail_tiles(k_stage, v_stage, stride_st, k_ring, v_ring, stride_rt, R, q_ptr, head0, m_i, l_i, acc, qk_scale,
                lo, length, G: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """The 16-bit tail: tokens [lo, length), 16 a step; token t from the ring (row t % R) when t >=
    length - R, else from the staging page (row t % 64). q in its own 16-bit type (bf16 or fp16; the
    ring and staging are converted to it)."""
    DT: gl.constexpr = q_ptr.dtype.element_ty
    qb = _q_operand(q_ptr, head0, G, LB)
    tok_r, chan_c, chan_r, tok_c, tok, s0 = _tail_aranges(LA, MMA)
    ring_lo = length - R  # tokens from here on are in the ring
    r_safe = gl.maximum(R, 1)
    for t0 in range(lo, length, 16):  # every chunk's first token is valid
        tr = t0 + tok_r
        ring_r = gl.expand_dims(tr >= ring_lo, 1)  # each token from one place: one load an element
        k_src = gl.where(ring_r, k_ring + gl.expand_dims(tr % r_safe, 1) * stride_rt,
                         k_stage + gl.expand_dims(tr % PAGE, 1) * stride_st)
        k = gl.load(k_src + gl.expand_dims(chan_c, 0), mask=gl.expand_dims((tr < length) & (tr >= lo), 1),
                    other=0.0).to(DT)
        s = gl.nvidia.ampere.mma_v2(k, qb, s0)  # S^T [16, 8]
        t = t0 + tok
        valid = gl.expand_dims((t < length) & (t >= lo), 1)
        m_i, l_i, acc, pb = _softmax_step(s, valid, m_i, l_i, acc, qk_scale, DT, LB)
        tc = t0 + tok_c
        ring_c = gl.expand_dims(tc >= ring_lo, 0)
        v_src = gl.where(ring_c, v_ring + gl.expand_dims(tc % r_safe, 0) * stride_rt,
                         v_stage + gl.expand_dims(tc % PAGE, 0) * stride_st)
        vt = gl.load(v_src + gl.expand_dims(chan_r, 1), mask=gl.expand_dims((tc < length) & (tc >= lo), 0),
                     other=0.0).to(DT)
        acc = gl.nvidia.ampere.mma_v2(vt, pb, acc)
    return m_i, l_i, acc


@gluon.jit
def kivi2_decode_kernel(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero,
                        q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                        k_stage, v_stage, stride_ss, stride_sh, stride_st,
                        k_ring, v_ring, stride_rs, stride_rh, stride_rt, R,
                        part_o, part_lse, qk_scale, window, zero, num_splits, ns_total,
                        HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 512] (fragment order); k_scale, k_zero fp16 [N, HKV, 2, 128];
    v_scale, v_zero fp16 [N, HKV, 64, 4]; q [B, HKV * G, 128] fp16/bf16 contiguous; STAGED: tokens
    from kivi2_decode.quantized_tokens on are the 16-bit tail, read by split num_splits: k_stage /
    v_stage [S, HKV, 64, 128] and (R > 0) the rings k_ring / v_ring [S, HKV, R, 128] at slot
    seq_slots[b]; window: the sliding window (a huge value for none); zero: 0 (a run-time zero the
    lookup tables are kept per lane with); part_o fp32 [B, HKV * G, ns_total, 128], part_lse fp32
    [B, HKV * G, ns_total]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # code words: keys [2 rows, 128 words, 4 bytes (broadcast), 4 fields (broadcast)], register order
    # (byte, word, field, row); values [2 rows, 128 words, 4 bytes (broadcast)], order (byte, word, row)
    LK4: gl.constexpr = gl.BlockedLayout([2, 4, 4, 4], [1, 32, 1, 1], [1, 1, 1, 1], [2, 1, 3, 0])
    LV3: gl.constexpr = gl.BlockedLayout([2, 4, 4], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    LK2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LK4))
    LV2: gl.constexpr = gl.SliceLayout(2, LV3)
    # [32 tokens, 4 groups] value side tables, a token's 4 groups in one thread, rows as P_h^T's rows
    LSV: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [1, 0], [8, 0], [16, 0]],
                                                   [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [], [], [32, 4])

    bh, split = _program()
    b = bh // HKV
    h = bh % HKV
    length = gl.load(context_lens + b)
    first = gl.maximum(length - window, 0)  # the sliding window's oldest token
    quantized = length
    if STAGED:  # the tail: the newest page (even when full) and the residual ring's R tokens
        quantized = gl.minimum(((length - 1) // PAGE) * PAGE, gl.maximum(length - R, 0))
    # no page at all when the window starts at or after `quantized` (quantized need not be a page
    # boundary here: its page would hold no valid token, and a page of nothing valid has no maximum)
    p0, p1 = _split_range(gl.where(first >= quantized, quantized + PAGE - 1, first), quantized, split, num_splits,
                          PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))  # the group's query heads (the MMAs' N)
    row = (head0 + on) * ns_total + split  # [8]: their partials' rows
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    m_i = l_i - float("inf")
    if split < num_splits:
        q_t = _q_operand(q_ptr, head0, G, LB).to(gl.float16)  # q^T [128, 8] fp16, padded heads zero
        chan_b = gl.arange(0, 128, layout=gl.SliceLayout(1, LB))
        chan_a = gl.arange(0, 128, layout=gl.SliceLayout(0, LA))
        t_lo = _per_lane(zero + CODE_LO, zero)
        t_hi = _per_lane(zero + CODE_HI, zero)

        kr = gl.arange(0, 2, layout=gl.SliceLayout(1, LK2))
        kw = gl.arange(0, 128, layout=gl.SliceLayout(0, LK2))
        k_off = kr[:, None] * 128 + kw[None, :]
        vr = gl.arange(0, 2, layout=gl.SliceLayout(1, LV2))
        vw = gl.arange(0, 128, layout=gl.SliceLayout(0, LV2))
        v_off = vr[:, None] * 128 + vw[None, :]  # a half's rows (rh = 0, 1) at byte 512 (2 h + rh)
        shift_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LK4)))) * 2
        shift_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(shift_k, 0), 0), 0)
        shift_k = shift_k + gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LK4)))), 0), 0), 3)
        shift_v = gl.expand_dims(gl.expand_dims(
            gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, LV3))), 0), 0) + zero  # [1, 1, 4]
        rv = gl.arange(0, HALF, layout=gl.SliceLayout(1, LSV))
        cv = gl.arange(0, 4, layout=gl.SliceLayout(0, LSV))
        za_r = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
        za_t = gl.arange(0, HALF, layout=gl.SliceLayout(0, LA))
        tok = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
        s0 = gl.zeros([HALF, 8], gl.float32, layout=MMA)
        z16 = gl.zeros([16, 8], gl.float32, layout=MMA)
        z_template = gl.zeros([HALF, 128], gl.float16, layout=LA)

        acc0 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc1 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc2 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc3 = gl.zeros([32, 8], gl.float32, layout=MMA)
        zacc = gl.zeros([16, 8], gl.float32, layout=MMA)  # rows 0..3: sum_t vz[t, g] P[t, n]

        # register double buffering: the next page's codes load while this page computes
        last = gl.maximum(p1 - 1, 0)
        page = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
        kx0 = gl.load(k_codes + page * WORDS + k_off)
        kx1 = gl.load(k_codes + page * WORDS + 256 + k_off)
        vx0 = gl.load(v_codes + page * WORDS + v_off)
        vx1 = gl.load(v_codes + page * WORDS + 256 + v_off)
        for pg in range(p0, p1):
            page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
            kx0_n = gl.load(k_codes + page_n * WORDS + k_off)
            kx1_n = gl.load(k_codes + page_n * WORDS + 256 + k_off)
            vx0_n = gl.load(v_codes + page_n * WORDS + v_off)
            vx1_n = gl.load(v_codes + page_n * WORDS + 256 + v_off)

            sa = _half_scores(kx0, shift_k, t_lo, t_hi, k_scale, k_zero, page, 0, q_t, chan_b, chan_a, z_template,
                              s0, LA) * qk_scale
            sb = _half_scores(kx1, shift_k, t_lo, t_hi, k_scale, k_zero, page, 1, q_t, chan_b, chan_a, z_template,
                              s0, LA) * qk_scale
            pos = pg * PAGE + tok
            sa = gl.where(gl.expand_dims((pos < quantized) & (pos >= first), 1), sa, -float("inf"))
            pos = pos + HALF
            sb = gl.where(gl.expand_dims((pos < quantized) & (pos >= first), 1), sb, -float("inf"))
            m_new = gl.maximum(m_i, gl.maximum(gl.max(sa, axis=0), gl.max(sb, axis=0)))  # finite: a valid token
            alpha = gl.exp2(m_i - m_new)
            pa = gl.exp2(sa - gl.expand_dims(m_new, 0))
            pb_ = gl.exp2(sb - gl.expand_dims(m_new, 0))
            l_i = l_i * alpha + gl.sum(pa, axis=0) + gl.sum(pb_, axis=0)
            m_i = m_new
            a2 = gl.expand_dims(alpha, 0)
            acc0 = acc0 * a2
            acc1 = acc1 * a2
            acc2 = acc2 * a2
            acc3 = acc3 * a2
            zx = z16
            acc0, acc1, acc2, acc3, zx = _half_values(acc0, acc1, acc2, acc3, zx, vx0, shift_v, t_lo, t_hi, v_scale,
                                                      v_zero, page, 0, _as_b_operand(pa.to(gl.float16), HALF, LB),
                                                      rv, cv, za_r, za_t, LA, LB)
            acc0, acc1, acc2, acc3, zx = _half_values(acc0, acc1, acc2, acc3, zx, vx1, shift_v, t_lo, t_hi, v_scale,
                                                      v_zero, page, 1, _as_b_operand(pb_.to(gl.float16), HALF, LB),
                                                      rv, cv, za_r, za_t, LA, LB)
            zacc = zacc * a2 + zx
            kx0 = kx0_n
            kx1 = kx1_n
            vx0 = vx0_n
            vx1 = vx1_n
            page = page_n
        # the split's partial: normalised output (0 when empty; its lse after the branches)
        _store_groups(part_o, acc0, acc1, acc2, acc3, zacc, l_i, row, on, G, MMA)
    elif STAGED:  # the 16-bit tail: staging page and residual ring (plain K and V^T, O^T [128, 8])
        slot = gl.load(seq_slots + b).to(gl.int64)
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        m_i, l_i, acc = _tail_tiles(k_stage + slot * stride_ss + h * stride_sh, v_stage + slot * stride_ss
                                    + h * stride_sh, stride_st, k_ring + slot * stride_rs + h * stride_rh,
                                    v_ring + slot * stride_rs + h * stride_rh, stride_rt, R, q_ptr, head0,
                                    m_i, l_i, acc, qk_scale, gl.maximum(quantized, first), length, G, LA, LB, MMA)
        _store_tail_partial(part_o, part_lse, acc, m_i, l_i, row, on, G, MMA)
    _store_lse(part_lse, m_i, l_i, row, on, G)
