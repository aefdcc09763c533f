"""The Gluon kernel of int4 decode attention (see int4_decode.py for the algebra and the reference,
int4_layout.py for the fragment order it reads).

One warp per program, program (b * Hkv + h, split): the split's pages of sequence b, KV head h, one
64-token page per step, one group of 32 channels at a time. Swap-AB products on mma_v2 (m16n8k16),
the group's query heads as N (padded to 8):
    S^T [64, 8]    = sum_g scale_g * (K_g [64, 32] @ q_g^T [32, 8]) + sum_g zero_g * qsum_g + outliers
    O^T_g [32, 8] += V^T_g [32, 64] @ (scale_g * P^T) [64, 8]
K_g and V^T_g are A operands dequantized in registers: one 128-bit load per thread per 512-byte row
(two rows a group), each 32-bit word's 8 nibbles turned into 4 fp16 pairs of exact integers by the
magic-number trick (one lop3 for the and/or with 0x6400, one subtraction of 1024: two instructions a pair, plus
three shifts a word), and a
reshape/permute to the tile that moves no data (convert_layout(assert_trivial=True) checks it). The
keys' per-(token, group) scale and zero act on the fp32 accumulators (one FMA each per element), the
values' scale on P^T in fp16 per group; the values' zeros go through one more MMA (zero^T [4 -> 16, 64]
@ P^T, accumulated apart and added per group at the end) and the outlier channels (int4 writes code 0
there) through their q-independent deltas: keys an FMA per score, values a row of that same MMA added
to the outlier's channel (it changes from page to page). Gluon compiles for NVIDIA GPUs only.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moekv.ops.gluon.common import (
    PAGE,
    SIDE,
    as_b_operand,
    by_group,
    program_sequence,
    split_groups,
    split_range,
    staged_tile,
    store_groups,
    store_lse,
    store_tail_partial,
)
from moekv.ops.gluon.prefetch import address, lanes, opaque, prefetch, prefetch_four_tables

WORDS = gl.constexpr(1024)  # int32 words of codes per page-head


@gluon.jit
def _nibble_pairs(x, e):
    """x: int32 code words broadcast over the 8 slots e of a word -> fp16 codes 0..15 (exact), slot
    order 2k, 2k + 1 = nibbles k, k + 4 (one fp16 pair per lop3 (and 0x000f000f, or 0x6400) and sub)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m, k;
        mov.b32 m, 0x64006400;
        mov.b32 k, 0x000f000f;
        lop3.b32 t, $4, k, m, 0xea;
        sub.f16x2 $0, t, m;
        shr.u32 t, $4, 4;
        lop3.b32 t, t, k, m, 0xea;
        sub.f16x2 $1, t, m;
        shr.u32 t, $4, 8;
        lop3.b32 t, t, k, m, 0xea;
        sub.f16x2 $2, t, m;
        shr.u32 t, $4, 12;
        lop3.b32 t, t, k, m, 0xea;
        sub.f16x2 $3, t, m;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[x, e], dtype=gl.float16, is_pure=True, pack=8)


@gluon.jit
def _nibble_pairs_biased(x, e):
    """As _nibble_pairs without the subtraction: fp16 1024 + code (exact; the keys take the 1024 out
    with their zeros: 1024 * scale * qsum)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m, k;
        mov.b32 m, 0x64006400;
        mov.b32 k, 0x000f000f;
        lop3.b32 $0, $4, k, m, 0xea;
        shr.u32 t, $4, 4;
        lop3.b32 $1, t, k, m, 0xea;
        shr.u32 t, $4, 8;
        lop3.b32 $2, t, k, m, 0xea;
        shr.u32 t, $4, 12;
        lop3.b32 $3, t, k, m, 0xea;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[x, e], dtype=gl.float16, is_pure=True, pack=8)


@gluon.jit
def _key_tile(x, e3, LA: gl.constexpr):
    """A group's two rows of key words [2, 128] -> 1024 + K_g [64 tokens, 32 channels] (codes) in the
    A-operand layout."""
    f = _nibble_pairs_biased(gl.expand_dims(x, 2), e3)  # [2, 128, 8]: i0, word = 4 lane + u, slot e
    f = gl.reshape(f, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # i0, l4, l3, l2, l1, l0, u1, u0, e2, e1, e0
    f = gl.permute(f, [0, 6, 9, 1, 2, 3, 7, 8, 4, 5, 10])  # i0, u1, e1, l4, l3, l2 | u0, e2, l1, l0, e0
    return gl.convert_layout(gl.reshape(f, [PAGE, 32]), LA, assert_trivial=True)


@gluon.jit
def _value_tile(x, e3, LA: gl.constexpr):
    """A group's two rows of value words [2, 128] -> V^T_g [32 channels, 64 tokens] in the A-operand layout."""
    f = _nibble_pairs(gl.expand_dims(x, 2), e3)
    f = gl.reshape(f, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # i0, l4, l3, l2, l1, l0, u1, u0, e2, e1, e0
    f = gl.permute(f, [0, 9, 1, 2, 3, 6, 7, 8, 4, 5, 10])  # i0, e1, l4, l3, l2 | u1, u0, e2, l1, l0, e0
    return gl.convert_layout(gl.reshape(f, [32, PAGE]), LA, assert_trivial=True)


@gluon.jit
def _staged_groups(table, stage, L: gl.constexpr, SL: gl.constexpr):
    """by_group from a staged copy: stage `stage` of a [2, 256] table in shared memory (a flat [64, 4]),
    read in layout L."""
    return split_groups(table.index(stage).reshape([PAGE, 4]).load(L), SL)


@gluon.jit
def _group_words(codes, page, g: gl.constexpr, off, stage, L2: gl.constexpr):
    """Group g's two rows of a page-head's code words [2, 128] in L2 (off: their offsets): from global
    memory, or (stage: the page's [8, 128] words in shared memory) from there."""
    if stage is None:
        x = gl.load(codes + page * WORDS + g * 256 + off)
    else:
        x = stage.slice(2 * g, 2).load(L2)
    return x


@gluon.jit
def _group_scores(s, kx, e3, qb, qs, sk, zk, LA: gl.constexpr, MMA: gl.constexpr):
    """s += scale_g * (K_g @ q_g^T) + zero_g * qsum_g (kx: the group's code words), from the biased
    codes: (1024 + K_g) @ q_g^T is exact products summed in fp32, and scale_g * 1024 * qsum_g leaves with
    the zeros' term."""
    ka = _key_tile(kx, e3, LA)
    part = gl.nvidia.ampere.mma_v2(ka, qb, gl.zeros([PAGE, 8], gl.float32, layout=MMA))
    sk = sk.to(gl.float32)
    zk = zk.to(gl.float32) - 1024.0 * sk
    return s + part * gl.expand_dims(sk, 1) + gl.expand_dims(zk, 1) * gl.expand_dims(qs, 0)


@gluon.jit
def _group_values(acc, vx, e3, pb, sv, LA: gl.constexpr):
    """O^T_g += V^T_g @ (scale_g * P^T) (vx: the group's code words)."""
    va = _value_tile(vx, e3, LA)
    return gl.nvidia.ampere.mma_v2(va, pb * gl.expand_dims(sv, 1), acc)


@gluon.jit
def _q_group(q_ptr, head0, g: gl.constexpr, G: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """q_g^T [32, 8] as the fp16 B operand, and qsum_g [8] (fp32, the scores' column layout)."""
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])
    qk = gl.arange(0, 32, layout=gl.SliceLayout(1, QL))
    qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
    q_t = gl.load(q_ptr + (head0 + qn[None, :]) * 128 + g * 32 + qk[:, None],
                  mask=(qn[None, :] < G) & (qk[:, None] < 32), other=0.0).to(gl.float16)
    qs = gl.convert_layout(gl.sum(q_t.to(gl.float32), axis=0), gl.SliceLayout(0, MMA))  # of what the MMA sums
    return gl.convert_layout(q_t, LB), qs


@gluon.jit
def _add_at_channel(acc, g: gl.constexpr, chan, c_o, x_o):
    """acc (O^T_g [32, 8]) += x_o [8] at row c_o - 32 g when the channel c_o is in group g."""
    hit = gl.expand_dims(chan + g * 32 == c_o, 1)
    return acc + gl.where(hit, gl.expand_dims(x_o, 0), 0.0)


@gluon.jit
def _prefetch_page(page, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, k_odelta, v_odelta, NO: gl.constexpr,
                   LEVEL: gl.constexpr):
    """Asks for page-head `page` (prefetch.py): its 4 kB of key and of value codes, a 128-byte line a
    lane; its four 512-byte side tables, 8 lanes a table; its outlier deltas (at most 1 kB a kind), 16
    lanes a kind (opaque lanes: the addresses are rebuilt where they are used)."""
    ln = opaque(lanes())
    prefetch(k_codes + page * WORDS + ln * 32, LEVEL)
    prefetch(v_codes + page * WORDS + ln * 32, LEVEL)
    prefetch_four_tables(page, k_scale, k_zero, v_scale, v_zero, SIDE, LEVEL)
    if NO > 0:
        prefetch(gl.where(ln < 16, k_odelta, v_odelta) + page * (PAGE * NO) + (ln % 16) * 16, LEVEL)


@gluon.jit
def _prefetch_unstaged(page, v_zero, k_oidx, k_odelta, v_oidx, v_odelta, NO: gl.constexpr, LEVEL: gl.constexpr):
    """Asks for what SMEM does not stage of page-head `page`: its value zeros (512 bytes), outlier
    deltas (256 NO bytes a kind) and outlier channels, 8 lanes a table, a line a lane (lanes past a
    table's end ask again for its first lines)."""
    ln = opaque(lanes())
    base = gl.where(ln < 8, address(v_zero) + page * (SIDE * 2), gl.where(
        ln < 16, address(k_odelta) + page * (PAGE * NO * 4), gl.where(
            ln < 24, address(v_odelta) + page * (PAGE * NO * 4), gl.where(
                ln % 2 == 0, address(k_oidx) + page * (NO * 4), address(v_oidx) + page * (NO * 4)))))
    span = gl.where(ln < 8, SIDE * 2, gl.where(ln < 24, PAGE * NO * 4, 128))
    prefetch(base + (ln % 8) * 128 % span, LEVEL)


@gluon.jit
def _stage_page(k_sm, v_sm, ks_sm, kz_sm, vs_sm, stage, page, k_codes, v_codes, k_scale, k_zero, v_scale):
    """cp.async of page-head `page`'s key and value codes ([8, 128] words each) and its key scales, key
    zeros and value scales ([64, 4] fp16 each, flat) into shared-memory stage `stage`: 16 bytes a lane a
    copy, one commit group."""
    CL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    off = (gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, CL)), 1) * 128
           + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, CL)), 0))
    async_copy.async_copy_global_to_shared(k_sm.index(stage), k_codes + page * WORDS + off)
    async_copy.async_copy_global_to_shared(v_sm.index(stage), v_codes + page * WORDS + off)
    toff = gl.arange(0, SIDE, layout=gl.BlockedLayout([8], [32], [1], [0]))  # a table flat: 16 bytes a lane
    async_copy.async_copy_global_to_shared(ks_sm.index(stage), k_scale + page * SIDE + toff)
    async_copy.async_copy_global_to_shared(kz_sm.index(stage), k_zero + page * SIDE + toff)
    async_copy.async_copy_global_to_shared(vs_sm.index(stage), v_scale + page * SIDE + toff)
    async_copy.commit_group()


@gluon.jit
def int4_decode_kernel(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, k_oidx, k_odelta, v_oidx, v_odelta,
                       q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                       k_stage, v_stage, stride_ss, stride_sh, stride_st,
                       part_o, part_lse, qk_scale, window, num_splits, ns_total,
                       HKV: gl.constexpr, G: gl.constexpr, NO: gl.constexpr, STAGED: gl.constexpr,
                       PREFETCH: gl.constexpr, SMEM: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 1024] (fragment order); k_scale, k_zero, v_scale, v_zero fp16
    [N, HKV, 64, 4]; k_oidx, v_oidx int32 [N, HKV, NO]; k_odelta, v_odelta fp32 [N, HKV, 64, NO];
    q [B, HKV * G, 128] fp16/bf16 contiguous; STAGED: tokens from ((len - 1) // 64) * 64 on are in
    k_stage / v_stage [S, HKV, 64, 128] at slot seq_slots[b], read by split num_splits (nuq2's staged
    tile); window: the sliding window (a huge value for none); part_o fp32 [B, HKV * G, ns_total, 128],
    part_lse fp32 [B, HKV * G, ns_total]; PREFETCH: the next page's codes, side tables and outlier deltas
    asked of L2 (2) or L1 (1) while a page computes (prefetch.py; 0: not); SMEM: the next page's codes,
    key scales and zeros and value scales copied into shared memory by cp.async while a page computes
    (two stages), the page reading them from there (PREFETCH then asks only for the rest)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # code words [2 rows, 128 words, 8 slots (broadcast)]: register order slot, word, row
    L3: gl.constexpr = gl.BlockedLayout([2, 4, 8], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    # [64 tokens, 4 groups] side tables, a row's 4 groups in one thread: rows as the scores' rows (keys)
    # and as P^T's rows (values)
    LSK: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0], [16, 0], [32, 0]],
                                                   [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], [], [], [64, 4])
    LSV: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
                                                   [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [], [], [64, 4])

    b, h, split, length, quantized, first = program_sequence(context_lens, window, HKV, STAGED)
    p0, p1 = split_range(first, quantized, split, num_splits, PAGE)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (head0 + on) * ns_total + split  # [8]
    if split < num_splits:
        qb0, qs0 = _q_group(q_ptr, head0, 0, G, LB, MMA)
        qb1, qs1 = _q_group(q_ptr, head0, 1, G, LB, MMA)
        qb2, qs2 = _q_group(q_ptr, head0, 2, G, LB, MMA)
        qb3, qs3 = _q_group(q_ptr, head0, 3, G, LB, MMA)

        wr = gl.arange(0, 2, layout=gl.SliceLayout(1, L2))
        ww = gl.arange(0, 128, layout=gl.SliceLayout(0, L2))
        off = wr[:, None] * 128 + ww[None, :]
        e3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))), 0), 0)
        tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, MMA))  # scores' rows
        rk = gl.arange(0, PAGE, layout=gl.SliceLayout(1, LSK))
        ck = gl.arange(0, 4, layout=gl.SliceLayout(0, LSK))
        rv = gl.arange(0, PAGE, layout=gl.SliceLayout(1, LSV))
        cv = gl.arange(0, 4, layout=gl.SliceLayout(0, LSV))
        chan = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
        zrow = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        za_r = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))  # the side tile's rows: 0..3 zeros, 4.. outliers
        za_t = gl.arange(0, PAGE, layout=gl.SliceLayout(0, LA))

        acc0 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc1 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc2 = gl.zeros([32, 8], gl.float32, layout=MMA)
        acc3 = gl.zeros([32, 8], gl.float32, layout=MMA)
        zacc = gl.zeros([16, 8], gl.float32, layout=MMA)  # rows 0..3: sum_t zero[t, g] P[t, n]

        last = gl.maximum(p1 - 1, 0)
        page_n = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
        if SMEM:  # codes and three side tables double-buffered in shared memory by cp.async, a page ahead
            NOSWIZZLE: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stage's rank
            k_sm = gl.allocate_shared_memory(gl.int32, [2, 8, 128], NOSWIZZLE)
            v_sm = gl.allocate_shared_memory(gl.int32, [2, 8, 128], NOSWIZZLE)
            FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            ks_sm = gl.allocate_shared_memory(gl.float16, [2, SIDE], FLAT)  # [64, 4] tables, flat
            kz_sm = gl.allocate_shared_memory(gl.float16, [2, SIDE], FLAT)
            vs_sm = gl.allocate_shared_memory(gl.float16, [2, SIDE], FLAT)
            _stage_page(k_sm, v_sm, ks_sm, kz_sm, vs_sm, p0 % 2, page_n, k_codes, v_codes, k_scale, k_zero, v_scale)
        for pg in range(p0, p1):
            page = page_n
            page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
            if SMEM:
                async_copy.wait_group(0)  # this page's copies (this lane's) ...
                gl.thread_barrier()  # ... and every lane's; every lane is done with the other stage
                _stage_page(k_sm, v_sm, ks_sm, kz_sm, vs_sm, (pg + 1) % 2, page_n, k_codes, v_codes, k_scale,
                            k_zero, v_scale)
                if PREFETCH:
                    _prefetch_unstaged(page_n, v_zero, k_oidx, k_odelta, v_oidx, v_odelta, NO, PREFETCH)
                ks = k_sm.index(pg % 2)
                vs = v_sm.index(pg % 2)
                sk0, sk1, sk2, sk3 = _staged_groups(ks_sm, pg % 2, LSK, gl.SliceLayout(1, MMA))
                zk0, zk1, zk2, zk3 = _staged_groups(kz_sm, pg % 2, LSK, gl.SliceLayout(1, MMA))
            else:  # from global memory (ks, vs: no staged codes)
                ks = None
                vs = None
                if PREFETCH:
                    _prefetch_page(page_n, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, k_odelta, v_odelta,
                                   NO, PREFETCH)
                sk0, sk1, sk2, sk3 = by_group(k_scale, page, rk, ck, gl.SliceLayout(1, MMA))
                zk0, zk1, zk2, zk3 = by_group(k_zero, page, rk, ck, gl.SliceLayout(1, MMA))
            s = gl.zeros([PAGE, 8], gl.float32, layout=MMA)
            s = _group_scores(s, _group_words(k_codes, page, 0, off, ks, L2), e3, qb0, qs0, sk0, zk0, LA,
                              MMA)
            s = _group_scores(s, _group_words(k_codes, page, 1, off, ks, L2), e3, qb1, qs1, sk1, zk1, LA,
                              MMA)
            s = _group_scores(s, _group_words(k_codes, page, 2, off, ks, L2), e3, qb2, qs2, sk2, zk2, LA,
                              MMA)
            s = _group_scores(s, _group_words(k_codes, page, 3, off, ks, L2), e3, qb3, qs3, sk3, zk3, LA,
                              MMA)
            for o in gl.static_range(NO):  # outlier channels: delta_k[t] * q[n, c_o]
                c_o = gl.load(k_oidx + page * NO + o)
                q_o = gl.load(q_ptr + (head0 + on) * 128 + c_o, mask=on < G, other=0.0).to(gl.float32)
                d_k = gl.load(k_odelta + page * (PAGE * NO) + tok * NO + o)
                s = s + gl.expand_dims(d_k, 1) * gl.expand_dims(q_o, 0)

            s = s * qk_scale
            pos = pg * PAGE + tok
            s = gl.where(gl.expand_dims((pos < length) & (pos >= first), 1), s, -float("inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 0))
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            a2 = gl.expand_dims(alpha, 0)
            pb = as_b_operand(p.to(gl.float16), PAGE, LB)

            if SMEM:
                sv0, sv1, sv2, sv3 = _staged_groups(vs_sm, pg % 2, LSV, gl.SliceLayout(1, LB))
            else:
                sv0, sv1, sv2, sv3 = by_group(v_scale, page, rv, cv, gl.SliceLayout(1, LB))
            acc0 = _group_values(acc0 * a2, _group_words(v_codes, page, 0, off, vs, L2), e3, pb, sv0, LA)
            acc1 = _group_values(acc1 * a2, _group_words(v_codes, page, 1, off, vs, L2), e3, pb, sv1, LA)
            acc2 = _group_values(acc2 * a2, _group_words(v_codes, page, 2, off, vs, L2), e3, pb, sv2, LA)
            acc3 = _group_values(acc3 * a2, _group_words(v_codes, page, 3, off, vs, L2), e3, pb, sv3, LA)

            # the side tile [16, 64]: rows 0..3 the values' zeros (zero^T), rows 4..4+NO the outliers' deltas
            zt = gl.load(v_zero + page * SIDE + gl.expand_dims(za_t, 0) * 4 + gl.expand_dims(za_r, 1),
                         mask=gl.expand_dims(za_r < 4, 1) & gl.expand_dims(za_t < PAGE, 0), other=0.0)
            dt = gl.load(v_odelta + page * (PAGE * NO) + gl.expand_dims(za_t, 0) * NO + gl.expand_dims(za_r - 4, 1),
                         mask=gl.expand_dims((za_r >= 4) & (za_r < 4 + NO), 1) & gl.expand_dims(za_t < PAGE, 0),
                         other=0.0).to(gl.float16)
            x = gl.nvidia.ampere.mma_v2(zt + dt, pb, gl.zeros([16, 8], gl.float32, layout=MMA))
            zacc = zacc * a2 + gl.where(gl.expand_dims(zrow < 4, 1), x, 0.0)
            for o in gl.static_range(NO):  # outlier channel c_o += sum_t delta_v[t] P[t, n], this page's channel
                x_o = gl.sum(gl.where(gl.expand_dims(zrow == 4 + o, 1), x, 0.0), axis=0)
                c_o = gl.load(v_oidx + page * NO + o)
                acc0 = _add_at_channel(acc0, 0, chan, c_o, x_o)
                acc1 = _add_at_channel(acc1, 1, chan, c_o, x_o)
                acc2 = _add_at_channel(acc2, 2, chan, c_o, x_o)
                acc3 = _add_at_channel(acc3, 3, chan, c_o, x_o)
        if SMEM:
            async_copy.wait_group(0)  # the last page's copy (of a page it does not read)
        # the split's partial: normalised output (0 when empty; its lse after the branches)
        store_groups(part_o, acc0, acc1, acc2, acc3, zacc, l_i, row, on, G, MMA)
    elif STAGED:  # the 16-bit tail: nuq2's staged tile (plain K and V^T, O^T [128, 8])
        slot = gl.load(seq_slots + b).to(gl.int64)
        base = slot * stride_ss + h * stride_sh
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        m_i, l_i, acc = staged_tile(k_stage + base, v_stage + base, stride_st, q_ptr, head0, m_i, l_i, acc,
                                     qk_scale, length - quantized, first - quantized, G, LA, LB, MMA)
        store_tail_partial(part_o, part_lse, acc, m_i, l_i, row, on, G, MMA)
    store_lse(part_lse, m_i, l_i, row, on, G)
