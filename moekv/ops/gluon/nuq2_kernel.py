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

Outlier slots, folded into the same tile, on the tensor cores, 16 slots per chunk (nuq2 has
up to 80 key and 32 value slots a page-head, used ones first; the first chunk always runs, with
loads that do not wait for the used counts, further chunks only when more than 16 are used). With
(t_j, c_j) slot j's element and kd_j, dv_j its precomputed deltas (nuq2_layout.slot_deltas):
    before the softmax  S^T [64, 8]  += OneHot_K [64, 16] @ W [16, 8],  W[j, n] = q[n, c_j] kd_j
                        (W as an fp16 hi + lo pair: two MMAs, ~fp32 accuracy)
    after P             P_s [16, 8]   = OneHot_V [16, 64] @ P^T        (exact: picks P's entries)
                        O^T [128, 8] += OneHot_C [128, 16] @ (dv * P_s)   (= Dv^T @ P_s, Dv^T[c, j] = dv_j
                                                                            if c == c_j; dv scales P_s's rows)
The one-hot tiles hold fp16 2.0 (one bit, 0x4000; W is halved, dv quartered: the value side has two
one-hot products, OneHot_V and OneHot_C) and are built
from per-column-pair bit masks, two instructions per register (_hot_rows / _hot_cols).
The staged 16-bit tail (the newest page, in the engine's bf16 staging tensor) is one more split of the
same launch (STAGED): its program runs one tile of plain 16-bit K and V^T through the same softmax.
With a residual window (RING) the launch's last ns_total - num_splits splits read the ring's newest R
tokens, each a contiguous share, as kivi2's do (common.ring_tail_tiles), and the pages end where the
ring begins (the last one read in part).
A sliding window (`window`, a huge value for none) starts the page range at the page holding the
window's first token and masks the tokens before it.
SMEM (a launch option): the next page's codes and side data go by cp.async into the other of two
shared-memory stages while a page computes (instead of the codes' register double buffer and the
side data's loads at the page's start); the page reads its stage (code rows by 128-bit LDS).
Gluon compiles for NVIDIA GPUs only: importing this module needs triton.experimental.gluon (Triton
3.6), launching it a CUDA device of compute capability >= 8.0.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moekv.ops.gluon.common import (
    PAGE,
    as_b_operand,
    program_sequence,
    ring_tail_tiles,
    softmax_step,
    split_range,
    staged_tile,
    store_split,
)
from moekv.ops.gluon.prefetch import address, lanes, opaque, prefetch

ROWS = gl.constexpr(4)  # 512-byte rows of codes per page-head (keys: 16 tokens each)
WORDS = gl.constexpr(512)  # int32 words of codes per page-head
NO_SLOT = gl.constexpr(0x7FFF)  # nuq2_layout.NO_SLOT: an unused slot's int16 position (token 255: none)


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


HOT = gl.constexpr(2.0)  # the one-hot tiles' 1: fp16 2.0 is one bit (0x4000); the other operand is halved


@gluon.jit
def _hot_rows(x, row):
    """A one-hot fp16 tile in the A-operand layout: element (r, j) = HOT where x[r, j] == row[r, j],
    x constant down each column (slot j's token or channel, or >= 512 for none), row constant along
    each row (r < 128). A thread holds rows r = g + 8 i (g = r % 8 its lane's) and column pairs (j,
    j + 1) in one register: per column pair and half (r // 64) a mask with, for the row x hits, bit
    14 - i % 8 (and 30 - i % 8 for column j + 1), computed once; then per register one shift left by
    i % 8 and one and: the pair of fp16 2.0 / 0 values, instead of two compares and selects per element."""
    g = row % 8
    i = (row // 8) % 8
    h = row // 64
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, t;
        .reg .pred e, f;
        and.b32 t, $1, 7;
        setp.eq.u32 e, t, $3;
        shr.u32 t, $1, 6;
        setp.eq.and.u32 e, t, $7, e;
        shr.u32 t, $1, 3;
        and.b32 t, t, 7;
        sub.u32 t, 14, t;
        shl.b32 a, 1, t;
        selp.b32 a, a, 0, e;
        and.b32 t, $2, 7;
        setp.eq.u32 f, t, $4;
        shr.u32 t, $2, 6;
        setp.eq.and.u32 f, t, $8, f;
        shr.u32 t, $2, 3;
        and.b32 t, t, 7;
        sub.u32 t, 30, t;
        shl.b32 b, 1, t;
        selp.b32 b, b, 0, f;
        or.b32 a, a, b;
        shl.b32 a, a, $5;
        and.b32 $0, a, 0x40004000;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r", args=[x, g, i, h], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _hot_cols(x, col):
    """A one-hot fp16 tile in the A-operand layout: element (j, t) = HOT where x[j, t] == col[j, t],
    x constant along each row (slot j's token, or >= 512 for none), col constant down each column
    (t < 64). A thread holds column pairs (t0, t0 + 1) in one register, t0 = 2 q4 + 8 r (q4 its
    lane's): per row a mask with bit 14 - r + 16 (x % 2) set where x // 2 % 4 == q4 and r = x // 8,
    then one shift left by r and one and per register."""
    q4 = (col // 2) % 4
    r = col // 8
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, t;
        .reg .pred e;
        shr.u32 t, $1, 1;
        and.b32 t, t, 3;
        setp.eq.u32 e, t, $3;
        setp.lt.and.u32 e, $1, 64, e;
        and.b32 t, $1, 1;
        shl.b32 t, t, 4;
        shr.u32 a, $1, 3;
        sub.u32 t, t, a;
        add.u32 t, t, 14;
        shl.b32 a, 1, t;
        selp.b32 a, a, 0, e;
        shl.b32 a, a, $5;
        and.b32 $0, a, 0x40004000;
        }""",
        constraints="=r,r,r,r,r,r,r", args=[x, q4, r], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _key_slot_chunk_load(k_idx, k_delta, c0, lim, q_ptr, head0, G: gl.constexpr, LA: gl.constexpr,
                         LB: gl.constexpr):
    """Key slots [c0, c0 + 16) (those below lim): their tokens as OneHot_K's columns, and W [16, 8] =
    q[n, c_j] kd_j (fp32, the B operand's layout). Positions int16, deltas fp16, widened in registers;
    unused slots have token 255 (NO_SLOT >> 7) and delta 0."""
    ja = c0 + gl.arange(0, 16, layout=gl.SliceLayout(0, LA))
    jb = c0 + gl.arange(0, 16, layout=gl.SliceLayout(1, LB))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, LB))
    tok_j = gl.load(k_idx + ja, mask=ja < lim, other=NO_SLOT).to(gl.int32) >> 7
    idx_b = gl.load(k_idx + jb, mask=jb < lim, other=0).to(gl.int32)
    kd = gl.load(k_delta + jb, mask=jb < lim, other=0.0).to(gl.float32)
    qv = gl.load(q_ptr + (head0 + gl.expand_dims(nb, 0)) * 128 + gl.expand_dims(idx_b & 127, 1),
                 mask=gl.expand_dims(nb < G, 0) & gl.expand_dims(jb < lim, 1), other=0.0).to(gl.float32)
    return tok_j, qv * gl.expand_dims(kd * (1.0 / HOT), 1)


@gluon.jit
def _key_slot_chunk0_smem(idx_row, delta_row, lim, q_ptr, head0, G: gl.constexpr, LA: gl.constexpr,
                          LB: gl.constexpr):
    """_key_slot_chunk_load's first chunk from a staged copy: idx_row, delta_row the page's first 16
    key slot positions and deltas (int16 bits) in shared memory, zero-filled past lim; only the
    tokens need their `other` (NO_SLOT) re-applied, the zeros are the global loads' own."""
    ja = gl.arange(0, 16, layout=gl.SliceLayout(0, LA))
    jb = gl.arange(0, 16, layout=gl.SliceLayout(1, LB))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, LB))
    tok_j = gl.where(ja < lim, idx_row.load(gl.SliceLayout(0, LA)).to(gl.int32), NO_SLOT) >> 7
    idx_b = idx_row.load(gl.SliceLayout(1, LB)).to(gl.int32)
    kd = delta_row.load(gl.SliceLayout(1, LB)).to(gl.float16, bitcast=True).to(gl.float32)
    qv = gl.load(q_ptr + (head0 + gl.expand_dims(nb, 0)) * 128 + gl.expand_dims(idx_b & 127, 1),
                 mask=gl.expand_dims(nb < G, 0) & gl.expand_dims(jb < lim, 1), other=0.0).to(gl.float32)
    return tok_j, qv * gl.expand_dims(kd * (1.0 / HOT), 1)


@gluon.jit
def _key_slot_chunk(s, tok_j, w, LA: gl.constexpr):
    """S^T [64, 8] += OneHot_K [64, 16] @ W [16, 8], W as an fp16 hi + lo pair (two MMAs)."""
    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, LA))
    hot = _hot_rows(gl.broadcast(gl.expand_dims(tok_j, 0), gl.expand_dims(tok, 1))[0],
                    gl.broadcast(gl.expand_dims(tok, 1), gl.expand_dims(tok_j, 0))[0])
    w_hi = w.to(gl.float16)
    w_lo = (w - w_hi.to(gl.float32)).to(gl.float16)
    s = gl.nvidia.ampere.mma_v2(hot, w_hi, s)
    return gl.nvidia.ampere.mma_v2(hot, w_lo, s)


@gluon.jit
def _value_slot_chunk_load(v_idx, v_delta, c0, lim, LA: gl.constexpr, MMA: gl.constexpr):
    """Value slots [c0, c0 + 16) (those below lim): tokens as OneHot_V's rows, channels as OneHot_C's
    columns, deltas per row of P_s (int16 positions and fp16 deltas widened in registers; unused: token
    255, delta 0)."""
    jr = c0 + gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
    jc = c0 + gl.arange(0, 16, layout=gl.SliceLayout(0, LA))
    jm = c0 + gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    tok_j = gl.load(v_idx + jr, mask=jr < lim, other=NO_SLOT).to(gl.int32) >> 7
    chan_j = gl.load(v_idx + jc, mask=jc < lim, other=0).to(gl.int32) & 127
    dv = gl.load(v_delta + jm, mask=jm < lim, other=0.0).to(gl.float32) * (1.0 / (HOT * HOT))  # two one-hot products
    return tok_j, chan_j, dv


@gluon.jit
def _value_slot_chunk0_smem(idx_row, delta_row, lim, LA: gl.constexpr, MMA: gl.constexpr):
    """_value_slot_chunk_load's first chunk from a staged copy (as _key_slot_chunk0_smem)."""
    jr = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
    tok_j = gl.where(jr < lim, idx_row.load(gl.SliceLayout(1, LA)).to(gl.int32), NO_SLOT) >> 7
    chan_j = idx_row.load(gl.SliceLayout(0, LA)).to(gl.int32) & 127
    dv = delta_row.load(gl.SliceLayout(1, MMA)).to(gl.float16, bitcast=True).to(gl.float32) * (1.0 / (HOT * HOT))
    return tok_j, chan_j, dv


@gluon.jit
def _value_slot_chunk(acc, pb, tok_j, chan_j, dv, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr):
    """O^T [128, 8] += OneHot_C [128, 16] @ (dv * (OneHot_V [16, 64] @ P^T)): P at the slots' tokens,
    scaled by their deltas (rows of a [16, 8] tile), placed at their channels."""
    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(0, LA))
    chan = gl.arange(0, 128, layout=gl.SliceLayout(1, LA))
    hot = _hot_cols(gl.broadcast(gl.expand_dims(tok_j, 1), gl.expand_dims(tok, 0))[0],
                    gl.broadcast(gl.expand_dims(tok, 0), gl.expand_dims(tok_j, 1))[0])
    p_slots = gl.nvidia.ampere.mma_v2(hot, pb, gl.zeros([16, 8], gl.float32, layout=MMA))  # P at the slots' tokens
    psb = as_b_operand((p_slots * gl.expand_dims(dv, 1)).to(gl.float16), 16, LB)
    hot_c = _hot_rows(gl.broadcast(gl.expand_dims(chan_j, 0), gl.expand_dims(chan, 1))[0],
                      gl.broadcast(gl.expand_dims(chan, 1), gl.expand_dims(chan_j, 0))[0])
    return gl.nvidia.ampere.mma_v2(hot_c, psb, acc)


@gluon.jit
def used_count(ptr):
    """A page-head's used slot count from its uint8 table, widened to int32 behind an asm move: known to
    lie in 0..255, the compiler widens the slot loops' counters to 64 bits (more instructions a chunk)."""
    x = gl.load(ptr).to(gl.int32)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _word_pair(words, i: gl.constexpr):
    """Words i and i + 1 of a staged row in shared memory as two scalars (one 8-byte read a thread)."""
    L2: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    pair = words.slice(i, 2).load(L2)
    at = gl.arange(0, 2, layout=L2)
    return gl.sum(gl.where(at == 0, pair, 0), axis=0), gl.sum(gl.where(at == 1, pair, 0), axis=0)


@gluon.jit
def page_tile(kx, vx, k_table, v_table, zero, shift_k, shift_v, q_scaled, bias, m_i, l_i, acc, qk_scale,
               n_valid, n_first, k_idx, k_delta, nk, SK, v_idx, v_delta, nv, SV, q_ptr, head0, G: gl.constexpr,
               CHUNK0: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, MMA: gl.constexpr, k_rows=None,
               v_rows=None, slots=None, words=None, LK2: gl.constexpr = None, LV2: gl.constexpr = None):
    """One page: scores (+ key slots), online softmax, P @ V (+ value slots) into acc (O^T [128, 8]).
    Tokens [n_first, n_valid) of the page count. Slots run in chunks of 16 while used ones remain;
    CHUNK0: the first chunk of each kind runs unconditionally (unused slots add exact zeros; its loads
    do not wait for the used counts, at ~35 more registers a thread).
    From a shared-memory stage (k_rows given; kx, vx, k_table, v_table unused): the code rows from
    k_rows, v_rows [4, 128] int32, the codebook words from `words` [8] and the first slot chunk from
    `slots` [64] uint16 (as stage_page puts them), each read where it is needed (code rows in layouts LK2,
    LV2); the used counts nk, nv come as arguments either way (uint8 tables: no 4-byte word for cp.async)."""
    if k_rows is None:
        k_lo = _per_lane(gl.load(k_table), zero)
        k_hi = _per_lane(gl.load(k_table + 1), zero)
        v_lo = _per_lane(gl.load(v_table), zero)
        v_hi = _per_lane(gl.load(v_table + 1), zero)
    else:
        k_lo, k_hi = _word_pair(words, 0)
        k_lo = _per_lane(k_lo, zero)
        k_hi = _per_lane(k_hi, zero)
        kx = k_rows.load(LK2)

    # K: [4 rows, 512 bytes] -> [4, 512, 4] fp16 -> K [64, 128] in the A-operand layout
    kf = _centroid_pairs(gl.expand_dims(gl.expand_dims(kx, 2), 3), shift_k, k_lo, k_hi)
    kf = gl.reshape(kf, [ROWS, 8, 4, 2, 2, 2, 2, 2, 2])  # blk, g, q4, y3, y2, y1, y0, f1, f0
    kf = gl.permute(kf, [0, 5, 1, 7, 8, 3, 4, 2, 6])  # blk, y1, g | f1, f0, y3, y2, q4, y0
    kf = gl.reshape(kf, [PAGE, 128])
    ka = gl.convert_layout(kf, LA, assert_trivial=True)
    s = gl.nvidia.ampere.mma_v2(ka, q_scaled, bias)  # S^T [64, 8], from bias [64, 8] (q . mean per head)
    if CHUNK0:
        if k_rows is None:
            k_tok, w = _key_slot_chunk_load(k_idx, k_delta, 0, SK, q_ptr, head0, G, LA, LB)
        else:
            k_tok, w = _key_slot_chunk0_smem(slots.slice(0, 16), slots.slice(32, 16), SK, q_ptr, head0, G, LA, LB)
        s = _key_slot_chunk(s, k_tok, w, LA)
    for c0 in range(16 if CHUNK0 else 0, nk, 16):
        k_tok, w = _key_slot_chunk_load(k_idx, k_delta, c0, nk, q_ptr, head0, G, LA, LB)
        s = _key_slot_chunk(s, k_tok, w, LA)

    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, MMA))
    valid = gl.expand_dims((tok < n_valid) & (tok >= n_first), 1)
    m_new, l_i, acc, pb = softmax_step(s, valid, m_i, l_i, acc, qk_scale, gl.float16, LB)

    # V: [4 rows, 512 bytes] -> V^T [128, 64] in the A-operand layout
    if k_rows is not None:
        v_lo, v_hi = _word_pair(words, 2)
        v_lo = _per_lane(v_lo, zero)
        v_hi = _per_lane(v_hi, zero)
        vx = v_rows.load(LV2)
    vf = _centroid_pairs(gl.expand_dims(gl.expand_dims(vx, 2), 3), shift_v, v_lo, v_hi)
    vf = gl.reshape(vf, [2, 2, 8, 4, 2, 2, 2, 2, 2, 2])  # rh, blk, g, q4, y3, y2, y1, y0, f1, f0
    vf = gl.permute(vf, [8, 9, 0, 6, 2, 1, 4, 5, 3, 7])  # f1, f0, rh, y1, g | blk, y3, y2, q4, y0
    vf = gl.reshape(vf, [128, PAGE])
    va = gl.convert_layout(vf, LA, assert_trivial=True)
    acc = gl.nvidia.ampere.mma_v2(va, pb, acc)  # O^T [128, 8]
    if CHUNK0:
        if k_rows is None:
            v_tok, v_chan, dv = _value_slot_chunk_load(v_idx, v_delta, 0, SV, LA, MMA)
        else:
            v_tok, v_chan, dv = _value_slot_chunk0_smem(slots.slice(16, 16), slots.slice(48, 16), SV, LA, MMA)
        acc = _value_slot_chunk(acc, pb, v_tok, v_chan, dv, LA, LB, MMA)
    for c0 in range(16 if CHUNK0 else 0, nv, 16):
        v_tok, v_chan, dv = _value_slot_chunk_load(v_idx, v_delta, c0, nv, LA, MMA)
        acc = _value_slot_chunk(acc, pb, v_tok, v_chan, dv, LA, LB, MMA)
    return m_new, l_i, acc


@gluon.jit
def _prefetch_page(page, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx, v_delta, v_used, SK, SV,
                   LEVEL: gl.constexpr):
    """Asks for page-head `page`'s side tables (prefetch.py), one line a lane: its fp8 scale and mean,
    codebooks and used counts (a line each), slot positions and deltas (5 lines a table, int16 and fp16:
    SK, SV <= 255 slots). The lane addresses are rebuilt from the kernel's arguments each time (opaque lanes: kept in
    the loop, where they cost ~30 instructions a page and no register across the page's work)."""
    ln = opaque(lanes())
    row = (ln - 6) % 5 * 128
    base = gl.where(ln == 0, address(k_scale), gl.where(ln == 1, address(k_mean), gl.where(
        ln == 2, address(k_tables), gl.where(ln == 3, address(v_tables), gl.where(
            ln == 4, address(k_used), gl.where(ln == 5, address(v_used), gl.where(
                ln < 11, address(k_idx) + row, gl.where(ln < 16, address(k_delta) + row, gl.where(
                    ln < 21, address(v_idx) + row, gl.where(ln < 26, address(v_delta) + row,
                                                            address(k_scale)))))))))))
    stride = gl.where(ln < 2, 128, gl.where(ln < 4, 8, gl.where(ln < 6, 1, gl.where(
        ln < 16, SK * 2, gl.where(ln < 26, SV * 2, 128)))))
    prefetch(base + page * stride, LEVEL)


@gluon.jit
def stage_page(k_smem, v_smem, chan_smem, slot_smem, word_smem, stage, page, k_codes, v_codes, k_off, v_off,
                k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx, v_delta, v_used, SK, SV,
                CHUNK0: gl.constexpr):
    """cp.async of page-head `page`'s codes and side data into shared-memory stage `stage`, one commit
    group: its code rows (values in v_off's row order) at 16 bytes a lane a row, its fp8 scale and
    mean rows at 8 bytes a lane, (CHUNK0) its first 16 slots (k_idx, v_idx int16, k_delta, v_delta fp16:
    a pair of slots a lane, 4 bytes; pairs at or past SK / SV zero-filled, nothing read past the
    page-head's slots: SK and SV are even, the launchers check) and the codebook words (k lo, k hi, v lo,
    v hi) at 4 bytes a lane. The used counts (uint8) are not staged: the page reads them itself."""
    async_copy.async_copy_global_to_shared(k_smem.index(stage), k_codes + page * WORDS + k_off)
    async_copy.async_copy_global_to_shared(v_smem.index(stage), v_codes + page * WORDS + v_off)
    c = gl.arange(0, 256, layout=gl.BlockedLayout([8], [32], [1], [0]))
    async_copy.async_copy_global_to_shared(chan_smem.index(stage),
                                           gl.where(c < 128, k_scale + page * 128 + c, k_mean + page * 128 + (c - 128)))
    if CHUNK0:  # 32 words: 8 each of k_idx, v_idx, k_delta, v_delta (2 slots a word)
        j = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        js = j % 8
        k_idx_w = k_idx.to(gl.pointer_type(gl.int32), bitcast=True)
        v_idx_w = v_idx.to(gl.pointer_type(gl.int32), bitcast=True)
        k_bits = k_delta.to(gl.pointer_type(gl.int32), bitcast=True)
        v_bits = v_delta.to(gl.pointer_type(gl.int32), bitcast=True)
        row = gl.where(j < 8, k_idx_w + page * (SK // 2), gl.where(j < 16, v_idx_w + page * (SV // 2), gl.where(
            j < 24, k_bits + page * (SK // 2), v_bits + page * (SV // 2))))
        words = slot_smem.index(stage)._reinterpret(gl.int32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        async_copy.async_copy_global_to_shared(words, row + js, mask=2 * js < gl.where(j // 8 % 2 == 0, SK, SV))
    i = gl.arange(0, 8, layout=gl.BlockedLayout([1], [32], [1], [0]))
    word = gl.where(i < 2, k_tables + page * 2 + i, v_tables + page * 2 + (i - 2))
    async_copy.async_copy_global_to_shared(word_smem.index(stage), word, mask=i < 4)
    async_copy.commit_group()


@gluon.jit
def allocate_stages():
    """The two shared-memory stages stage_page fills: (codes of keys, of values [2, 4, 128] int32; fp8
    scale and mean [2, 256]; first slot chunk [2, 64] uint16 (16 each of k_idx, v_idx, k_delta, v_delta);
    codebook words [2, 8] (4 used))."""
    ROW_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    CODES_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stage's rank
    return (gl.allocate_shared_memory(gl.int32, [2, ROWS, 128], CODES_L),
            gl.allocate_shared_memory(gl.int32, [2, ROWS, 128], CODES_L),
            gl.allocate_shared_memory(gl.float8e4nv, [2, 256], ROW_L),  # scale, mean
            gl.allocate_shared_memory(gl.uint16, [2, 64], ROW_L),  # k_idx, v_idx, k_delta, v_delta
            gl.allocate_shared_memory(gl.int32, [2, 8], ROW_L))


@gluon.jit
def scaled_q_and_bias(q_t, scale, mean, mean_template, s0):
    """(q * scale, q . mean in every row of the scores): q . mean on the tensor cores, every row of the A
    operand the page's mean, so every row of the product is the per-head constant, already in the
    scores' layout; q * scale in fp16 (the one rounding the fp16 operand needs anyway)."""
    bias = gl.nvidia.ampere.mma_v2(gl.broadcast(mean, mean_template)[0], q_t, s0)
    return q_t * scale, bias


@gluon.jit
def nuq2_decode_kernel(k_codes, v_codes, k_tables, v_tables, k_mean, k_scale,
                       k_idx, k_delta, k_used, v_idx, v_delta, v_used, SK, SV,
                       q_ptr, block_tables, stride_bt, context_lens, seq_slots,
                       k_stage, v_stage, stride_ss, stride_sh, stride_st,
                       k_ring, v_ring, stride_rs, stride_rh, stride_rt, R,
                       part_o, part_lse, qk_scale, window, zero, num_splits, ns_total,
                       HKV: gl.constexpr, G: gl.constexpr, STAGED: gl.constexpr, CHUNK0: gl.constexpr,
                       PREFETCH: gl.constexpr, SMEM: gl.constexpr, RING: gl.constexpr):
    """k_codes, v_codes int32 [N, HKV, 512]; k_tables, v_tables int32 [N, HKV, 2] (the fp16 centroids); k_mean, k_scale
    fp8 [N, HKV, 128]; k_idx / v_idx uint16 [N, HKV, SK / SV] (slot positions, used first; SK, SV even), k_delta /
    v_delta fp16 (their deltas), k_used / v_used uint8 [N, HKV]; q [B, HKV * G, 128] fp16/bf16 contiguous;
    STAGED: tokens from ((len - 1) // 64) * 64 on are in k_stage / v_stage [S, HKV, 64, 128] at slot seq_slots[b],
    read by split num_splits; RING (with STAGED): a residual window, the newest R tokens in k_ring / v_ring
    [S, HKV, R, 128] (row t % R) at the same slots, the tail from min(((len - 1) // 64) * 64, max(len - R, 0))
    on (the pages read up to there, the last one partly), read by splits num_splits .. ns_total - 1, a share
    each; part_o fp32 [B, HKV * G, ns_total, 128], part_lse fp32 [B, HKV * G, ns_total];
    PREFETCH: the next page's side tables asked of L2 (2) or L1 (1) while a page computes (prefetch.py; 0: not);
    SMEM: the next page's codes and side data (scale, mean, codebooks, first slot chunk) copied into
    shared memory by cp.async while a page computes (two stages) instead of the codes' register double buffer and
    the side data's loads at the page's start, the page reading them from there."""
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

    b, h, split, length, quantized, first = program_sequence(context_lens, window, HKV, STAGED)
    page_end = length  # the pages' tokens end where the sequence does (staged: beyond their last page)
    if RING:  # the ring's tokens leave the pages: quantized need not be a page boundary
        quantized = gl.minimum(quantized, gl.maximum(length - R, 0))
        page_end = quantized
        # no page at all when the window starts at or after `quantized` (its page would hold no valid token)
        p0, p1 = split_range(gl.where(first >= quantized, quantized + PAGE - 1, first), quantized, split, num_splits,
                             PAGE)
    else:
        p0, p1 = split_range(first, quantized, split, num_splits, PAGE)  # staged: quantized is a multiple of PAGE
    bt_row = block_tables + b.to(gl.int64) * stride_bt
    head0 = b.to(gl.int64) * (HKV * G) + h * G

    m_i = gl.full([8], -float("inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)

    if split < num_splits:
        # q^T [128, 8] (padded heads are zero) as fp16 pairs in the B-operand layout; the per-page
        # scale and mean are loaded straight into it
        qd = gl.arange(0, D, layout=gl.SliceLayout(1, QL))
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
        q_t = gl.load(q_ptr + (head0 + qn[None, :]) * D + qd[:, None],
                      mask=(qn[None, :] < G) & (qd[:, None] < D), other=0.0).to(gl.float32)
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

        s0 = gl.zeros([PAGE, 8], gl.float32, layout=MMA)
        mean_template = gl.zeros([PAGE, D], gl.float16, layout=LA)  # a shape to broadcast the mean to

        last = gl.maximum(p1 - 1, 0)
        page = gl.load(bt_row + gl.minimum(p0, last)).to(gl.int64) * HKV + h
        if SMEM:  # two shared-memory stages, a page ahead: stage pg % 2 holds page pg's
            k_smem, v_smem, chan_smem, slot_smem, word_smem = allocate_stages()
            stage_page(k_smem, v_smem, chan_smem, slot_smem, word_smem, p0 % 2, page, k_codes, v_codes, k_off,
                        v_off, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx, v_delta, v_used,
                        SK, SV, CHUNK0)
        else:  # register double buffering: the next page's codes load while this page computes
            kx = gl.load(k_codes + page * WORDS + k_off)
            vx = gl.load(v_codes + page * WORDS + v_off)
        for pg in range(p0, p1):
            page_n = gl.load(bt_row + gl.minimum(pg + 1, last)).to(gl.int64) * HKV + h
            if PREFETCH:
                _prefetch_page(page_n, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx, v_delta,
                               v_used, SK, SV, PREFETCH)
            if SMEM:
                async_copy.wait_group(0)  # this page's stage (this lane's copies) ...
                gl.thread_barrier()  # ... and every lane's; every lane is done with the other stage
                stage_page(k_smem, v_smem, chan_smem, slot_smem, word_smem, (pg + 1) % 2, page_n, k_codes, v_codes,
                            k_off, v_off, k_tables, v_tables, k_mean, k_scale, k_idx, k_delta, k_used, v_idx,
                            v_delta, v_used, SK, SV, CHUNK0)
                cur = pg % 2
                side = chan_smem.index(cur)
                scale = gl.expand_dims(side.slice(0, D).load(gl.SliceLayout(1, LB)).to(gl.float16), 1)
                mean = gl.expand_dims(side.slice(D, D).load(gl.SliceLayout(0, LA)).to(gl.float16), 0)
            else:
                kx_n = gl.load(k_codes + page_n * WORDS + k_off)
                vx_n = gl.load(v_codes + page_n * WORDS + v_off)
                scale = gl.expand_dims(gl.load(k_scale + page * D + chan).to(gl.float16), 1)
                mean = gl.expand_dims(gl.load(k_mean + page * D + chan_a).to(gl.float16), 0)
            q_scaled, bias = scaled_q_and_bias(q_t, scale, mean, mean_template, s0)
            nk = used_count(k_used + page)
            nv = used_count(v_used + page)
            if SMEM:
                m_i, l_i, acc = page_tile(None, None, None, None, zero, shift_k, shift_v, q_scaled, bias, m_i, l_i,
                                           acc, qk_scale, page_end - pg * PAGE, first - pg * PAGE, k_idx + page * SK,
                                           k_delta + page * SK, nk, SK, v_idx + page * SV, v_delta + page * SV,
                                           nv, SV, q_ptr, head0, G, CHUNK0, LA, LB, MMA, k_smem.index(cur),
                                           v_smem.index(cur), slot_smem.index(cur), word_smem.index(cur), LK2, LV2)
            else:
                m_i, l_i, acc = page_tile(kx, vx, k_tables + page * 2, v_tables + page * 2, zero, shift_k, shift_v,
                                           q_scaled, bias, m_i, l_i, acc, qk_scale, page_end - pg * PAGE,
                                           first - pg * PAGE, k_idx + page * SK, k_delta + page * SK, nk, SK,
                                           v_idx + page * SV, v_delta + page * SV, nv, SV, q_ptr, head0, G, CHUNK0,
                                           LA, LB, MMA)
                kx = kx_n
                vx = vx_n
            page = page_n
        if SMEM:
            async_copy.wait_group(0)  # the last page's copy (of a page it does not read)
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
                                         qk_scale, length - quantized, first - quantized, G, LA, LB, MMA)

    store_split(part_o, part_lse, acc, m_i, l_i, head0, split, ns_total, G, MMA)
