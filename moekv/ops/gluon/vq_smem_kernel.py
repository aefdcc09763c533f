"""The vq decode kernel with the head's codebooks in shared memory (see vq_kernel.py for the one-warp
kernel this one shares its algebra, fragment order and tile chains with, and vq_decode.py for the
reference).

Why: a codeword gather from global memory costs the L1 one wavefront per distinct 128-byte line, ~32 for
a warp's 32 random codewords (~40 cycles an instruction measured on an H100), while a random read of
shared memory costs its bank conflicts: ~10-12 wavefronts for 16-byte codewords, ~6 for the 8-byte e4m3
ones read here (two phases of 16 lanes over 16 bank pairs). A head's codebooks are 64 kB (32 kB a kind),
too much for a one-warp program, so a CTA of W warps shares one copy (two or three CTAs an SM): CTA (b *
Hkv + h, j) copies head h's codebooks into shared memory once (cp.async), then warp w runs split j * W +
w of sequence b exactly as vq_kernel's program would, every tensor carrying a leading dimension of W
laid over the warps (rank-3 mma_v2: one batch element a warp). The warps of a CTA share the page count
of a split, so the page loop is uniform and a warp past its split's pages masks them. Gluon has no
gather from shared memory at computed addresses: the codeword reads are inline `ld.shared.v2.b32` at
Triton's dynamic shared memory (`global_smem`) plus the codeword's offset, valid because the codebook
buffer is the kernel's only shared memory (its offset 0; the sm_90 build test checks the size). Each
read widens its 8 e4m3 bytes to fp16 in the same asm (cvt.rn.f16x2.e4m3x2). The staged 16-bit tail is
not here: vq_kernel's program computes it in a second launch (vq_decode.vq_decode_partials).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moekv.ops.gluon.common import PAGE, program_sequence, softmax_halves, transpose_8x8
from moekv.ops.gluon.vq_kernel import BOOK, HALF, WORDS

ENTRIES = gl.constexpr(16 * 256)  # codewords a kv head and kind (8 B each)
CODEWORD = gl.constexpr(8)  # bytes


@gluon.jit
def _shared_base(x):
    """The shared-window address of the CTA's dynamic shared memory (global_smem), in x's shape."""
    return gl.inline_asm_elementwise(asm="mov.u32 $0, global_smem;", constraints="=r,r", args=[x], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _lds_e4m3x8(addr):
    """fp16 [..., 8]: the 8 e4m3 bytes at shared address addr (broadcast over the last dimension, 8
    contiguous elements a thread), one ld.shared.v2.b32 and four cvt.rn.f16x2.e4m3x2 (byte i -> half i)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .b32 lo, hi; .reg .b16 l0, l1, h0, h1; ld.shared.v2.b32 {lo, hi}, [$4]; "
            "mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi; cvt.rn.f16x2.e4m3x2 $0, l0; cvt.rn.f16x2.e4m3x2 $1, l1; "
            "cvt.rn.f16x2.e4m3x2 $2, h0; cvt.rn.f16x2.e4m3x2 $3, h1; }",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r", args=[addr], dtype=gl.float16, is_pure=False, pack=8)


@gluon.jit
def _fill_codebooks(book, k_codebook, v_codebook, h, W: gl.constexpr):
    """cp.async of head h's key then value codebooks (e4m3) into book [4096, 16] (two codewords a row:
    byte 8 (kind * 4096 + group * 256 + code) holds a codeword's first), 16 bytes a thread a step;
    waits for every thread's copies."""
    CH: gl.constexpr = 32 * W
    ROWS: gl.constexpr = ENTRIES // 2  # rows a kind
    CL: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [W, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(1, CL)), 1) * 16
    cols = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, CL)), 0)
    for c in gl.static_range(ROWS // CH):
        async_copy.async_copy_global_to_shared(book.slice(c * CH, CH),
                                               k_codebook + h * BOOK + c * CH * 16 + rows + cols)
        async_copy.async_copy_global_to_shared(book.slice(ROWS + c * CH, CH),
                                               v_codebook + h * BOOK + c * CH * 16 + rows + cols)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()


@gluon.jit
def _warp_pages(bt_row, i, j, page_lo, num_pages, per, h, HKV: gl.constexpr, W: gl.constexpr, L: gl.constexpr):
    """Per warp w of the CTA (split j * W + w; [W] in layout L): its i-th page's position in the sequence,
    whether the split has it, and its page-head index (a valid page's when it has not)."""
    w = gl.arange(0, W, layout=L)
    p0 = gl.minimum(page_lo + (j * W + w) * per, num_pages)
    p1 = gl.minimum(p0 + per, num_pages)
    pg = p0 + i
    page = gl.load(bt_row + gl.minimum(pg, gl.maximum(p1 - 1, 0))).to(gl.int64) * HKV + h
    return pg, pg < p1, page


@gluon.jit
def _codes(words, sh, LC: gl.constexpr):
    """[W, 32 lanes, 4 words] -> [W, 16 R, 32 lanes] codes (vq_kernel._half_codes a warp each)."""
    codes = (gl.expand_dims(words, 3) >> sh) & 255  # [W, 32, 4, 4]
    codes = gl.reshape(gl.permute(codes, [0, 2, 3, 1]), [codes.shape[0], 16, 32])
    return gl.convert_layout(codes, LC, assert_trivial=True)


@gluon.jit
def _key_half(base, words, sh, group, pos, LC: gl.constexpr, LA: gl.constexpr):
    """U_h [W, 32 tokens, 128 columns] of each warp's half page of keys, from the shared codebooks."""
    u = _lds_e4m3x8(gl.expand_dims(base + (group * 256 + _codes(words, sh, LC)) * CODEWORD, 3) + pos)  # [W, 16, 32, 8]
    W: gl.constexpr = u.shape[0]
    u = gl.reshape(u, [W, 2, 2, 4, 8, 4, 2, 2, 2])  # w | mt, i, m | g, q4 | k1, hh, e
    u = gl.permute(u, [0, 1, 2, 4, 3, 6, 7, 5, 8])  # w | mt, i, g | m, k1, hh, q4, e
    return gl.convert_layout(gl.reshape(u, [W, HALF, 128]), LA)


@gluon.jit
def _value_half(base, words, sh, group, pos, LC: gl.constexpr, LA: gl.constexpr):
    """U^T_{v,h} [W, 128 rows, 32 tokens] of each warp's half page of values (ENTRIES on: the value codebook)."""
    u = _lds_e4m3x8(gl.expand_dims(base + (ENTRIES + group * 256 + _codes(words, sh, LC)) * CODEWORD, 3) + pos)
    W: gl.constexpr = u.shape[0]
    u = gl.reshape(u, [W, 2, 2, 2, 2, 8, 4, 8])  # w | kk, hh, e, a | g, q4 | b
    u = gl.permute(u, [0, 7, 4, 5, 1, 2, 6, 3])  # w | b, a, g | kk, hh, q4, e
    return gl.convert_layout(gl.reshape(u, [W, 128, HALF]), LA)


@gluon.jit
def _as_b_operand(p, LB: gl.constexpr):
    """[W, 32, 8] 16-bit in the accumulator layout -> the B operand (common.as_b_operand a warp each)."""
    W: gl.constexpr = p.shape[0]
    pt = gl.permute(gl.reshape(transpose_8x8(p), [W, 4, 8, 8]), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(pt, [W, HALF, 8]), LB, assert_trivial=True)


@gluon.jit
def vq_smem_decode_kernel(k_codes, v_codes, k_tok_scale, v_tok_scale, k_mean, k_codebook, k_chan_scale, v_codebook,
                          q_ptr, block_tables, stride_bt, context_lens, part_o, part_lse, qk_scale, window,
                          num_splits, ns_total, R, HKV: gl.constexpr, G: gl.constexpr, W: gl.constexpr,
                          STAGED: gl.constexpr, RING: gl.constexpr):
    """The tables as vq_kernel.vq_decode_kernel's; CTA (b * HKV + h, j), W warps: splits j * W .. j * W + W - 1
    of num_splits (pages only: STAGED says the newest page is the tail, RING that the newest R tokens
    are a residual window's, both read by the other kernel); part_o / part_lse rows of splits >= num_splits
    are not written."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    LW4: gl.constexpr = gl.BlockedLayout([1, 1, 4, 4], [1, 32, 1, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    LW: gl.constexpr = gl.SliceLayout(3, LW4)
    LG: gl.constexpr = gl.BlockedLayout([1, 16, 1, 8], [1, 1, 32, 1], [W, 1, 1, 1], [3, 1, 2, 0])
    LC: gl.constexpr = gl.SliceLayout(3, LG)
    QL: gl.constexpr = gl.BlockedLayout([1, 4, 1], [1, 4, 8], [W, 1, 1], [1, 2, 0])
    ROWS: gl.constexpr = gl.SliceLayout(2, MMA)  # [W, tokens] of the scores
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, 8]: per warp and query head

    book = gl.allocate_shared_memory(gl.float8e4nv, [ENTRIES, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # j: the CTA's group of splits
    b, h, j, length, quantized, first = program_sequence(context_lens, window, HKV, STAGED)
    if RING:  # the ring's tokens leave the pages (the last one read in part; a warp with none is empty)
        quantized = gl.minimum(quantized, gl.maximum(length - R, 0))
    num_pages = gl.cdiv(quantized, PAGE)
    page_lo = gl.minimum(first // PAGE, num_pages)
    per = gl.cdiv(num_pages - page_lo, num_splits)
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G
    _fill_codebooks(book, k_codebook, v_codebook, h, W)

    # q^T and (q * chan_scale)^T [W, 128 columns, 8] in K's column order (every warp the same)
    f = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    chan_k = gl.expand_dims(gl.expand_dims(32 * ((f >> 1) & 3) + 4 * (f >> 4) + 2 * ((f >> 3) & 1) + (f & 1), 0), 2)
    qn = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL))), 0), 1)
    qw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL))), 1), 2)
    q16 = gl.load(q_ptr + (head0 + qn) * 128 + chan_k + qw * 0, mask=(qn < G) & (chan_k < 128) & (qw < W),
                  other=0.0).to(gl.float16)
    cs = gl.load(k_chan_scale + h * 128 + chan_k)
    q_t = gl.convert_layout(q16, LB)
    q_cs = gl.convert_layout((q16.to(gl.float32) * cs).to(gl.float16), LB)

    lane = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW))), 0), 2)
    w_off = lane * 8 + gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW))),
                                                     0), 1)  # [1, 32, 4]
    sh = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LW4)))) * 8, 0), 0), 0)
    r = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LC))), 0), 2)
    ln = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, LC))), 0), 1)
    k_group = 4 * (ln % 4) + r % 4  # [1, 16, 32]
    v_group = 2 * (ln // 4) + r % 2
    pos = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LG)))) * 2, 0), 0), 0)
    base = _shared_base(gl.zeros([1, 16, 32], gl.int32, layout=LC))
    tok = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, ROWS)), 0)  # [1, 32]
    mean_col = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA))), 0)  # [1, 128]
    s0 = gl.zeros([W, HALF, 8], gl.float32, layout=MMA)
    mean_template = gl.zeros([W, HALF, 128], gl.float16, layout=LA)
    # each warp's page index is loaded once per layout that uses it (an L1 hit) rather than converted
    # between them: a conversion may take shared-memory scratch, which the codeword reads' fixed offset
    # 0 does not allow
    L_W: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))  # [W] for the code words
    L_R: gl.constexpr = gl.SliceLayout(1, ROWS)  # [W] for the scores' rows
    L_M: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(1, LA))  # [W] for the mean

    l_i = gl.zeros([W, 8], gl.float32, layout=HEADS)
    m_i = l_i - float("inf")
    acc = gl.zeros([W, 128, 8], gl.float32, layout=MMA)
    page_w = _warp_pages(bt_row, 0, j, page_lo, num_pages, per, h, HKV, W, L_W)[2]
    cw = gl.expand_dims(gl.expand_dims(page_w, 1), 2) * WORDS + w_off
    kx0 = gl.load(k_codes + cw)
    kx1 = gl.load(k_codes + cw + 4)
    vx0 = gl.load(v_codes + cw)
    vx1 = gl.load(v_codes + cw + 4)
    for i in range(0, per):
        page_wn = _warp_pages(bt_row, i + 1, j, page_lo, num_pages, per, h, HKV, W, L_W)[2]
        cw = gl.expand_dims(gl.expand_dims(page_wn, 1), 2) * WORDS + w_off
        kx0_n = gl.load(k_codes + cw)
        kx1_n = gl.load(k_codes + cw + 4)
        vx0_n = gl.load(v_codes + cw)
        vx1_n = gl.load(v_codes + cw + 4)

        pg, has, page = _warp_pages(bt_row, i, j, page_lo, num_pages, per, h, HKV, W, L_R)
        pos_a = gl.expand_dims(pg * PAGE, 1) + tok  # [W, 32]
        pos_b = pos_a + HALF
        ok_a = (pos_a < quantized) & (pos_a >= first) & gl.expand_dims(has, 1)
        ok_b = (pos_b < quantized) & (pos_b >= first) & gl.expand_dims(has, 1)
        page_m = _warp_pages(bt_row, i, j, page_lo, num_pages, per, h, HKV, W, L_M)[2]
        mean = gl.load(k_mean + gl.expand_dims(page_m, 1) * 128 + mean_col).to(gl.float16)  # [W, 128]
        bias = gl.nvidia.ampere.mma_v2(gl.broadcast(gl.expand_dims(mean, 1), mean_template)[0], q_t, s0)
        sa = gl.nvidia.ampere.mma_v2(_key_half(base, kx0, sh, k_group, pos, LC, LA), q_cs, s0)
        sb = gl.nvidia.ampere.mma_v2(_key_half(base, kx1, sh, k_group, pos, LC, LA), q_cs, s0)
        ts_row = k_tok_scale + gl.expand_dims(page, 1) * PAGE + tok
        ts_a = gl.where(ok_a, gl.load(ts_row).to(gl.float32), 0.0)
        ts_b = gl.where(ok_b, gl.load(ts_row + HALF).to(gl.float32), 0.0)
        sa = (sa * gl.expand_dims(ts_a, 2) + bias) * qk_scale
        sb = (sb * gl.expand_dims(ts_b, 2) + bias) * qk_scale
        sa = gl.where(gl.expand_dims(ok_a, 2), sa, -float("inf"))
        sb = gl.where(gl.expand_dims(ok_b, 2), sb, -float("inf"))
        m_i, l_i, alpha, pa, pb = softmax_halves(sa, sb, m_i, l_i, 1, True)  # [W, 8]; a warp may be past its pages
        acc = acc * gl.expand_dims(alpha, 1)
        vs_row = v_tok_scale + gl.expand_dims(page, 1) * PAGE + tok
        vs_a = gl.where(ok_a, gl.load(vs_row).to(gl.float32), 0.0)
        vs_b = gl.where(ok_b, gl.load(vs_row + HALF).to(gl.float32), 0.0)
        acc = gl.nvidia.ampere.mma_v2(_value_half(base, vx0, sh, v_group, pos, LC, LA),
                                      _as_b_operand((pa * gl.expand_dims(vs_a, 2)).to(gl.float16), LB), acc)
        acc = gl.nvidia.ampere.mma_v2(_value_half(base, vx1, sh, v_group, pos, LC, LA),
                                      _as_b_operand((pb * gl.expand_dims(vs_b, 2)).to(gl.float16), LB), acc)
        kx0 = kx0_n
        kx1 = kx1_n
        vx0 = vx0_n
        vx1 = vx1_n

    # each warp's split partial: normalised output by channel (0 when empty) and log2 of its mass
    split = j * W + gl.arange(0, W, layout=gl.SliceLayout(1, HEADS))  # [W]
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, HEADS))
    row = (head0 + gl.expand_dims(on, 0)) * ns_total + gl.expand_dims(split, 1)  # [W, 8]
    mine = (gl.expand_dims(on, 0) < G) & (gl.expand_dims(split, 1) < num_splits)
    nonempty = l_i > 0
    l_safe = gl.where(nonempty, l_i, 1.0)
    od = gl.expand_dims(gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA))), 0), 2)
    chan = 16 * (od % 8) + 8 * ((od // 8) % 2) + od // 16  # vq_layout.VALUE_CHANNEL_OF_ROW
    gl.store(part_o + gl.expand_dims(row, 1) * 128 + chan, acc / gl.expand_dims(l_safe, 1),
             mask=gl.expand_dims(mine, 1) & (chan < 128))
    gl.store(part_lse + row, gl.where(nonempty, m_i + gl.log2(l_safe), -float("inf")), mask=mine)
