"""The Gluon main-term kernel of nuq2 decode attention (see nuq2_decode.py for the algebra and the
reference, nuq2_layout.py for the fragment order it reads).

One warp per program, program (b * Hkv + h, split): the split's pages of sequence b, KV head h, one
64-token page per tile. Swap-AB products on mma_v2 (m16n8k16), the group's query heads as N (padded
to 8):
    S^T [64, 8]  = K [64, 128]   (A operand, dequantized in registers) @ (q * scale)^T [128, 8]
    O^T [128, 8] += V^T [128, 64] (A operand, dequantized in registers) @ P^T [64, 8]
Codes arrive with one 128-bit load per thread per 512-byte row; a `prmt` lookup turns each byte's
code into an fp16 pair of the page's 4 centroids; reshape/permute then give the K / V^T tile in the
A-operand layout without moving data (convert_layout(assert_trivial=True) checks it at compile time).
P^T becomes the B operand by transposing each 8x8 block in registers (movmatrix). The keys' channel
scale multiplies q (fp16 pairs, a [128, 8] B operand per page); their channel mean enters as q . mean
per head, itself an MMA (the mean in every row of A) whose product seeds the scores' accumulator.
Gluon compiles for NVIDIA GPUs only: importing this module needs triton.experimental.gluon (Triton
3.6), launching it a CUDA device of compute capability >= 8.0.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

PAGE = gl.constexpr(64)
ROWS = gl.constexpr(4)  # 512-byte rows of codes per page-head (keys: 16 tokens each)
WORDS = gl.constexpr(512)  # int32 words of codes per page-head


@gluon.jit
def _centroid_pairs(x, shift, table_lo, table_hi):
    """x: int32 code words broadcast over 4 consecutive elements; shift = 2 * field. Each byte's
    field selects one of 4 fp16 centroids (table_lo = c0 | c1 << 16, table_hi = c2 | c3 << 16):
    t = (x >> shift) & 0x03030303 puts one code per byte, t * 0x22 + 0x10 per byte the selector
    nibbles (2c, 2c + 1) of a prmt over the 8-byte table, two bytes per prmt."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, s, h;
        shr.b32 t, $2, $6;
        and.b32 t, t, 0x03030303;
        mad.lo.u32 s, t, 34, 0x10101010;
        shr.b32 h, s, 16;
        prmt.b32 $0, $10, $14, s;
        prmt.b32 $1, $10, $14, h;
        }""",
        constraints="=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[x, shift, table_lo, table_hi], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _per_lane(x, zero):
    """x ^ (laneid & zero) with zero = 0 at run time: a warp-uniform table kept in a vector register
    (in a uniform register ptxas re-copies it before every prmt)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .b32 l; mov.u32 l, %laneid; and.b32 l, l, $2; xor.b32 $0, $1, l; }",
        constraints="=r,r,r", args=[x, zero], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _transpose_8x8(p):
    """Transpose every 8x8 fp16 block held in mma accumulator order (one 32-bit register a thread)."""
    return gl.inline_asm_elementwise(
        asm="movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        constraints="=r,r", args=[p], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _page_tile(kx, vx, k_table, v_table, zero, shift_k, shift_v, q_scaled, bias, m_i, l_i, acc, qk_scale,
               n_valid, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """One page: scores, online softmax, P @ V into acc (O^T [128, 8])."""
    k_lo = _per_lane(gl.load(k_table), zero)
    k_hi = _per_lane(gl.load(k_table + 1), zero)
    v_lo = _per_lane(gl.load(v_table), zero)
    v_hi = _per_lane(gl.load(v_table + 1), zero)

    # K: [4 rows, 512 bytes] -> [4, 512, 4] fp16 -> K [64, 128] in the A-operand layout
    kf = _centroid_pairs(gl.expand_dims(gl.expand_dims(kx, 2), 3), shift_k, k_lo, k_hi)
    kf = gl.reshape(kf, [ROWS, 8, 4, 2, 2, 2, 2, 2, 2])  # blk, g, q4, y3, y2, y1, y0, f1, f0
    kf = gl.permute(kf, [0, 5, 1, 7, 8, 3, 4, 2, 6])  # blk, y1, g | f1, f0, y3, y2, q4, y0
    kf = gl.reshape(kf, [PAGE, 128])
    ka = gl.convert_layout(kf, LA, assert_trivial=True)
    s = gl.nvidia.ampere.mma_v2(ka, q_scaled, bias)  # S^T [64, 8], from bias [64, 8] (q . mean per head)

    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, MMA))
    s = s * qk_scale
    s = gl.where(gl.expand_dims(tok < n_valid, 1), s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_i = l_i * alpha + gl.sum(p, axis=0)
    acc = acc * gl.expand_dims(alpha, 0)
    # P^T as the B operand: each 8x8 block transposed in registers
    pt = _transpose_8x8(p.to(gl.float16))
    pt = gl.reshape(pt, [PAGE // 8, 8, 8])
    pt = gl.permute(pt, [0, 2, 1])
    pt = gl.reshape(pt, [PAGE, 8])
    pb = gl.convert_layout(pt, LB, assert_trivial=True)

    # V: [4 rows, 512 bytes] -> V^T [128, 64] in the A-operand layout
    vf = _centroid_pairs(gl.expand_dims(gl.expand_dims(vx, 2), 3), shift_v, v_lo, v_hi)
    vf = gl.reshape(vf, [2, 2, 8, 4, 2, 2, 2, 2, 2, 2])  # rh, blk, g, q4, y3, y2, y1, y0, f1, f0
    vf = gl.permute(vf, [8, 9, 0, 6, 2, 1, 4, 5, 3, 7])  # f1, f0, rh, y1, g | blk, y3, y2, q4, y0
    vf = gl.reshape(vf, [128, PAGE])
    va = gl.convert_layout(vf, LA, assert_trivial=True)
    acc = gl.nvidia.ampere.mma_v2(va, pb, acc)  # O^T [128, 8]
    return m_new, l_i, acc


@gluon.jit
def nuq2_decode_kernel(k_codes, v_codes, k_tables, v_tables, k_mean, k_scale, q_ptr, block_tables, stride_bt,
                       context_lens, part_o, part_lse, qk_scale, zero, num_splits,
                       HKV: gl.constexpr, G: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 512]; k_tables, v_tables int32 [N, HKV, 2] (the fp16
    centroids); k_mean, k_scale fp8 [N, HKV, 128]; q [B, HKV * G, 128] fp16/bf16 contiguous;
    part_o fp32 [B, HKV * G, num_splits, 128], part_lse fp32 [B, HKV * G, num_splits]."""
    D: gl.constexpr = 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # code tiles [rows, 128 words, 4 bytes of a word (broadcast), 4 fields (broadcast)]; register
    # order keys (byte, word, field, row), values (byte, word, row, field): what the permutes expect
    LK4: gl.constexpr = gl.BlockedLayout([ROWS, 4, 4, 4], [1, 32, 1, 1], [1, 1, 1, 1], [2, 1, 3, 0])
    LV4: gl.constexpr = gl.BlockedLayout([ROWS, 4, 4, 4], [1, 32, 1, 1], [1, 1, 1, 1], [2, 1, 0, 3])
    LK2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LK4))
    LV2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LV4))
    QL: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])

    bh = gl.program_id(0)
    split = gl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    length = gl.load(context_lens + b)
    num_pages = gl.cdiv(length, PAGE)
    per = gl.cdiv(num_pages, num_splits)
    p0 = gl.minimum(split * per, num_pages)
    p1 = gl.minimum(p0 + per, num_pages)
    bt_row = block_tables + b.to(gl.int64) * stride_bt

    # q^T [128, 8] (fp32; padded heads are zero) and the channel index of each of its elements, in
    # the B-operand layout: the per-page scale and mean are loaded straight into it
    qd = gl.arange(0, D, layout=gl.SliceLayout(1, QL))
    qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
    head0 = b.to(gl.int64) * (HKV * G) + h * G
    q_t = gl.load(q_ptr + (head0 + qn[None, :]) * D + qd[:, None], mask=(qn[None, :] < G) & (qd[:, None] < D),
                  other=0.0).to(gl.float32)
    q_t = gl.convert_layout(q_t.to(gl.float16), LB)  # fp16 pairs of channels: one register each
    chan = gl.arange(0, D, layout=gl.SliceLayout(1, LB))  # constant offsets from one base per thread
    chan_a = gl.arange(0, D, layout=gl.SliceLayout(0, LA))

    kr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LK2))
    kw = gl.arange(0, 128, layout=gl.SliceLayout(0, LK2))
    k_off = kr[:, None] * 128 + kw[None, :]
    vr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LV2))
    vw = gl.arange(0, 128, layout=gl.SliceLayout(0, LV2))
    v_off = ((vr % 2) * 256 + (vr // 2) * 128)[:, None] + vw[None, :]  # row (rh, blk) at byte 512 (2 blk + rh)
    shift_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LK4)))) * 2
    shift_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(shift_k, 0), 0), 0)
    shift_k = shift_k + gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LK4)))), 0), 0), 3)
    shift_v = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LV4)))) * 2
    shift_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(shift_v, 0), 0), 0)
    shift_v = shift_v + gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.zeros([4], gl.int32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LV4)))), 0), 0), 3)

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)
    s0 = gl.zeros([PAGE, 8], gl.float32, layout=MMA)
    mean_template = gl.zeros([PAGE, D], gl.float16, layout=LA)  # a shape to broadcast the mean to

    # register double buffering: the next page's codes load while this page computes
    last = gl.maximum(p1 - 1, 0)
    page = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
    kx = gl.load(k_codes + page * WORDS + k_off)
    vx = gl.load(v_codes + page * WORDS + v_off)
    for pg in range(p0, p1):
        page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
        kx_n = gl.load(k_codes + page_n * WORDS + k_off)
        vx_n = gl.load(v_codes + page_n * WORDS + v_off)
        scale = gl.expand_dims(gl.load(k_scale + page * D + chan).to(gl.float16), 1)
        # q . mean on the tensor cores: every row of the A operand is the page's mean, so every
        # row of the product is the per-head constant, already in the scores' layout
        mean = gl.expand_dims(gl.load(k_mean + page * D + chan_a).to(gl.float16), 0)
        mean_rows = gl.broadcast(mean, mean_template)[0]
        q_scaled = q_t * scale  # fp16 x fp16: the one rounding the fp16 operand needs anyway
        bias = gl.nvidia.ampere.mma_v2(mean_rows, q_t, s0)
        m_i, l_i, acc = _page_tile(kx, vx, k_tables + page * 2, v_tables + page * 2, zero, shift_k, shift_v,
                                   q_scaled, bias, m_i, l_i, acc, qk_scale, length - pg * PAGE, LA, LB, MMA)
        kx = kx_n
        vx = vx_n
        page = page_n

    # the split's partial: normalised output and log2 of its mass (0 and -inf when empty)
    nonempty = l_i > 0
    l_safe = gl.where(nonempty, l_i, 1.0)
    o = acc / gl.expand_dims(l_safe, 0)
    lse = gl.where(nonempty, m_i + gl.log2(l_safe), -float("inf"))
    od = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = (head0 + on) * num_splits + split  # [8]
    gl.store(part_o + gl.expand_dims(row, 0) * D + gl.expand_dims(od, 1), o,
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(od < D, 1))
    gl.store(part_lse + row, lse, mask=on < G)
