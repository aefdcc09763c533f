"""The Gluon kernel of fp8_e4m3 decode attention (see fp8_decode.py for the reference and the launcher,
fp8_layout.py for the FP8 fragment order it reads).

An FP8 page (`fp8_page`, also what tiered_kernel.py reads for tiered's FP8 pages): 4 steps of 16
tokens; per step 4 + 4 128-bit loads a thread, e4m3 -> fp16 by cvt.rn.f16x2.e4m3x2 (two codes an
instruction, exact) straight into the K [16, 128] and V^T [128, 16] A operands, S^T = K @ q^T scaled
per token by the key row scales, online softmax, and O^T += (V^T @ (P^T * v_scale / v_max)) * v_max
(the value row scales on P's rows, normalised by the step's largest so fp16 P keeps its precision:
moekv/ops/decode/tiered.py does the same).
`fp8_decode_kernel`: nuq2_kernel.py's frame (one warp per program (b * Hkv + h, split), split-K
partials, the staged 16-bit tail as one more split, sliding windows) around that page; every page is
FP8, so there is no tier branch, no nuq2 tables and no mass output.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekv.ops.gluon.common import PAGE, as_b_operand, program_sequence, split_range, staged_tile, store_split

STEP_WORDS = gl.constexpr(512)  # int32 words of FP8 codes per 16-token step (4 rows of 512 bytes)


@gluon.jit
def _e4m3_quads(x, like):
    """x [4, 128, 1]: int32 words of 4 e4m3 codes, broadcast to like's shape [4, 128, 4] (4 consecutive
    register elements: one word) -> the 4 codes as fp16, byte k of the word in element k (exact)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r,r,r,r", args=[gl.broadcast(x, like)[0]], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _fp8_step(kx, vx, like, t, k_scale, v_scale, q_t, m_i, l_pg, acc, qk_scale, n_valid, n_first,
              LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """16 tokens t of an FP8 page: codes kx, vx int32 [4, 128, 1] (a step's 4 rows of the FP8 fragment
    order), row scales [16] -> (m, l_pg, acc) after them (online softmax, tokens [n_first, n_valid))."""
    # K [16, 128]: [4 rows, 128 words, 4 bytes] = (f1 f0, g q4 y3 y2, y1 y0) -> (y1 g | f1 f0 y3 y2 q4 y0)
    kf = gl.reshape(_e4m3_quads(kx, like), [2, 2, 8, 4, 2, 2, 2, 2])
    kf = gl.permute(kf, [6, 2, 0, 1, 4, 5, 3, 7])
    ka = gl.convert_layout(gl.reshape(kf, [16, 128]), LA, assert_trivial=True)
    s = gl.nvidia.ampere.mma_v2(ka, q_t, gl.zeros([16, 8], gl.float32, layout=MMA))  # S^T [16, 8]
    s = s * gl.expand_dims(k_scale * qk_scale, 1)
    valid = gl.expand_dims((t < n_valid) & (t >= n_first), 1)
    s = gl.where(valid, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_pg = l_pg * alpha + gl.sum(p, axis=0)
    v_max = gl.maximum(gl.max(v_scale, axis=0), 1e-30)
    pb = as_b_operand((p * gl.expand_dims(v_scale / v_max, 1)).to(gl.float16), 16, LB)
    # V^T [128, 16]: (f1 f0, g q4 y3 y2, y1 y0) -> (f1 f0 y3 y1 g | y2 q4 y0)
    vf = gl.reshape(_e4m3_quads(vx, like), [2, 2, 8, 4, 2, 2, 2, 2])
    vf = gl.permute(vf, [0, 1, 4, 6, 2, 5, 3, 7])
    va = gl.convert_layout(gl.reshape(vf, [128, 16]), LA, assert_trivial=True)
    acc = acc * gl.expand_dims(alpha, 0) + gl.nvidia.ampere.mma_v2(va, pb, gl.zeros([128, 8], gl.float32,
                                                                                     layout=MMA)) * v_max
    return m_new, l_pg, acc


@gluon.jit
def fp8_page(kf_w, vf_w, kf_h, vf_h, word0, half0, F_KS: gl.constexpr, F_VS: gl.constexpr, q_t, m_i, acc,
              qk_scale, n_valid, n_first, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr,
              L3: gl.constexpr, FP8_PREFETCH: gl.constexpr):
    """One FP8 page (codes in FP8 fragment order at word0 of the int32 views, row scales at half0 +
    F_KS / F_VS of the fp16 views), tokens [n_first, n_valid) counted, 16 a step (steps without one
    skipped) -> (m, the page's probabilities relative to m, acc). FP8_PREFETCH: the next step's codes
    load while this step computes (register double buffering: loop-carried, so ptxas cannot sink the
    loads to their use, as it does without, below the key half), at 32 more registers."""
    rr = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    ww = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    off = rr[:, None] * 128 + ww[None, :]  # [4, 128]: row r at word 128 r (2-D: the words' order vectorizes)
    like = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))), 0), 0)
    tok = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    l_pg = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    lo = gl.maximum(n_first, 0) // 16
    hi = gl.minimum((n_valid + 15) // 16, 4)  # steps [lo, hi) hold a counted token (the page holds one)
    if FP8_PREFETCH:
        kx = gl.load(kf_w + word0 + lo * STEP_WORDS + off)
        vx = gl.load(vf_w + word0 + lo * STEP_WORDS + off)
        for i in range(lo, hi):
            more = (off < STEP_WORDS) & (i + 1 < hi)
            kx_n = gl.load(kf_w + word0 + (i + 1) * STEP_WORDS + off, mask=more, other=0)
            vx_n = gl.load(vf_w + word0 + (i + 1) * STEP_WORDS + off, mask=more, other=0)
            t = i * 16 + tok
            k_scale = gl.load(kf_h + half0 + F_KS // 2 + t).to(gl.float32)
            v_scale = gl.load(vf_h + half0 + F_VS // 2 + t).to(gl.float32)
            m_i, l_pg, acc = _fp8_step(gl.expand_dims(kx, 2), gl.expand_dims(vx, 2), like, t, k_scale, v_scale,
                                       q_t, m_i, l_pg, acc, qk_scale, n_valid, n_first, LA, LB, MMA)
            kx = kx_n
            vx = vx_n
    else:
        for i in range(lo, hi):
            kx = gl.expand_dims(gl.load(kf_w + word0 + i * STEP_WORDS + off), 2)  # [4, 128, 1]
            vx = gl.expand_dims(gl.load(vf_w + word0 + i * STEP_WORDS + off), 2)
            t = i * 16 + tok
            k_scale = gl.load(kf_h + half0 + F_KS // 2 + t).to(gl.float32)
            v_scale = gl.load(vf_h + half0 + F_VS // 2 + t).to(gl.float32)
            m_i, l_pg, acc = _fp8_step(kx, vx, like, t, k_scale, v_scale, q_t, m_i, l_pg, acc, qk_scale, n_valid,
                                       n_first, LA, LB, MMA)
    return m_i, l_pg, acc


@gluon.jit
def fp8_decode_kernel(kf_w, vf_w, kf_h, vf_h, q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                      k_stage, v_stage, stride_ss, stride_sh, stride_st, part_o, part_lse, qk_scale, window,
                      num_splits, ns_total, HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr,
                      FW: gl.constexpr, F_KS: gl.constexpr, F_VS: gl.constexpr, FP8_PREFETCH: gl.constexpr):
    """kf_w, vf_w int32 and kf_h, vf_h fp16 views of the pools [N, HKV, slab] (FW int32 words a slab,
    codes in FP8 fragment order, row scales at byte offsets F_KS / F_VS); q [B, HKV * G, 128];
    block_tables, context_lens, staging and partials as nuq2_decode_kernel's (STAGED: the newest page,
    even when full, is in staging)."""
    D: gl.constexpr = 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # FP8 code tiles [4 rows, 128 words, 4 bytes (broadcast)], register order (byte, word, row)
    L3: gl.constexpr = gl.BlockedLayout([4, 4, 4], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])

    b, h, split, length, quantized, first = program_sequence(context_lens, window, HKV, STAGED)
    p0, p1 = split_range(first, quantized, split, num_splits, PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)

    if split < num_splits:
        qd = gl.arange(0, D, layout=gl.SliceLayout(1, QL))
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
        q_t = gl.load(q_ptr + (head0 + qn[None, :]) * D + qd[:, None],
                      mask=(qn[None, :] < G) & (qd[:, None] < D), other=0.0).to(gl.float32)
        q_t = gl.convert_layout(q_t.to(gl.float16), LB)
        for pg in range(p0, p1):
            slab = gl.load(bt_row + pg).to(gl.int64) * HKV + h
            m_new, l_pg, acc = fp8_page(kf_w, vf_w, kf_h, vf_h, slab * FW, slab * (2 * FW), F_KS, F_VS, q_t, m_i,
                                         acc, qk_scale, quantized - pg * PAGE, first - pg * PAGE, LA, LB, MMA, L3,
                                         FP8_PREFETCH)
            l_i = l_i * gl.exp2(m_i - m_new) + l_pg
            m_i = m_new
    elif STAGED:
        slot = gl.load(seq_slots + b).to(gl.int64)
        base = slot * stride_ss + h * stride_sh
        m_i, l_i, acc = staged_tile(k_stage + base, v_stage + base, stride_st, q_ptr, head0, m_i, l_i, acc,
                                     qk_scale, length - quantized, first - quantized, G, LA, LB, MMA)

    store_split(part_o, part_lse, acc, m_i, l_i, head0, split, ns_total, G, MMA)
