"""The Gluon kernel of kivi2 decode attention (see kivi2_decode.py for the algebra and the reference,
kivi2_layout.py for the fragment order it reads).

One warp per program, program (b * Hkv + h, split): the split's pages of sequence b, KV head h, one
64-token page per step, in two halves of 32 tokens (one key group each). Swap-AB products on mma_v2
(m16n8k16), the group's query heads as N (padded to 8):
    S^T_h [32, 8]  = K_h [32, 128] @ (ks[h] * q)^T [128, 8] + Z_h [32, 128] @ q^T [128, 8]
    O^T_g [32, 8] += V^T_{g,h} [32, 32] @ (vs[h, g] * P_h^T) [32, 8]      (per channel group g, half h)
    W [16, 8]     += vz_h^T [4 -> 16, 32] @ P_h^T                           (the values' zeros)
K_h and V^T_{g,h} are A operands dequantized in registers: one 128-bit load per thread per 512-byte
row (the page's 4 key rows and 4 value rows); each word's 16 codes become 8 fp16 pairs of exact
integers 0..3 by the magic-number trick without shifts (_crumb_pairs: a pair is the same 2-bit slot
of the word's two 16-bit halves, so one lop3 and one fp16x2 subtraction a pair, one shift a word;
int4's needs three shifts a word for 4 pairs); a value group is one word of a lane's four. Then a
reshape/permute to the tile that moves no data (convert_layout(assert_trivial=True) checks it at compile time). The
keys' per-channel scale multiplies q (one fp16 [128, 8] B operand a half); their zeros are an MMA
whose A operand holds the half's zero row in every row (q . kz[h] per head, already in the scores'
layout, seeding the accumulator). The values' per-token scale multiplies P^T per group (fp16), their
zeros go through one [16, 32] @ P^T MMA a half, accumulated apart and added per group at the end
(common.store_groups, as int4's).
The 16-bit tail [quantized, length) (kivi2_decode.quantized_tokens: the residual ring's newest R tokens
and the staged page's older ones) is read by the launch's last ns_total - num_splits splits (STAGED),
each a contiguous share of it (common.ring_tail_tiles): 16 tokens a step, K [16, 128] and V^T [128, 16]
loaded straight into the A-operand layout from the ring or the staging.
A sliding window (`window`, a huge value for none) starts the page range at the page holding the
window's first token and masks the tokens before it. Gluon compiles for NVIDIA GPUs only.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moekv.ops.gluon.common import (
    PAGE,
    as_b_operand,
    by_group,
    program_sequence,
    q_operand,
    ring_tail_tiles,
    softmax_halves,
    split_groups,
    split_range,
    store_groups,
    store_lse,
    store_tail_partial,
)
from moekv.ops.gluon.prefetch import prefetch_four_tables

HALF = gl.constexpr(32)  # tokens of a key group: half a page
WORDS = gl.constexpr(512)  # int32 words of codes per page-head
KSIDE = gl.constexpr(256)  # fp16 key scales (or zeros) per page-head: 2 token groups x 128 channels
VSIDE = gl.constexpr(256)  # fp16 value scales (or zeros) per page-head: 64 tokens x 4 groups


@gluon.jit
def _crumb_pairs(x, e):
    """x: int32 code words broadcast over the 16 elements e of a word -> fp16 codes 0..3 (exact):
    element 2 k + i holds the code in bits 16 i + 2 k (kivi2_layout's order). Per pair one lop3
    ((w & 0x00030003 << 2k) | magic_k, magic_k = fp16 2^(10 - 2k) in both halves: the code's bits land
    in the mantissa where their unit is 1) and one fp16x2 subtraction of magic_k; pairs 5..7 from the
    word shifted by 10 (one shift a word)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, s, k0, k1, k2, k3, k4, m0, m1, m2, m3, m4;
        mov.b32 k0, 0x00030003;
        mov.b32 k1, 0x000c000c;
        mov.b32 k2, 0x00300030;
        mov.b32 k3, 0x00c000c0;
        mov.b32 k4, 0x03000300;
        mov.b32 m0, 0x64006400;
        mov.b32 m1, 0x5c005c00;
        mov.b32 m2, 0x54005400;
        mov.b32 m3, 0x4c004c00;
        mov.b32 m4, 0x44004400;
        lop3.b32 t, $8, k0, m0, 0xea;
        sub.f16x2 $0, t, m0;
        lop3.b32 t, $8, k1, m1, 0xea;
        sub.f16x2 $1, t, m1;
        lop3.b32 t, $8, k2, m2, 0xea;
        sub.f16x2 $2, t, m2;
        lop3.b32 t, $8, k3, m3, 0xea;
        sub.f16x2 $3, t, m3;
        lop3.b32 t, $8, k4, m4, 0xea;
        sub.f16x2 $4, t, m4;
        shr.u32 s, $8, 10;
        lop3.b32 t, s, k0, m0, 0xea;
        sub.f16x2 $5, t, m0;
        lop3.b32 t, s, k1, m1, 0xea;
        sub.f16x2 $6, t, m1;
        lop3.b32 t, s, k2, m2, 0xea;
        sub.f16x2 $7, t, m2;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,"
                    "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[x, e], dtype=gl.float16, is_pure=True, pack=16)


@gluon.jit
def _key_half(kx, e16, LA: gl.constexpr):
    """A half's two rows of key words [2, 128] -> its codes K_h [32 tokens, 128 channels] (fp16) in
    the A-operand layout."""
    kf = _crumb_pairs(gl.expand_dims(kx, 2), e16)  # [2, 128, 16]
    kf = gl.reshape(kf, [2, 8, 4, 2, 2, 2, 2, 2, 2])  # blk, g, q4, f1, f0, y3, y2, y1, y0
    kf = gl.permute(kf, [0, 7, 1, 3, 4, 5, 6, 2, 8])  # blk, y1, g | f1, f0, y3, y2, q4, y0
    return gl.convert_layout(gl.reshape(kf, [HALF, 128]), LA, assert_trivial=True)


@gluon.jit
def _value_tile(vx, e16, LW: gl.constexpr, LA: gl.constexpr):
    """One group's words of a half's two value rows [2, 32 lanes] -> V^T_{g,h} [32 channels, 32 tokens]
    (fp16 codes) in the A-operand layout."""
    vf = _crumb_pairs(gl.expand_dims(gl.convert_layout(vx, LW, assert_trivial=True), 2), e16)  # [2, 32, 16]
    vf = gl.reshape(vf, [2, 8, 4, 2, 2, 2, 2])  # rh, g, q4, y3, y2, y1, y0
    vf = gl.permute(vf, [0, 5, 1, 3, 4, 2, 6])  # rh, y1, g | y3, y2, q4, y0
    return gl.convert_layout(gl.reshape(vf, [HALF, HALF]), LA, assert_trivial=True)


@gluon.jit
def _key_side_row(ptr, side_off, SL: gl.constexpr):
    """A key scale (or zero) row stored in thread order (position 32 q4 + 2 i + e holds channel
    8 i + 2 q4 + e; side_off [4, 32] its positions) -> [128] by channel in SL (the MMA operands' channel
    layout): a thread's 32 channels in four 16-byte loads."""
    x = gl.permute(gl.reshape(gl.load(ptr + side_off), [4, 16, 2]), [1, 0, 2])  # i, q4, e
    return gl.convert_layout(gl.reshape(x, [128]), SL, assert_trivial=True)


@gluon.jit
def _key_side_row_smem(row, SL: gl.constexpr, LQ: gl.constexpr):
    """_key_side_row from a staged copy: `row` the half's 128 entries in shared memory."""
    x = gl.permute(gl.reshape(row.reshape([4, 32]).load(LQ), [4, 16, 2]), [1, 0, 2])  # i, q4, e
    return gl.convert_layout(gl.reshape(x, [128]), SL, assert_trivial=True)


@gluon.jit
def _half_scores(kx, e16, k_scale, k_zero, page, hf: gl.constexpr, q_t, side_off, z_template, s0,
                 LA: gl.constexpr, LB: gl.constexpr, ks_side=None, kz_side=None, row=0, LQ: gl.constexpr = None):
    """S^T_h [32, 8] = K_h @ (ks[h] * q)^T + (q . kz[h]) in every row; with ks_side and kz_side (the key
    scale and zero rows staged in shared memory, [4 (stage, half), 128] each) ks and kz come from their
    rows `row` + hf."""
    if ks_side is None:
        ks = _key_side_row(k_scale + page * KSIDE + hf * 128, side_off, gl.SliceLayout(1, LB))
        kz = _key_side_row(k_zero + page * KSIDE + hf * 128, side_off, gl.SliceLayout(0, LA))
    else:
        ks = _key_side_row_smem(ks_side.index(row + hf), gl.SliceLayout(1, LB), LQ)
        kz = _key_side_row_smem(kz_side.index(row + hf), gl.SliceLayout(0, LA), LQ)
    bias = gl.nvidia.ampere.mma_v2(gl.broadcast(gl.expand_dims(kz, 0), z_template)[0], q_t, s0)
    return gl.nvidia.ampere.mma_v2(_key_half(kx, e16, LA), q_t * gl.expand_dims(ks, 1), bias)


@gluon.jit
def _half_values(acc0, acc1, acc2, acc3, zx, vx, e16v, v_scale, v_zero, page, hf: gl.constexpr, pb,
                 rv, cv, za_r, za_t, LW: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, vs_side=None,
                 row=0, LSV: gl.constexpr = None):
    """O^T_g += V^T_{g,h} @ (vs[h, g] * P_h^T) for the 4 groups (word u of a lane = group u);
    zx += vz_h^T @ P_h^T. With vs_side (the value scales staged in shared memory), vs from its row
    `row` + hf."""
    if vs_side is None:
        sv0, sv1, sv2, sv3 = by_group(v_scale + hf * (HALF * 4), page, rv, cv, gl.SliceLayout(1, LB))
    else:
        sv0, sv1, sv2, sv3 = split_groups(vs_side.index(row + hf).reshape([HALF, 4]).load(LSV),
                                           gl.SliceLayout(1, LB))
    f0_0, f0_1 = gl.split(gl.reshape(vx, [2, 32, 2, 2]))  # word 4 lane + 2 f1 + f0
    w0, w2 = gl.split(f0_0)
    w1, w3 = gl.split(f0_1)
    acc0 = gl.nvidia.ampere.mma_v2(_value_tile(w0, e16v, LW, LA), pb * gl.expand_dims(sv0, 1), acc0)
    acc1 = gl.nvidia.ampere.mma_v2(_value_tile(w1, e16v, LW, LA), pb * gl.expand_dims(sv1, 1), acc1)
    acc2 = gl.nvidia.ampere.mma_v2(_value_tile(w2, e16v, LW, LA), pb * gl.expand_dims(sv2, 1), acc2)
    acc3 = gl.nvidia.ampere.mma_v2(_value_tile(w3, e16v, LW, LA), pb * gl.expand_dims(sv3, 1), acc3)
    # the zeros' tile [16, 32]: rows 0..3 = vz^T of the half's tokens, the rest 0
    zt = gl.load(v_zero + page * VSIDE + (hf * HALF + gl.expand_dims(za_t, 0)) * 4 + gl.expand_dims(za_r, 1),
                 mask=gl.expand_dims(za_r < 4, 1) & gl.expand_dims(za_t < HALF, 0), other=0.0)
    zx = gl.nvidia.ampere.mma_v2(zt, pb, zx)
    return acc0, acc1, acc2, acc3, zx


@gluon.jit
def _stage_side_tables(ks_side, kz_side, vs_side, stage, page, k_scale, k_zero, v_scale):
    """cp.async of page-head `page`'s key scales, key zeros and value scales (512 bytes each) into rows
    2 stage and 2 stage + 1 (its two halves) of shared memory [4, 128]: 8 bytes a lane a row (the
    caller commits the group)."""
    c = gl.arange(0, 128, layout=gl.BlockedLayout([4], [32], [1], [0]))
    for hf in gl.static_range(2):
        async_copy.async_copy_global_to_shared(ks_side.index(2 * stage + hf), k_scale + page * KSIDE + hf * 128 + c)
        async_copy.async_copy_global_to_shared(kz_side.index(2 * stage + hf), k_zero + page * KSIDE + hf * 128 + c)
        async_copy.async_copy_global_to_shared(vs_side.index(2 * stage + hf), v_scale + page * VSIDE + hf * 128 + c)


@gluon.jit
def _stage_codes(k_sm, v_sm, stage, page, k_codes, v_codes):
    """cp.async of page-head `page`'s key and value codes ([4, 128] words each) into shared-memory stage
    `stage`: 16 bytes a lane a row (the caller commits the group)."""
    CL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    off = (gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, CL)), 1) * 128
           + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, CL)), 0))
    async_copy.async_copy_global_to_shared(k_sm.index(stage), k_codes + page * WORDS + off)
    async_copy.async_copy_global_to_shared(v_sm.index(stage), v_codes + page * WORDS + off)


@gluon.jit
def kivi2_decode_kernel(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero,
                        q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                        k_stage, v_stage, stride_ss, stride_sh, stride_st,
                        k_ring, v_ring, stride_rs, stride_rh, stride_rt, R,
                        part_o, part_lse, qk_scale, window, num_splits, ns_total,
                        HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr, PREFETCH: gl.constexpr,
                        SIDE_SMEM: gl.constexpr, CODES_SMEM: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 512] (fragment order); k_scale, k_zero fp16 [N, HKV, 2, 128];
    v_scale, v_zero fp16 [N, HKV, 64, 4]; q [B, HKV * G, 128] fp16/bf16 contiguous; STAGED: tokens
    from kivi2_decode.quantized_tokens on are the 16-bit tail, read by splits num_splits .. ns_total - 1
    (a share each): k_stage /
    v_stage [S, HKV, 64, 128] and (R > 0) the rings k_ring / v_ring [S, HKV, R, 128] at slot
    seq_slots[b]; window: the sliding window (a huge value for none); part_o fp32 [B, HKV * G,
    ns_total, 128], part_lse fp32 [B, HKV * G, ns_total]; PREFETCH: the next page's side tables asked
    of L2 (2) or L1 (1) while a page computes (prefetch.py; 0: not); SIDE_SMEM: the next page's key
    scales and zeros and value scales copied into shared memory by cp.async while a page computes (two
    stages), the page reading them from there; CODES_SMEM: its codes too, instead of the register
    double buffer."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # code words [2 rows, 128 words, 16 elements (broadcast)], register order (element, word, row); a
    # group's value words [2 rows, 32 lanes, 16 elements]
    LK3: gl.constexpr = gl.BlockedLayout([2, 4, 16], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    LV3: gl.constexpr = gl.BlockedLayout([2, 1, 16], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    LK2: gl.constexpr = gl.SliceLayout(2, LK3)
    LW: gl.constexpr = gl.SliceLayout(2, LV3)
    # [32 tokens, 4 groups] value side tables, a token's 4 groups in one thread, rows as P_h^T's rows
    LSV: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [1, 0], [8, 0], [16, 0]],
                                                   [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [], [], [32, 4])

    b, h, split, length, quantized, first = program_sequence(context_lens, window, HKV, False)  # quantized = length
    if STAGED:  # the tail: the newest page (even when full) and the residual ring's R tokens
        quantized = gl.minimum(((length - 1) // PAGE) * PAGE, gl.maximum(length - R, 0))
    # no page at all when the window starts at or after `quantized` (quantized need not be a page
    # boundary here: its page would hold no valid token, and a page of nothing valid has no maximum)
    p0, p1 = split_range(gl.where(first >= quantized, quantized + PAGE - 1, first), quantized, split, num_splits,
                          PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))  # the group's query heads (the MMAs' N)
    row = (head0 + on) * ns_total + split  # [8]: their partials' rows
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    m_i = l_i - float("inf")
    if split < num_splits:
        q_t = q_operand(q_ptr, head0, G, LB).to(gl.float16)  # q^T [128, 8] fp16, padded heads zero
        # a key scale / zero row [4 q4, 32 (i, e)]: lanes 4 g + q4 read position 32 q4 .. 32 q4 + 31
        LQ: gl.constexpr = gl.BlockedLayout([1, 32], [4, 8], [1, 1], [0, 1])
        side_off = (gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, LQ)), 1) * 32
                    + gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LQ)), 0))
        kr = gl.arange(0, 2, layout=gl.SliceLayout(1, LK2))
        kw = gl.arange(0, 128, layout=gl.SliceLayout(0, LK2))
        k_off = kr[:, None] * 128 + kw[None, :]  # a half's two rows (keys blk, values rh): the same offsets
        e16 = gl.expand_dims(gl.expand_dims(
            gl.zeros([16], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, LK3))), 0), 0)  # [1, 1, 16]
        e16v = gl.expand_dims(gl.expand_dims(
            gl.zeros([16], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, LV3))), 0), 0)
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

        last = gl.maximum(p1 - 1, 0)
        page = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
        if CODES_SMEM:  # the codes double-buffered in shared memory by cp.async, a page ahead
            CODES_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stage's rank
            k_sm = gl.allocate_shared_memory(gl.int32, [2, 4, 128], CODES_L)
            v_sm = gl.allocate_shared_memory(gl.int32, [2, 4, 128], CODES_L)
            _stage_codes(k_sm, v_sm, p0 % 2, page, k_codes, v_codes)
        else:  # in registers: the next page's codes load while this page computes
            kx0 = gl.load(k_codes + page * WORDS + k_off)
            kx1 = gl.load(k_codes + page * WORDS + 256 + k_off)
            vx0 = gl.load(v_codes + page * WORDS + k_off)
            vx1 = gl.load(v_codes + page * WORDS + 256 + k_off)
        if SIDE_SMEM:  # the side tables double-buffered in shared memory by cp.async, a page ahead
            SIDE_L: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [0])
            ks_side = gl.allocate_shared_memory(gl.float16, [4, 128], SIDE_L)  # row 2 stage + half
            kz_side = gl.allocate_shared_memory(gl.float16, [4, 128], SIDE_L)
            vs_side = gl.allocate_shared_memory(gl.float16, [4, 128], SIDE_L)
            _stage_side_tables(ks_side, kz_side, vs_side, p0 % 2, page, k_scale, k_zero, v_scale)
        else:  # the side tables from global memory at each page
            ks_side = None
            kz_side = None
            vs_side = None
        if SIDE_SMEM or CODES_SMEM:
            async_copy.commit_group()
        for pg in range(p0, p1):
            page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
            if PREFETCH:
                prefetch_four_tables(page_n, k_scale, k_zero, v_scale, v_zero, KSIDE, PREFETCH)
            if SIDE_SMEM or CODES_SMEM:
                async_copy.wait_group(0)  # this page's copies (this lane's) ...
                gl.thread_barrier()  # ... and every lane's; every lane is done with the other stage
                if CODES_SMEM:
                    _stage_codes(k_sm, v_sm, (pg + 1) % 2, page_n, k_codes, v_codes)
                if SIDE_SMEM:
                    _stage_side_tables(ks_side, kz_side, vs_side, (pg + 1) % 2, page_n, k_scale, k_zero, v_scale)
                async_copy.commit_group()
            cur = (pg % 2) * 2  # this page's rows of the staged side tables (SIDE_SMEM)
            if CODES_SMEM:
                kx0 = k_sm.index(pg % 2).slice(0, 2).load(LK2)
                kx1 = k_sm.index(pg % 2).slice(2, 2).load(LK2)
                vx0 = v_sm.index(pg % 2).slice(0, 2).load(LK2)
                vx1 = v_sm.index(pg % 2).slice(2, 2).load(LK2)
            else:
                kx0_n = gl.load(k_codes + page_n * WORDS + k_off)
                kx1_n = gl.load(k_codes + page_n * WORDS + 256 + k_off)
                vx0_n = gl.load(v_codes + page_n * WORDS + k_off)
                vx1_n = gl.load(v_codes + page_n * WORDS + 256 + k_off)

            sa = _half_scores(kx0, e16, k_scale, k_zero, page, 0, q_t, side_off, z_template, s0, LA, LB,
                              ks_side, kz_side, cur, LQ)
            sb = _half_scores(kx1, e16, k_scale, k_zero, page, 1, q_t, side_off, z_template, s0, LA, LB,
                              ks_side, kz_side, cur, LQ)
            sa = sa * qk_scale
            sb = sb * qk_scale
            pos = pg * PAGE + tok
            sa = gl.where(gl.expand_dims((pos < quantized) & (pos >= first), 1), sa, -float("inf"))
            pos = pos + HALF
            sb = gl.where(gl.expand_dims((pos < quantized) & (pos >= first), 1), sb, -float("inf"))
            m_i, l_i, alpha, pa, pb_ = softmax_halves(sa, sb, m_i, l_i)  # every page holds a valid token
            a2 = gl.expand_dims(alpha, 0)
            acc0 = acc0 * a2
            acc1 = acc1 * a2
            acc2 = acc2 * a2
            acc3 = acc3 * a2
            zx = z16
            acc0, acc1, acc2, acc3, zx = _half_values(
                acc0, acc1, acc2, acc3, zx, vx0, e16v, v_scale, v_zero, page, 0,
                as_b_operand(pa.to(gl.float16), HALF, LB), rv, cv, za_r, za_t, LW, LA, LB, vs_side, cur, LSV)
            acc0, acc1, acc2, acc3, zx = _half_values(
                acc0, acc1, acc2, acc3, zx, vx1, e16v, v_scale, v_zero, page, 1,
                as_b_operand(pb_.to(gl.float16), HALF, LB), rv, cv, za_r, za_t, LW, LA, LB, vs_side, cur, LSV)
            zacc = zacc * a2 + zx
            if not CODES_SMEM:
                kx0 = kx0_n
                kx1 = kx1_n
                vx0 = vx0_n
                vx1 = vx1_n
            page = page_n
        if SIDE_SMEM or CODES_SMEM:
            async_copy.wait_group(0)  # the last page's copy (of a page it does not read)
        # the split's partial: normalised output (0 when empty; its lse after the branches)
        store_groups(part_o, acc0, acc1, acc2, acc3, zacc, l_i, row, on, G, MMA)
    elif STAGED:  # the 16-bit tail: staging page and residual ring (plain K and V^T, O^T [128, 8])
        slot = gl.load(seq_slots + b).to(gl.int64)
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        m_i, l_i, acc = ring_tail_tiles(k_stage + slot * stride_ss + h * stride_sh, v_stage + slot * stride_ss
                                    + h * stride_sh, stride_st, k_ring + slot * stride_rs + h * stride_rh,
                                    v_ring + slot * stride_rs + h * stride_rh, stride_rt, R, q_ptr, head0,
                                    m_i, l_i, acc, qk_scale, gl.maximum(quantized, first), length,
                                    split - num_splits, ns_total - num_splits, G, LA, LB, MMA)
        store_tail_partial(part_o, part_lse, acc, m_i, l_i, row, on, G, MMA)
    store_lse(part_lse, m_i, l_i, row, on, G)
