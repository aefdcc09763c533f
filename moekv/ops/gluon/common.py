"""What the Gluon decode kernels of several formats share (nuq2, int4, kivi2, fp8_e4m3, vq, tiered
*_kernel.py): a program's sequence and split, the online softmax, the 16-bit operand helpers, the staged
16-bit tail (and a residual window's ring beside it) and the split partials' stores, and the [64 tokens,
4 groups] side tables of int4 and kivi2.

The kernels are one warp per program, program (b * Hkv + h, split), swap-AB products on mma_v2
(m16n8k16) with the group's query heads as N (padded to 8): scores S^T [tokens, 8], output O^T
[128, 8] in the accumulator layout MMA, K and V^T tiles in LA = DotOperandLayout(0, MMA, 2), q^T and
P^T in LB = DotOperandLayout(1, MMA, 2). Gluon compiles for NVIDIA GPUs only: importing this module
needs triton.experimental.gluon.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekv.ops.gluon.tables import PAGE_TOKENS

PAGE = gl.constexpr(PAGE_TOKENS)
SIDE = gl.constexpr(256)  # fp16 entries of a page-head's [64 tokens, 4 groups] side table (scales or zeros)


@gluon.jit
def transpose_8x8(p):
    """Transpose every 8x8 16-bit block held in mma accumulator order (one 32-bit register a thread)."""
    return gl.inline_asm_elementwise(
        asm="movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        constraints="=r,r", args=[p], dtype=p.dtype, is_pure=True, pack=2)


@gluon.jit
def as_b_operand(p, ROWS_: gl.constexpr, LB: gl.constexpr):
    """A 16-bit [ROWS_, 8] tensor in the accumulator layout -> the same tensor as the B operand
    (K = ROWS_, N = 8): each 8x8 block transposed in registers, no data between threads."""
    pt = transpose_8x8(p)
    pt = gl.reshape(pt, [ROWS_ // 8, 8, 8])
    pt = gl.permute(pt, [0, 2, 1])
    pt = gl.reshape(pt, [ROWS_, 8])
    return gl.convert_layout(pt, LB, assert_trivial=True)


@gluon.jit
def softmax_step(s, valid, m_i, l_i, acc, qk_scale, DT: gl.constexpr, LB: gl.constexpr):
    """Online softmax over one tile's scores S^T [T, 8] (valid [T, 1]): new (m, l), acc rescaled, and
    P^T as the B operand in dtype DT."""
    s = s * qk_scale
    s = gl.where(valid, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_i = l_i * alpha + gl.sum(p, axis=0)
    acc = acc * gl.expand_dims(alpha, 0)
    return m_new, l_i, acc, as_b_operand(p.to(DT), s.shape[0], LB)


@gluon.jit
def softmax_halves(sa, sb, m_i, l_i, AXIS: gl.constexpr = 0, MAY_BE_EMPTY: gl.constexpr = False):
    """Online softmax over a page's two half tiles of scores (tokens along AXIS, already masked with
    -inf): (m, l, alpha, pa, pb), alpha the factor that rescales the accumulators. MAY_BE_EMPTY: the
    tiles may hold no valid token while m is still -inf (a warp past its split's pages); the exponents
    are then taken against 0, not -inf (which would make them NaN)."""
    m_new = gl.maximum(m_i, gl.maximum(gl.max(sa, axis=AXIS), gl.max(sb, axis=AXIS)))
    m_use = m_new
    if MAY_BE_EMPTY:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    pa = gl.exp2(sa - gl.expand_dims(m_use, AXIS))
    pb = gl.exp2(sb - gl.expand_dims(m_use, AXIS))
    return m_new, l_i * alpha + gl.sum(pa, axis=AXIS) + gl.sum(pb, axis=AXIS), alpha, pa, pb


@gluon.jit
def q_operand(q_ptr, head0, G: gl.constexpr, LB: gl.constexpr):
    """q^T [128, 8] of the group's G heads (padded heads zero) in q's own 16-bit type, as the B operand."""
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])
    qd = gl.arange(0, 128, layout=gl.SliceLayout(1, QL))
    qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
    q_t = gl.load(q_ptr + (head0 + qn[None, :]) * 128 + qd[:, None], mask=(qn[None, :] < G) & (qd[:, None] < 128),
                  other=0.0)
    return gl.convert_layout(q_t, LB)


@gluon.jit
def _program():
    """(b * HKV + h, split) of this program: the (sequence, KV head) index and the split."""
    return gl.program_id(0), gl.program_id(1)


@gluon.jit
def program_sequence(context_lens, window, HKV: gl.constexpr, STAGED: gl.constexpr):
    """(b, h, split, length, quantized, first) of this program: its sequence, KV head and split, the
    sequence's length, the tokens read from pages (STAGED: the newest page, even when full, is in
    staging) and the sliding window's oldest token (window: a huge value for none)."""
    bh, split = _program()
    b = bh // HKV
    h = bh % HKV
    length = gl.load(context_lens + b)
    quantized = length
    if STAGED:
        quantized = ((length - 1) // PAGE) * PAGE
    first = gl.maximum(length - window, 0)
    return b, h, split, length, quantized, first


@gluon.jit
def split_range(first, quantized, split, num_splits, PAGE_: gl.constexpr):
    """(p0, p1): split `split`'s share of the pages holding tokens [first, quantized) (first: the
    sliding window's oldest token; pages from the one holding it), cut into num_splits shares."""
    num_pages = gl.cdiv(quantized, PAGE_)
    page_lo = gl.minimum(first // PAGE_, num_pages)
    per = gl.cdiv(num_pages - page_lo, num_splits)
    p0 = gl.minimum(page_lo + split * per, num_pages)
    return p0, gl.minimum(p0 + per, num_pages)


@gluon.jit
def tail_aranges(LA: gl.constexpr, MMA: gl.constexpr):
    """The 16-bit tail's index vectors: tokens and channels of K [16, 128] and V^T [128, 16] in the
    A-operand layout, tokens of S^T [16, 8], and S^T's zero accumulator."""
    return (gl.arange(0, 16, layout=gl.SliceLayout(1, LA)), gl.arange(0, 128, layout=gl.SliceLayout(0, LA)),
            gl.arange(0, 128, layout=gl.SliceLayout(1, LA)), gl.arange(0, 16, layout=gl.SliceLayout(0, LA)),
            gl.arange(0, 16, layout=gl.SliceLayout(1, MMA)), gl.zeros([16, 8], gl.float32, layout=MMA))


@gluon.jit
def staged_tile(k_row, v_row, stride_st, q_ptr, head0, m_i, l_i, acc, qk_scale, n_valid, n_first,
                 G: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """The 16-bit tail: tokens [n_first, n_valid) of the staging page at k_row / v_row (rows
    stride_st apart), 16 tokens a step (K [16, 128] and V^T [128, 16] loaded straight into the
    A-operand layout: a whole page's would spill), q in its own 16-bit type (bf16 or fp16; the staging
    is converted to it)."""
    DT: gl.constexpr = q_ptr.dtype.element_ty
    qb = q_operand(q_ptr, head0, G, LB)
    tok_r, chan_c, chan_r, tok_c, tok, s0 = tail_aranges(LA, MMA)
    for t0 in range(gl.maximum(n_first, 0) // 16 * 16, n_valid, 16):  # no chunk wholly before the window
        tr = t0 + tok_r
        kmask = gl.expand_dims((tr < n_valid) & (tr >= n_first), 1) & gl.expand_dims(chan_c < 128, 0)
        k = gl.load(k_row + gl.expand_dims(tr, 1) * stride_st + gl.expand_dims(chan_c, 0), mask=kmask,
                    other=0.0).to(DT)
        s = gl.nvidia.ampere.mma_v2(k, qb, s0)  # S^T [16, 8]
        t = t0 + tok
        valid = gl.expand_dims((t < n_valid) & (t >= n_first), 1)
        m_i, l_i, acc, pb = softmax_step(s, valid, m_i, l_i, acc, qk_scale, DT, LB)
        tc = t0 + tok_c
        vmask = gl.expand_dims(chan_r < 128, 1) & gl.expand_dims((tc < n_valid) & (tc >= n_first), 0)
        vt = gl.load(v_row + gl.expand_dims(tc, 0) * stride_st + gl.expand_dims(chan_r, 1), mask=vmask,
                     other=0.0).to(DT)
        acc = gl.nvidia.ampere.mma_v2(vt, pb, acc)
    return m_i, l_i, acc


@gluon.jit
def tail_share(lo, length, part, parts):
    """[t0, t1): tail program `part`'s share of the 16-bit tail [lo, length), cut into `parts` contiguous
    shares of a multiple of 16 tokens (the tile's), so that no share starts a tile another one ends; the
    last shares are shorter or empty when the tail is short (launch.plan_splits picks `parts` on the host,
    before the lengths are known)."""
    per = gl.cdiv(gl.cdiv(length - lo, parts), 16) * 16
    t0 = gl.minimum(lo + part * per, length)
    return t0, gl.minimum(t0 + per, length)


@gluon.jit
def ring_tail_tiles(k_stage, v_stage, stride_st, k_ring, v_ring, stride_rt, R, q_ptr, head0, m_i, l_i, acc, qk_scale,
                    lo, length, part, parts, G: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
                    MMA: gl.constexpr):
    """The 16-bit tail with a residual ring (kivi2, nuq2, vq), read by `parts` programs of the launch:
    program `part` reads its share of tokens [lo, length) (tail_share), 16 a step; token t from the ring
    (row t % R) when t >= length - R, else from the staging page (row t % 64), each token from one place
    (one load an element). q in its own 16-bit type (bf16 or fp16; the ring and staging are converted to
    it). One program walking a whole ring of 128-256 tokens is the launch's longest at batch 1 (its
    steps are serial), hence the shares."""
    DT: gl.constexpr = q_ptr.dtype.element_ty
    qb = q_operand(q_ptr, head0, G, LB)
    tok_r, chan_c, chan_r, tok_c, tok, s0 = tail_aranges(LA, MMA)
    ring_lo = length - R  # tokens from here on are in the ring
    r_safe = gl.maximum(R, 1)
    t_lo, t_hi = tail_share(lo, length, part, parts)
    for t0 in range(t_lo, t_hi, 16):  # every chunk's first token is valid
        tr = t0 + tok_r
        ring_r = gl.expand_dims(tr >= ring_lo, 1)  # each token from one place: one load an element
        k_src = gl.where(ring_r, k_ring + gl.expand_dims(tr % r_safe, 1) * stride_rt,
                         k_stage + gl.expand_dims(tr % PAGE, 1) * stride_st)
        k = gl.load(k_src + gl.expand_dims(chan_c, 0), mask=gl.expand_dims(tr < t_hi, 1), other=0.0).to(DT)
        s = gl.nvidia.ampere.mma_v2(k, qb, s0)  # S^T [16, 8]
        m_i, l_i, acc, pb = softmax_step(s, gl.expand_dims(t0 + tok < t_hi, 1), m_i, l_i, acc, qk_scale, DT, LB)
        tc = t0 + tok_c
        ring_c = gl.expand_dims(tc >= ring_lo, 0)
        v_src = gl.where(ring_c, v_ring + gl.expand_dims(tc % r_safe, 0) * stride_rt,
                         v_stage + gl.expand_dims(tc % PAGE, 0) * stride_st)
        vt = gl.load(v_src + gl.expand_dims(chan_r, 1), mask=gl.expand_dims(tc < t_hi, 0), other=0.0).to(DT)
        acc = gl.nvidia.ampere.mma_v2(vt, pb, acc)
    return m_i, l_i, acc


@gluon.jit
def store_split(part_o, part_lse, acc, m_i, l_i, head0, split, ns_total, G: gl.constexpr, MMA: gl.constexpr):
    """Split `split`'s partial: O^T [128, 8] normalised and log2 of its mass (0 and -inf when empty) at
    the partials' rows of the G heads from head0 (ns_total partials a head)."""
    nonempty = l_i > 0
    l_safe = gl.where(nonempty, l_i, 1.0)
    o = acc / gl.expand_dims(l_safe, 0)
    lse = gl.where(nonempty, m_i + gl.log2(l_safe), -float("inf"))
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (head0 + on) * ns_total + split  # [8]
    gl.store(part_o + gl.expand_dims(row, 0) * 128 + gl.expand_dims(od, 1), o,
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(od < 128, 1))
    gl.store(part_lse + row, lse, mask=on < G)


@gluon.jit
def store_lse(part_lse, m_i, l_i, row, on, G: gl.constexpr):
    """log2 of a split's softmax mass (-inf when empty) at the partials' rows `row` of the G heads."""
    nonempty = l_i > 0
    lse = gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), -float("inf"))
    gl.store(part_lse + row, lse, mask=on < G)


@gluon.jit
def store_tail_partial(part_o, part_lse, acc, m_i, l_i, row, on, G: gl.constexpr, MMA: gl.constexpr):
    """A tail split's partial: O^T [128, 8] normalised (0 when empty) and log2 of its mass (-inf when
    empty) at the partials' rows `row` of the G heads."""
    nonempty = l_i > 0
    l_safe = gl.where(nonempty, l_i, 1.0)
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    gl.store(part_o + gl.expand_dims(row, 0) * 128 + gl.expand_dims(od, 1), acc / gl.expand_dims(l_safe, 0),
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(od < 128, 1))



@gluon.jit
def by_group(ptr, page, rows, cols, SL: gl.constexpr):
    """A page-head's fp16 [64 tokens, 4 groups] table (scales or zeros), each row one 8-byte load,
    split into its 4 groups' [64] columns in the slice layout SL (the rows' layout of the consumer).
    rows: the tokens read (kivi2 reads [32]-token halves of its [64, 4] value tables)."""
    return split_groups(gl.load(ptr + page * SIDE + gl.expand_dims(rows, 1) * 4 + gl.expand_dims(cols, 0)), SL)


@gluon.jit
def split_groups(x, SL: gl.constexpr):
    """A [tokens, 4 groups] side table (a row's 4 groups in one thread) -> its 4 columns in the slice
    layout SL."""
    x = gl.reshape(x, [x.shape[0], 2, 2])  # group = 2 hi + lo
    lo, hi = gl.split(x)
    g0, g2 = gl.split(lo)
    g1, g3 = gl.split(hi)
    return (gl.convert_layout(g0, SL), gl.convert_layout(g1, SL), gl.convert_layout(g2, SL),
            gl.convert_layout(g3, SL))


@gluon.jit
def _store_group(part_o, acc, zacc, zrow, g: gl.constexpr, l_safe, row, chan, on, G: gl.constexpr):
    """The split's normalised output of group g's 32 channels (the group's zero term added)."""
    z_g = gl.sum(gl.where(gl.expand_dims(zrow == g, 1), zacc, 0.0), axis=0)  # [8]
    o = (acc + gl.expand_dims(z_g, 0)) / gl.expand_dims(l_safe, 0)
    gl.store(part_o + gl.expand_dims(row, 0) * 128 + g * 32 + gl.expand_dims(chan, 1), o,
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(chan < 32, 1))


@gluon.jit
def store_groups(part_o, acc0, acc1, acc2, acc3, zacc, l_i, row, on, G: gl.constexpr, MMA: gl.constexpr):
    """A page split's normalised output (0 when empty) from the 4 groups' O^T_g [32, 8] and the zeros'
    sums zacc (rows 0..3), at the partials' rows `row` of the G heads."""
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    chan = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    zrow = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    _store_group(part_o, acc0, zacc, zrow, 0, l_safe, row, chan, on, G)
    _store_group(part_o, acc1, zacc, zrow, 1, l_safe, row, chan, on, G)
    _store_group(part_o, acc2, zacc, zrow, 2, l_safe, row, chan, on, G)
    _store_group(part_o, acc3, zacc, zrow, 3, l_safe, row, chan, on, G)
