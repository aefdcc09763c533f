"""The Gluon kernel of vq decode attention (see vq_decode.py for the algebra and the reference,
vq_layout.py for the fragment order and the channel permutations it reads).

One warp per program, program (b * Hkv + h, split): the split's pages of sequence b, KV head h, one
64-token page per step, in two halves of 32 tokens. Swap-AB products on mma_v2 (m16n8k16), the group's
query heads as N (padded to 8), channels in the layout's permuted orders:
    S^T_h [32, 8]  = tok_scale_h * (U_h [32, 128] @ (q * chan_scale)^T [128, 8]) + q . mean
    O^T [128, 8]  += U^T_{v,h} [128, 32] @ (tok_scale_v,h * P_h^T) [32, 8]
U_h and U^T_{v,h} are A operands gathered from the head's codebooks (global memory, L1/L2 resident: 32
kB a kind and head, e4m3): each code is one 8-byte load of its 8-channel codeword, widened to fp16 in
the registers that hold it (the permutations make a lane's columns whole codewords); codes arrive in one
128-bit load per lane per half page, a byte each. Then a reshape/permute to the tile and a layout
conversion that moves registers within each thread only (keys: whole fp16 pairs; values: a pair is
two tokens, so halves of two codewords). The keys' per-channel scale multiplies q once per program;
their per-page mean enters as q . mean per head, an MMA whose A operand holds the mean in every row.
The 16-bit tail (the newest page, staged) is one more split of the same launch (STAGED), as nuq2's;
with a residual window (RING) the launch's last ns_total - num_splits splits read the ring's newest R
tokens, each a contiguous share (common.ring_tail_tiles), and the pages end where the ring begins.
A sliding window starts the page range at the page holding the window's first token and masks the
tokens before it. Gluon compiles for NVIDIA GPUs only.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekv.ops.gluon.common import (
    PAGE,
    as_b_operand,
    program_sequence,
    ring_tail_tiles,
    softmax_halves,
    split_range,
    staged_tile,
    store_lse,
)

HALF = gl.constexpr(32)
WORDS = gl.constexpr(256)  # int32 words of codes per page-head and kind
BOOK = gl.constexpr(16 * 256 * 8)  # e4m3 codebook entries (bytes) per kv head and kind


@gluon.jit
def _half_codes(words, sh, LC: gl.constexpr):
    """A half page's code words [32 lanes, 4 words] -> its 16 codes a lane [16 R, 32 lanes] (R = 4 word +
    byte: the fragment order's byte 16 h + R of the lane's 32) in LC."""
    codes = (gl.expand_dims(words, 2) >> sh) & 255  # [32, 4, 4]
    codes = gl.reshape(gl.permute(codes, [1, 2, 0]), [16, 32])
    return gl.convert_layout(codes, LC, assert_trivial=True)


@gluon.jit
def _gather(book, codes, group, pos):
    """Codewords [16, 32, 8] fp16: row `codes` of each code's group (book: the head's e4m3 codebook)."""
    row = (group * 256 + codes) * 8
    return gl.load(book + gl.expand_dims(row, 2) + pos).to(gl.float16)


@gluon.jit
def _key_half(book, words, sh, group, pos, LC: gl.constexpr, LA: gl.constexpr):
    """U_h [32 tokens, 128 columns] (the codewords of a half page's keys) in the A-operand layout."""
    u = _gather(book, _half_codes(words, sh, LC), group, pos)  # [16 R, 32 L, 8]
    u = gl.reshape(u, [2, 2, 4, 8, 4, 2, 2, 2])  # mt, i, m | g, q4 | k1, hh, e
    u = gl.permute(u, [0, 1, 3, 2, 5, 6, 4, 7])  # mt, i, g | m, k1, hh, q4, e
    return gl.convert_layout(gl.reshape(u, [HALF, 128]), LA)


@gluon.jit
def _value_half(book, words, sh, group, pos, LC: gl.constexpr, LA: gl.constexpr):
    """U^T_{v,h} [128 rows, 32 tokens] (the codewords of a half page's values) in the A-operand layout."""
    u = _gather(book, _half_codes(words, sh, LC), group, pos)  # [16 R, 32 L, 8]
    u = gl.reshape(u, [2, 2, 2, 2, 8, 4, 8])  # kk, hh, e, a | g, q4 | b
    u = gl.permute(u, [6, 3, 4, 0, 1, 5, 2])  # b, a, g | kk, hh, q4, e
    return gl.convert_layout(gl.reshape(u, [128, HALF]), LA)


@gluon.jit
def _token_scale(ptr, tok, ok):
    """A half page's token scales [32] (fp32, 0 where not ok: unwritten tokens may hold anything)."""
    return gl.where(ok, gl.load(ptr + tok).to(gl.float32), 0.0)


@gluon.jit
def vq_decode_kernel(k_codes, v_codes, k_tok_scale, v_tok_scale, k_mean, k_codebook, k_chan_scale, v_codebook,
                     q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                     k_stage, v_stage, stride_ss, stride_sh, stride_st,
                     k_ring, v_ring, stride_rs, stride_rh, stride_rt, R,
                     part_o, part_lse, qk_scale, window, num_splits, ns_total, split0,
                     HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr, RING: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 256] (fragment order); k_tok_scale, v_tok_scale fp16 [N, HKV, 64];
    k_mean fp8 [N, HKV, 128] (by K column); k_codebook, v_codebook fp8 e4m3 [HKV, 16, 256, 8]; k_chan_scale
    fp32 [HKV, 128] (by channel); q [B, HKV * G, 128] fp16/bf16 contiguous; STAGED: tokens from
    ((len - 1) // 64) * 64 on are in k_stage / v_stage [S, HKV, 64, 128] at slot seq_slots[b], read by
    split num_splits; RING (with STAGED): a residual window, the newest R tokens in k_ring / v_ring [S, HKV,
    R, 128] (row t % R) at the same slots, the tail from min(((len - 1) // 64) * 64, max(len - R, 0)) on, read
    by splits num_splits .. ns_total - 1, a share each;
    part_o fp32 [B, HKV * G, ns_total, 128] (by channel), part_lse fp32 [B, HKV * G,
    ns_total]; split0: program (bh, s) runs split split0 + s (vq_smem_kernel's launches run the tail's splits alone)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # a half page's code words [32 lanes, 4 words, 4 bytes (broadcast)], bytes fastest
    LW3: gl.constexpr = gl.BlockedLayout([1, 4, 4], [32, 1, 1], [1, 1, 1], [2, 1, 0])
    LW: gl.constexpr = gl.SliceLayout(2, LW3)
    # codeword gathers [16 codes a lane, 32 lanes, 8 channels]: one 8-byte load a code
    LG: gl.constexpr = gl.BlockedLayout([16, 1, 8], [1, 32, 1], [1, 1, 1], [2, 0, 1])
    LC: gl.constexpr = gl.SliceLayout(2, LG)
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])

    b, h, split, length, quantized, first = program_sequence(context_lens, window, HKV, STAGED)
    split = split + split0
    if RING:  # the ring's tokens leave the pages (the last one read in part, its tokens masked)
        quantized = gl.minimum(quantized, gl.maximum(length - R, 0))
        # no page at all when the window starts at or after `quantized` (its page would hold no valid token)
        p0, p1 = split_range(gl.where(first >= quantized, quantized + PAGE - 1, first), quantized, split, num_splits,
                             PAGE)
    else:
        p0, p1 = split_range(first, quantized, split, num_splits, PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (head0 + on) * ns_total + split  # [8]: the partials' rows of the group's heads
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    chan_out = od  # O^T's row -> channel: the tail's rows are channels, the pages' permuted
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    m_i = l_i - float("inf")
    acc = gl.zeros([128, 8], gl.float32, layout=MMA)
    if split < num_splits:
        chan_out = 16 * (od % 8) + 8 * ((od // 8) % 2) + od // 16  # vq_layout.VALUE_CHANNEL_OF_ROW
        # q^T [128 columns, 8] and (q * chan_scale)^T in K's column order (vq_layout.KEY_CHANNEL_OF_COLUMN)
        f = gl.arange(0, 128, layout=gl.SliceLayout(1, QL))
        chan_k = 32 * ((f >> 1) & 3) + 4 * (f >> 4) + 2 * ((f >> 3) & 1) + (f & 1)
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
        q16 = gl.load(q_ptr + (head0 + gl.expand_dims(qn, 0)) * 128 + gl.expand_dims(chan_k, 1),
                      mask=gl.expand_dims(qn < G, 0) & gl.expand_dims(f < 128, 1), other=0.0).to(gl.float16)
        cs = gl.load(k_chan_scale + h * 128 + chan_k)
        q_t = gl.convert_layout(q16, LB)
        q_cs = gl.convert_layout((q16.to(gl.float32) * gl.expand_dims(cs, 1)).to(gl.float16), LB)

        lane = gl.arange(0, 32, layout=gl.SliceLayout(1, LW))
        w_off = gl.expand_dims(lane, 1) * 8 + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LW)), 0)
        sh = gl.expand_dims(gl.expand_dims(
            gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, LW3))) * 8, 0), 0)  # [1, 1, 4]
        r = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, LC)), 1)
        ln = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LC)), 0)
        k_group = 4 * (ln % 4) + r % 4  # [16, 32]: the code's group (vq_layout's order)
        v_group = 2 * (ln // 4) + r % 2
        pos = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, LG))), 0), 0)
        k_book = k_codebook + h * BOOK
        v_book = v_codebook + h * BOOK
        tok = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
        s0 = gl.zeros([HALF, 8], gl.float32, layout=MMA)
        mean_template = gl.zeros([HALF, 128], gl.float16, layout=LA)
        mean_col = gl.arange(0, 128, layout=gl.SliceLayout(0, LA))

        last = gl.maximum(p1 - 1, 0)
        page = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
        kx0 = gl.load(k_codes + page * WORDS + w_off)
        kx1 = gl.load(k_codes + page * WORDS + 4 + w_off)
        vx0 = gl.load(v_codes + page * WORDS + w_off)
        vx1 = gl.load(v_codes + page * WORDS + 4 + w_off)
        for pg in range(p0, p1):  # register double buffer: the next page's codes load while this one computes
            page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
            kx0_n = gl.load(k_codes + page_n * WORDS + w_off)
            kx1_n = gl.load(k_codes + page_n * WORDS + 4 + w_off)
            vx0_n = gl.load(v_codes + page_n * WORDS + w_off)
            vx1_n = gl.load(v_codes + page_n * WORDS + 4 + w_off)

            pos_a = pg * PAGE + tok
            pos_b = pos_a + HALF
            ok_a = (pos_a < quantized) & (pos_a >= first)
            ok_b = (pos_b < quantized) & (pos_b >= first)
            mean = gl.load(k_mean + page * 128 + mean_col).to(gl.float16)
            bias = gl.nvidia.ampere.mma_v2(gl.broadcast(gl.expand_dims(mean, 0), mean_template)[0], q_t, s0)
            sa = gl.nvidia.ampere.mma_v2(_key_half(k_book, kx0, sh, k_group, pos, LC, LA), q_cs, s0)
            sb = gl.nvidia.ampere.mma_v2(_key_half(k_book, kx1, sh, k_group, pos, LC, LA), q_cs, s0)
            ts_a = _token_scale(k_tok_scale + page * PAGE, tok, ok_a)
            ts_b = _token_scale(k_tok_scale + page * PAGE + HALF, tok, ok_b)
            sa = (sa * gl.expand_dims(ts_a, 1) + bias) * qk_scale
            sb = (sb * gl.expand_dims(ts_b, 1) + bias) * qk_scale
            sa = gl.where(gl.expand_dims(ok_a, 1), sa, -float("inf"))
            sb = gl.where(gl.expand_dims(ok_b, 1), sb, -float("inf"))
            m_i, l_i, alpha, pa, pb = softmax_halves(sa, sb, m_i, l_i)  # every page holds a valid token
            acc = acc * gl.expand_dims(alpha, 0)
            vs_a = _token_scale(v_tok_scale + page * PAGE, tok, ok_a)
            vs_b = _token_scale(v_tok_scale + page * PAGE + HALF, tok, ok_b)
            acc = gl.nvidia.ampere.mma_v2(_value_half(v_book, vx0, sh, v_group, pos, LC, LA),
                                          as_b_operand((pa * gl.expand_dims(vs_a, 1)).to(gl.float16), HALF, LB), acc)
            acc = gl.nvidia.ampere.mma_v2(_value_half(v_book, vx1, sh, v_group, pos, LC, LA),
                                          as_b_operand((pb * gl.expand_dims(vs_b, 1)).to(gl.float16), HALF, LB), acc)
            kx0 = kx0_n
            kx1 = kx1_n
            vx0 = vx0_n
            vx1 = vx1_n
            page = page_n
    elif STAGED:
        slot = gl.load(seq_slots + b).to(gl.int64)
        base = slot * stride_ss + h * stride_sh
        if RING:  # the tail: the ring's newest R tokens (and staged ones before them, for R < 64)
            m_i, l_i, acc = ring_tail_tiles(k_stage + base, v_stage + base, stride_st,
                                            k_ring + slot * stride_rs + h * stride_rh,
                                            v_ring + slot * stride_rs + h * stride_rh, stride_rt, R, q_ptr, head0,
                                            m_i, l_i, acc, qk_scale, gl.maximum(quantized, first), length,
                                            split - num_splits, ns_total - num_splits, G, LA, LB, MMA)
        else:
            m_i, l_i, acc = staged_tile(k_stage + base, v_stage + base, stride_st, q_ptr, head0, m_i, l_i, acc,
                                         qk_scale, length - quantized, first - quantized, G,
                                         gl.DotOperandLayout(0, MMA, 2), gl.DotOperandLayout(1, MMA, 2), MMA)

    # the split's partial: normalised output by channel (0 when empty) and log2 of its mass
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    gl.store(part_o + gl.expand_dims(row, 0) * 128 + gl.expand_dims(chan_out, 1), acc / gl.expand_dims(l_safe, 0),
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(od < 128, 1))
    store_lse(part_lse, m_i, l_i, row, on, G)
