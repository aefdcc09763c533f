"""The Gluon kernel of fp8_e4m3 decode attention (see fp8_decode.py for the reference and the launcher,
fp8_layout.py for the FP8 fragment order it reads).

nuq2_kernel.py's frame (one warp per program (b * Hkv + h, split), split-K partials, the staged 16-bit
tail as one more split, sliding windows) around tiered_kernel._fp8_page, the FP8 page tiered's kernel
reads: 4 steps of 16 tokens, e4m3 codes converted in registers (two an instruction, exact) into the
K [16, 128] and V^T [128, 16] A operands, the key row scales on the scores, the value row scales on
P's rows. Every page is FP8, so there is no tier branch, no nuq2 tables and no mass output.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekv.ops.gluon.nuq2_kernel import PAGE, _sequence, _split_range, _staged_tile
from moekv.ops.gluon.tiered_kernel import _fp8_page


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

    b, h, split, length, quantized, first = _sequence(context_lens, window, HKV, STAGED)
    p0, p1 = _split_range(first, quantized, split, num_splits, PAGE)
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
        for pg in range(p0, p1):
            slab = gl.load(bt_row + pg).to(gl.int64) * HKV + h
            m_new, l_pg, acc = _fp8_page(kf_w, vf_w, kf_h, vf_h, slab * FW, slab * (2 * FW), F_KS, F_VS, q_t, m_i,
                                         acc, qk_scale, quantized - pg * PAGE, first - pg * PAGE, LA, LB, MMA, L3,
                                         FP8_PREFETCH)
            l_i = l_i * gl.exp2(m_i - m_new) + l_pg
            m_i = m_new
    elif STAGED:
        slot = gl.load(seq_slots + b).to(gl.int64)
        base = slot * stride_ss + h * stride_sh
        m_i, l_i, acc = _staged_tile(k_stage + base, v_stage + base, stride_st, q_ptr, head0, m_i, l_i, acc,
                                     qk_scale, length - quantized, first - quantized, G, LA, LB, MMA)

    nonempty = l_i > 0
    l_safe = gl.where(nonempty, l_i, 1.0)
    o = acc / gl.expand_dims(l_safe, 0)
    lse = gl.where(nonempty, m_i + gl.log2(l_safe), -float("inf"))
    od = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    row = (head0 + on) * ns_total + split
    gl.store(part_o + gl.expand_dims(row, 0) * D + gl.expand_dims(od, 1), o,
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(od < D, 1))
    gl.store(part_lse + row, lse, mask=on < G)
