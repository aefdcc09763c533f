"""Triton helper shared by the quantized-weight kernels: one [BLOCK_N, BLOCK_K] tile of a
QuantizedWeight's matrix, dequantized to fp32 in registers (the layout: ops/quantized_weight.py).

Reference: `QuantizedWeight.dequantize` (fp32), tile by tile.

INT4 and MXFP4 codes share their packing (8 nibbles an int32, the lowest first); an MXFP4 nibble is
an E2M1 value, decoded by placing its bits in an fp16 (`e2m1_values`: exact, 2^-14 times the value,
subnormals included), the 2^14 folded into the group's E8M0 scale (`e8m0_scales`).

The int4 GEMVs can take a packed-half dot instead of the fp32 one (`int4_f16_dots`, the run GEMV's `run_f16_dots`,
chosen by the launchers through `use_f16_dots`): two nibbles an instruction (docs/decisions.md, "The int4 GEMV's dot
in packed halves").
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from moekv.ops import reference

MXFP4_SCALE_SHIFT = tl.constexpr(14)  # e2m1_values gives 2^-14 times each value; e8m0_scales 2^14 times each scale


@triton.jit
def e2m1_values(nibbles):
    """E2M1 codes (int32 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0) -> fp32, 2^-14 times
    their values: the exponent and mantissa bits become an fp16's lowest exponent bits and top mantissa
    bit, whose bias (15 against E2M1's 1) scales every value, the subnormal 0.5 included, by 2^-14."""
    bits = ((nibbles & 0x8) << 12) | ((nibbles & 0x7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_scales(exponents):
    """E8M0 scales (uint8, biased by 127) -> fp32 2^(e - 127) * 2^14 (see e2m1_values), built in the
    exponent field: exact for e <= 240 (models/mxfp4.py refuses larger ones), never subnormal."""
    return ((exponents.to(tl.int32) + MXFP4_SCALE_SHIFT) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_values(raw, MXFP4: tl.constexpr):
    if MXFP4:
        return e8m0_scales(raw)
    else:
        return raw.to(tl.float32)


@triton.jit
def _int4_plane(src, P: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr):
    """Nibble P (bits 4P .. 4P + 3, P <= 3) of each int32 in src -> fp32 0..15, exact, with one LOP3 and
    one FADD and no int-to-float conversion: OR'd into the mantissa of MAGIC = the fp32 OFFSET = 2^(23 - 4P),
    whose last place is then worth 2^-4P, the nibble reads as OFFSET + its value."""
    return ((src & (0xF << (4 * P))) | MAGIC).to(tl.float32, bitcast=True) - OFFSET


@triton.jit
def _nibble_plane(words, I: tl.constexpr, MXFP4: tl.constexpr):
    """Nibble I (0..7) of each int32 of words -> fp32, in words' layout: int4 codes 0..15, or MXFP4
    values times 2^-14 (e2m1_values)."""
    if MXFP4:
        return e2m1_values((words >> (4 * I)) & 0xF)
    else:
        src = words if I < 4 else words >> 16
        P: tl.constexpr = I % 4
        if P == 0:
            return _int4_plane(src, 0, 0x4B000000, 8388608.0)
        elif P == 1:
            return _int4_plane(src, 1, 0x49000000, 524288.0)
        elif P == 2:
            return _int4_plane(src, 2, 0x47000000, 32768.0)
        else:
            return _int4_plane(src, 3, 0x45000000, 2048.0)


@triton.jit
def code_words(codes_ptr, rows, n_ok, k0, K: tl.constexpr, stride_cn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's packed 4-bit codes as they are stored: int32 [BLOCK_N, BLOCK_K / 8], 8 features a word (0 past K
    and on masked rows)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ptrs = codes_ptr + rows[:, None] * stride_cn + offs_w[None, :]
    if (K // 8) % 4 == 0 and BLOCK_K % 32 == 0:
        # QuantizedWeight's codes are contiguous (stride_cn = K / 8): every row and tile starts 16-byte aligned
        # (the hint is in bytes), which Triton cannot see in a stride like gpt-oss's 360 words; told, it
        # loads 128 bits at a time (4 LDG.128 a K step instead of 16 LDG.32, sm_90 SASS)
        ptrs = tl.multiple_of(ptrs, [1, 16])
    return tl.load(ptrs, mask=n_ok[:, None] & (offs_w < K // 8)[None, :], other=0)


@triton.jit
def code_values(codes_ptr, rows, n_ok, k0, K: tl.constexpr, stride_cn, INT4: tl.constexpr, MXFP4: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F16_DOTS: tl.constexpr = False):
    """The tile's codes as fp32 [BLOCK_N, BLOCK_K] (0 past K and on masked rows): fp8 values, int4
    codes 0..15, or MXFP4 values times 2^-14 (8 nibbles an int32 for both; BLOCK_K % 8 == 0). With F16_DOTS
    (int4 only): the words undecoded (code_words), for int4_f16_dots."""
    if F16_DOTS:
        tl.static_assert(INT4, "the packed-half dot takes int4 codes")
        q = code_words(codes_ptr, rows, n_ok, k0, K, stride_cn, BLOCK_N, BLOCK_K)
    elif INT4 or MXFP4:
        words = code_words(codes_ptr, rows, n_ok, k0, K, stride_cn, BLOCK_N, BLOCK_K)  # [BLOCK_N, BLOCK_K / 8]
        # the 8 nibbles decoded as 8 planes in the words' own layout, then interleaved by joins, which keep
        # each word's 8 values in its thread (a 3-D shift and reshape instead left the layout to Triton:
        # shared-memory round trips and the groups' sums spread over all 4 warps, ~9x the instructions a
        # weight byte, sm_90 SASS: docs/decisions.md, "The int4 GEMV's unpack"). join(a, b) puts a and b
        # side by side in a new last dim, so the nibble of flat index 4a + 2b + c comes from plane 4a + 2b + c
        # when the innermost joins pair planes i and i + 4 and the outermost pairs even with odd.
        q = tl.join(tl.join(tl.join(_nibble_plane(words, 0, MXFP4), _nibble_plane(words, 4, MXFP4)),
                            tl.join(_nibble_plane(words, 2, MXFP4), _nibble_plane(words, 6, MXFP4))),
                    tl.join(tl.join(_nibble_plane(words, 1, MXFP4), _nibble_plane(words, 5, MXFP4)),
                            tl.join(_nibble_plane(words, 3, MXFP4), _nibble_plane(words, 7, MXFP4))))
        q = tl.reshape(q, (BLOCK_N, BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(codes_ptr + rows[:, None] * stride_cn + offs_k[None, :],
                    mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    return q


@triton.jit
def dequant_tile(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, K: tl.constexpr, stride_cn, stride_sn,
                 INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_TILE: tl.constexpr = False):
    """Rows `rows` (int64 [BLOCK_N], valid where n_ok) and columns k0 .. k0 + BLOCK_K of one matrix
    (codes_ptr / scales_ptr / zeros_ptr at its first element; the last dims contiguous, rows
    stride_cn and stride_sn apart; zeros shaped as the scales) -> fp32 [BLOCK_N, BLOCK_K]; 0 past K
    and on masked rows. INT4 / MXFP4: codes hold 8 features per int32, lowest nibble first;
    BLOCK_K % 8 == 0. PER_TILE (scale_mode SCALES_PER_TILE: the tile lies in one group): one scale
    and zero point per row, not one load per element."""
    q = code_values(codes_ptr, rows, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K)
    return dequant_codes(q, scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                         BLOCK_K, PER_TILE)


@triton.jit
def dequant_codes(q, scales_ptr, zeros_ptr, rows, n_ok, k0, K: tl.constexpr, stride_sn, INT4: tl.constexpr,
                  MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                  BLOCK_K: tl.constexpr, PER_TILE: tl.constexpr = False):
    """dequant_tile's second half: the tile's code values q (code_values) times their scales, less zero points."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = n_ok[:, None] & (offs_k < K)[None, :]
    if PER_TILE:
        block = (rows // SN) * stride_sn + k0 // SK  # [BLOCK_N]: the scale index of each row
        s = _scale_values(tl.load(scales_ptr + block, mask=n_ok, other=0), MXFP4)
        if INT4:
            if HAS_ZEROS:
                q = q - tl.load(zeros_ptr + block, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            else:
                q = q - 8.0
        return q * s[:, None]
    else:
        block = (rows // SN)[:, None] * stride_sn + (offs_k // SK)[None, :]  # scale index of each element
        s = _scale_values(tl.load(scales_ptr + block, mask=mask, other=0), MXFP4)
        if INT4:
            if HAS_ZEROS:
                q = q - tl.load(zeros_ptr + block, mask=mask, other=0.0).to(tl.float32)
            else:
                q = q - 8.0
        return q * s


# how quant_row_dots finds a tile's scales (scale_mode): per element (any layout), one group spans the
# whole tile (SK a multiple of BLOCK_K, or one group over all of K), whole groups inside the tile
SCALES_PER_ELEMENT, SCALES_PER_TILE, SCALES_PER_GROUP = 0, 1, 2


def scale_mode(scale_k: int, K: int, block_k: int) -> int:
    """The cheapest way quant_row_dots can read the scales of a layout with SK = scale_k."""
    if scale_k % block_k == 0 or scale_k >= K:
        return SCALES_PER_TILE
    if block_k % scale_k == 0:
        return SCALES_PER_GROUP
    return SCALES_PER_ELEMENT


@triton.jit
def quant_row_dots(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, x_row_ptr, K: tl.constexpr, stride_cn, stride_sn,
                   INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                   SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   F16_DOTS: tl.constexpr = False):
    """sum_k dequant(w)[row, k] * x[k] over the tile's columns k0 .. k0 + BLOCK_K -> fp32 [BLOCK_N] (x_row_ptr:
    a row of K activations, 16-bit or fp32): code_values and tile_scales, then x's load (after the codes', so
    that those are in flight while x waits at its layout change's barrier) and code_dots; F16_DOTS (int4):
    f16_activations and int4_f16_dots."""
    q = code_values(codes_ptr, rows, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K, F16_DOTS)
    s, z = tile_scales(scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                       SCALE_MODE, BLOCK_N, BLOCK_K)
    if F16_DOTS:
        h0, h1, h2, h3, down, x_sums = f16_activations(x_row_ptr, k0, K, HAS_ZEROS, SK, SCALE_MODE, BLOCK_K)
        return int4_f16_dots(q, s, z, h0, h1, h2, h3, down, x_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_row_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        return code_dots(q, s, z, scales_ptr, zeros_ptr, rows, n_ok, k0, xv, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN,
                         SK, SCALE_MODE, BLOCK_N, BLOCK_K)


@triton.jit
def tile_scales(scales_ptr, zeros_ptr, rows, n_ok, k0, K: tl.constexpr, stride_sn, INT4: tl.constexpr,
                MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales and zero points code_dots applies to a tile's group sums, fp32: [BLOCK_N] (SCALES_PER_TILE)
    or [BLOCK_N, BLOCK_K / SK] (SCALES_PER_GROUP); zero points 8 without them, 0 for fp8 / MXFP4. A GEMV
    reads them with the codes, before the activations (code_dots). SCALES_PER_ELEMENT: none (0, 0);
    code_dots reads them per element."""
    scale_rows = (rows // SN) * stride_sn
    if SCALE_MODE == 0:
        s = 0.0
        z = 0.0
    elif SCALE_MODE == 1:
        group = k0 // SK
        s = _scale_values(tl.load(scales_ptr + scale_rows + group, mask=n_ok, other=0), MXFP4)
        if INT4 and HAS_ZEROS:
            z = tl.load(zeros_ptr + scale_rows + group, mask=n_ok, other=0.0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0 if INT4 else 0.0, tl.float32)
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        groups = k0 // SK + tl.arange(0, GROUPS)
        g_mask = n_ok[:, None] & (groups < (K + SK - 1) // SK)[None, :]
        s = _scale_values(tl.load(scales_ptr + scale_rows[:, None] + groups[None, :], mask=g_mask, other=0), MXFP4)
        if INT4 and HAS_ZEROS:
            z = tl.load(zeros_ptr + scale_rows[:, None] + groups[None, :], mask=g_mask, other=0.0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N, GROUPS), 8.0 if INT4 else 0.0, tl.float32)
    return s, z


@triton.jit
def code_dots(q, s, z, scales_ptr, zeros_ptr, rows, n_ok, k0, xv, K: tl.constexpr, stride_sn, INT4: tl.constexpr,
              MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
              SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """quant_row_dots on a tile's code values q (code_values) and scales s and zero points z (tile_scales)
    already read: a GEMV issues those loads before the activations', whose layout change waits at a
    barrier. Same contract as dequant_tile, but each scale (and zero point) applies to its group's
    partial sums: sum (q - z) * s * x = s * (sum q * x - z * sum x)."""
    if SCALE_MODE == 0:
        w = dequant_codes(q, scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                          BLOCK_K)
        return tl.sum(w * xv[None, :], axis=1)
    elif SCALE_MODE == 1:
        dots = tl.sum(q * xv[None, :], axis=1)
        if INT4:
            dots = dots - z * tl.sum(xv, axis=0)
        return s * dots
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        dots = tl.sum(tl.reshape(q * xv[None, :], (BLOCK_N, GROUPS, SK)), axis=2)  # [BLOCK_N, GROUPS]
        if INT4:
            x_sums = tl.sum(tl.reshape(xv, (GROUPS, SK)), axis=1)  # [GROUPS]
            dots = dots - z * x_sums[None, :]
        return tl.sum(dots * s, axis=1)


# -- the int4 GEMV's packed-half dot ---------------------------------------------------------------
# The fp32 dot costs ~4 instructions a nibble (_int4_plane's AND and OR, its FADD, the FFMA with x), which keeps
# the int4 GEMV issue-bound (docs/decisions.md, "The int4 GEMV's unpack"). In packed halves a word's 8 nibbles take
# 16: nibbles i and i + 4 share an f16x2 register, placed by one LOP3 each as the halves 1024 + n ((w & 0x000F000F)
# | 0x64006400, and the same of w >> 8) or 1024 + 16 n (mask 0x00F000F0: no shift), centred exactly (n - 8: a
# HSUB2 with 1032, or a HFMA2 by 1/16 less 72), then 4 HFMA2 with the activations' pairs, the two halves to fp32
# and added. The zero point's rest, (z - 8) times the group's sum of x, and the scale stay on the fp32 group sums
# (code_dots' s * (sum q x - z sum x)), so a word needs nothing but its activations.
#
# Range and precision: each K step's activations are multiplied by the power of two 2^e that puts their max |x|
# in [2^8, 2^9) (exact), and the fp32 group sums by 2^-e. A half then sums 4 products |n - 8| |x| <= 8 * 2^9, so
# at most 2^14, a quarter of fp16's 65504 whatever x's magnitude (SwiGLU outputs into the down projection reach
# thousands), and x keeps its bf16 bits down to 2^-22 of the step's max (fp16's subnormals start 22 binades
# below 2^8): unscaled, activations below 6e-5 would lose bits and ones above ~2,000 could overflow. Each half
# rounds 4 times (a HMUL2, 3 HFMA2), so a row's error is at most 2^-9 sum |n - 8| |x| times the scales
# (reference.f16_error_bound); on Mixtral-shaped rows it is ~3e-4 of the dot's rms against int4's own ~0.1
# (benchmarks/tools/f16_dots_error.py; reference.int4_f16_dots_ref emulates it operation for operation).
# The launchers' choice where their config says None (use_f16_dots). On: on an H100 the MoE pair GEMV at T = 1 / 2
# / 4 read at 0.74 / 0.67 / 0.64 of its floor against the fp32 dots' 0.68 / 0.57 / 0.51, the run GEMV at T = 8
# 0.445 against 0.541 ms, the projection GEMV 0.69 against 0.57, with the same errors (docs/decisions.md, "The
# int4 GEMV's dot in packed halves")
F16_DOTS_DEFAULT = True
F16_DOTS_TARGET_EXP = tl.constexpr(reference.F16_DOTS_TARGET_EXP)  # 2^8 <= a K step's max |x| scaled < 2^9

_PACK_F16X2 = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # $1 -> the low half, $2 -> the high half
# The PTX of a word's dot, from two parts: the decode of a word (w) into its 4 f16x2 registers (a0 .. a3: nibbles
# (i, i + 4) as n - 8, exact) and the dot of those with a word's 4 activation planes (h0 .. h3) to an fp32 (out).
# (lop3's 0xEA: (a & b) | c. 0x6408: 1032; 0x2C00: 1/16; 0xD480: -72. Nibbles 0 / 4 and 2 / 6 read 1024 + n, less
# 1032; 1 / 5 and 3 / 7 read 1024 + 16 n, times 1/16 less 72: n - 8 for each, exact.)
_DECODE_PTX = """shr.u32 w8, {w}, 8;
lop3.b32 {a0}, {w}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 {a1}, {w}, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 {a2}, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 {a3}, w8, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x64086408;
sub.rn.f16x2 {a0}, {a0}, c;
sub.rn.f16x2 {a2}, {a2}, c;
mov.b32 c, 0x2C002C00;
mov.b32 d, 0xD480D480;
fma.rn.f16x2 {a1}, {a1}, c, d;
fma.rn.f16x2 {a3}, {a3}, c, d;
"""
_DOT_PTX = """mul.rn.f16x2 acc, {a0}, {h0};
fma.rn.f16x2 acc, {a1}, {h1}, acc;
fma.rn.f16x2 acc, {a2}, {h2}, acc;
fma.rn.f16x2 acc, {a3}, {h3}, acc;
mov.b32 {{lo, hi}}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 {out}, flo, fhi;
"""
_DOT_REGS = ".reg .b32 acc;\n.reg .b16 lo, hi;\n.reg .f32 flo, fhi;\n"
_A = dict(a0="a0", a1="a1", a2="a2", a3="a3")
# the pair GEMV's word dot, both parts in one statement: $0 = the dot of word $1 with planes $2 .. $5
_WORD_DOT_F16 = tl.constexpr("{\n.reg .b32 w8, c, d, a0, a1, a2, a3;\n" + _DOT_REGS + _DECODE_PTX.format(w="$1", **_A)
                             + _DOT_PTX.format(out="$0", h0="$2", h1="$3", h2="$4", h3="$5", **_A) + "}")
# the run GEMV's, apart (run_f16_dots), so that a word is decoded once for all of its pairs: $0 .. $3 = the
# registers of word $4; $0 = the dot of registers $1 .. $4 with planes $5 .. $8
_WORD_DECODE_F16 = tl.constexpr("{\n.reg .b32 w8, c, d;\n" + _DECODE_PTX.format(w="$4", a0="$0", a1="$1", a2="$2",
                                                                                 a3="$3") + "}")
_HALVES_DOT_F16 = tl.constexpr("{\n" + _DOT_REGS + _DOT_PTX.format(out="$0", a0="$1", a1="$2", a2="$3", a3="$4",
                                                                   h0="$5", h1="$6", h2="$7", h3="$8") + "}")


@triton.jit
def _pack_f16x2(lo, hi):
    """fp32 lo, hi -> int32, the f16x2 (lo, hi) each rounded to nearest (_PACK_F16X2 elementwise)."""
    return tl.inline_asm_elementwise(_PACK_F16X2, "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _word_dots(words, h0, h1, h2, h3):
    """int32 words against activation planes (h0 .. h3, broadcast to their shape) -> the fp32 dots (_WORD_DOT_F16
    elementwise: a word's decode and dot in one statement)."""
    return tl.inline_asm_elementwise(_WORD_DOT_F16, "=f,r,r,r,r,r", [words, h0, h1, h2, h3], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _word_halves(words):
    """int32 words -> their 4 f16x2 registers (_WORD_DECODE_F16), each shaped as words."""
    return tl.inline_asm_elementwise(_WORD_DECODE_F16, "=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 4,
                                     is_pure=True, pack=1)


@triton.jit
def _halves_dots(a0, a1, a2, a3, h0, h1, h2, h3):
    """The fp32 dots of decoded words (a0 .. a3: _word_halves) with activation planes (h0 .. h3, broadcast to
    their shape): _HALVES_DOT_F16 elementwise."""
    return tl.inline_asm_elementwise(_HALVES_DOT_F16, "=f,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, h0, h1, h2, h3],
                                     dtype=tl.float32, is_pure=True, pack=1)


def use_f16_dots(setting: bool | None, method: str, device_type: str, scale_k: int, K: int, block_k: int) -> bool:
    """The launchers' F16_DOTS: setting (a config's f16_dots; None: F16_DOTS_DEFAULT) where it applies, int4 codes
    whose scales are read per tile or per group of whole words (the dots are a word's), in a kernel compiled for
    CUDA (the interpreter, TRITON_INTERPRET=1, cannot run inline PTX: there the fp32 dot runs)."""
    on = F16_DOTS_DEFAULT if setting is None else setting
    mode = scale_mode(scale_k, K, block_k)
    return (bool(on) and method == "int4" and device_type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and (mode == SCALES_PER_TILE or mode == SCALES_PER_GROUP and scale_k % 8 == 0))


@triton.jit
def f16_activations(x_row_ptr, k0, K: tl.constexpr, HAS_ZEROS: tl.constexpr, SK: tl.constexpr,
                    SCALE_MODE: tl.constexpr, BLOCK_K: tl.constexpr, rows_ok=None, P: tl.constexpr = 0,
                    SUMS: tl.constexpr = 0):
    """One K step's activations (x_row_ptr: a 16-bit or fp32 row of K) for int4_f16_dots, prepared once for all of
    the tile's rows: (the 4 planes [BLOCK_K / 8] of f16x2 pairs (x[8w + i], x[8w + i + 4]) times 2^e, 2^-e, and the
    fp32 sums of x a group ([BLOCK_K / SK]; SCALES_PER_TILE: the step's; 0 without zero points)).
    P > 0 (the run GEMV, run_f16_dots): x_row_ptr [P] rows (read where rows_ok), each scaled by its own 2^e: planes
    [BLOCK_K / 8, P], 2^-e [P], sums [SUMS, P] (SCALES_PER_GROUP: SUMS equal spans of the step, run_chunks' chunks)
    or [P]."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ok = offs_w < K // 8
    if P > 0:
        p = x_row_ptr[None, :] + 8 * offs_w[:, None]
        ok = ok[:, None] & rows_ok[None, :]
    else:
        p = x_row_ptr + 8 * offs_w
    x0 = tl.load(p + 0, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(p + 1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + 2, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(p + 3, mask=ok, other=0.0).to(tl.float32)
    x4 = tl.load(p + 4, mask=ok, other=0.0).to(tl.float32)
    x5 = tl.load(p + 5, mask=ok, other=0.0).to(tl.float32)
    x6 = tl.load(p + 6, mask=ok, other=0.0).to(tl.float32)
    x7 = tl.load(p + 7, mask=ok, other=0.0).to(tl.float32)
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    amax = tl.max(m, axis=0)
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 9)  # its biased exponent (9: x ~ 0)
    # 2^(127 + 8 - e) (-e first: under the interpreter a constexpr less a tensor stays a constexpr)
    up = ((-e + (254 + F16_DOTS_TARGET_EXP)) << 23).to(tl.float32, bitcast=True)
    down = ((e - F16_DOTS_TARGET_EXP) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 - 8)
    h0 = _pack_f16x2(x0 * up, x4 * up)
    h1 = _pack_f16x2(x1 * up, x5 * up)
    h2 = _pack_f16x2(x2 * up, x6 * up)
    h3 = _pack_f16x2(x3 * up, x7 * up)
    if HAS_ZEROS:
        xw = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # [BLOCK_K / 8]: each word's sum
        if SCALE_MODE == 1:
            x_sums = tl.sum(xw, axis=0)
        elif P > 0:
            x_sums = tl.sum(tl.reshape(xw, (SUMS, BLOCK_K // 8 // SUMS, P)), axis=1)
        else:
            x_sums = tl.sum(tl.reshape(xw, (BLOCK_K // SK, SK // 8)), axis=1)
    else:
        x_sums = 0.0
    return h0, h1, h2, h3, down, x_sums


@triton.jit
def int4_f16_dots(words, s, z, h0, h1, h2, h3, down, x_sums, HAS_ZEROS: tl.constexpr, SK: tl.constexpr,
                  SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """code_dots for int4 codes in packed halves: words (code_values with F16_DOTS), s and z (tile_scales) and one
    K step's f16_activations -> fp32 [BLOCK_N], the rows' dots over the step (SCALES_PER_TILE or
    SCALES_PER_GROUP). Each word's 8 products are summed in fp16 halves, 4 each, then in fp32 (see above)."""
    d = _word_dots(words, h0[None, :], h1[None, :], h2[None, :], h3[None, :])  # [BLOCK_N, BLOCK_K / 8]
    if SCALE_MODE == 1:
        dots = tl.sum(d, axis=1) * down
        if HAS_ZEROS:
            dots = dots - (z - 8.0) * x_sums
        return s * dots
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        dots = tl.sum(tl.reshape(d, (BLOCK_N, GROUPS, SK // 8)), axis=2) * down  # [BLOCK_N, GROUPS]
        if HAS_ZEROS:
            dots = dots - (z - 8.0) * x_sums[None, :]
        return tl.sum(dots * s, axis=1)


@triton.jit
def _spread(q, P: tl.constexpr):
    """q [N, K] -> [N, K, P], each value repeated along a new last dimension held in its thread (joins),
    so that products with P activation rows keep the code values' layout (a broadcast along a new dim
    would leave the 3-D layout to Triton, which moved the whole tile through shared memory)."""
    N: tl.constexpr = q.shape[0]
    K: tl.constexpr = q.shape[1]
    if P == 1:
        return tl.reshape(q, (N, K, 1))
    elif P == 2:
        return tl.join(q, q)
    elif P == 4:
        return tl.reshape(tl.join(tl.join(q, q), tl.join(q, q)), (N, K, 4))
    else:
        tl.static_assert(P == 8, "run GEMVs take 1, 2, 4 or 8 pairs a program")
        q4 = tl.join(tl.join(q, q), tl.join(q, q))
        return tl.reshape(tl.join(q4, q4), (N, K, 8))


def run_chunks(scale_k: int, K: int, block_k: int, f16_dots: bool = False) -> int:
    """CHUNKS for run_code_dots (and run_f16_dots: f16_dots): the partial sums along K it leaves a row and pair.
    With groups inside the tile (SCALES_PER_GROUP), one per chunk of min(SK, BLOCK_K / 32) columns (a lane's
    share of a row at 1024-wide tiles, so each chunk's sum is scaled in its thread and no shuffles are spent a
    K step: sm_90 SASS, Mixtral's down GEMV at 16 x 1024 and 4 pairs, 96 SHFL a step -> 8), at least a word's 8
    with f16_dots; else 1."""
    if scale_mode(scale_k, K, block_k) == SCALES_PER_GROUP:
        return block_k // min(scale_k, max(8 if f16_dots else 1, block_k // 32))
    return 1


@triton.jit
def run_code_dots(q, s, z, scales_ptr, zeros_ptr, rows, n_ok, k0, xs, K: tl.constexpr, stride_sn, INT4: tl.constexpr,
                  MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                  SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                  CHUNKS: tl.constexpr):
    """code_dots for P activation rows at once: xs fp32 [BLOCK_K, P] (0 past K and for absent pairs) against
    one tile's code values q [BLOCK_N, BLOCK_K], decoded once for all P -> fp32 [BLOCK_N, CHUNKS, P] (run_chunks),
    partial sums along K whose sum over axis 1 is each row's dot with each pair's row. Scales and zero points
    apply to each group's (or chunk's) sums, as in code_dots."""
    if SCALE_MODE == 0:
        q = dequant_codes(q, scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                          BLOCK_K)
    prods = _spread(q, P) * xs[None, :, :]  # [BLOCK_N, BLOCK_K, P]
    if SCALE_MODE == 0:
        return tl.reshape(tl.sum(prods, axis=1), (BLOCK_N, 1, P))
    elif SCALE_MODE == 1:
        dots = tl.sum(prods, axis=1)  # [BLOCK_N, P]
        if INT4:
            dots = dots - z[:, None] * tl.sum(xs, axis=0)[None, :]
        return tl.reshape(s[:, None] * dots, (BLOCK_N, 1, P))
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        CPG: tl.constexpr = CHUNKS // GROUPS  # chunks a group
        CW: tl.constexpr = SK // CPG
        dots = tl.sum(tl.reshape(prods, (BLOCK_N, GROUPS, CPG, CW, P)), axis=3)  # [BLOCK_N, GROUPS, CPG, P]
        if INT4:
            x_sums = tl.sum(tl.reshape(xs, (GROUPS, CPG, CW, P)), axis=2)  # [GROUPS, CPG, P]
            dots = dots - z[:, :, None, None] * x_sums[None, :, :, :]
        return tl.reshape(dots * s[:, :, None, None], (BLOCK_N, CHUNKS, P))


@triton.jit
def run_f16_dots(words, s, z, h0, h1, h2, h3, down, x_sums, HAS_ZEROS: tl.constexpr, SK: tl.constexpr,
                 SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                 CHUNKS: tl.constexpr):
    """run_code_dots in packed halves (int4, SCALES_PER_TILE or SCALES_PER_GROUP): words [BLOCK_N, BLOCK_K / 8]
    (code_values with F16_DOTS), s and z (tile_scales) and P pairs' f16_activations (P > 0, SUMS = CHUNKS:
    run_chunks with f16_dots) -> fp32 [BLOCK_N, CHUNKS, P]. Each word is repeated along an in-thread last dim
    (_spread) and taken by int4_f16_dots' word dot once a pair: the decode (shift, LOP3s, centring) reads the
    same register for every pair, so ptxas computes it once a word and each pair costs its 4 HFMA2 and the
    conversion to fp32 (sm_90 SASS: docs/decisions.md, "The int4 GEMV's dot in packed halves"). A pair's half
    sums are scaled by its own 2^-e, then the chunk's zero-point rest and scale apply as in int4_f16_dots."""
    a0, a1, a2, a3 = _word_halves(words)
    d = _halves_dots(_spread(a0, P), _spread(a1, P), _spread(a2, P), _spread(a3, P), h0[None, :, :],
                     h1[None, :, :], h2[None, :, :], h3[None, :, :])  # [BLOCK_N, BLOCK_K / 8, P]
    if SCALE_MODE == 1:
        dots = tl.sum(d, axis=1) * down[None, :]  # [BLOCK_N, P]
        if HAS_ZEROS:
            dots = dots - (z - 8.0)[:, None] * x_sums[None, :]
        return tl.reshape(s[:, None] * dots, (BLOCK_N, 1, P))
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        CPG: tl.constexpr = CHUNKS // GROUPS  # chunks a group
        dots = tl.sum(tl.reshape(d, (BLOCK_N, GROUPS, CPG, BLOCK_K // 8 // CHUNKS, P)), axis=3)
        dots = dots * down[None, None, None, :]  # [BLOCK_N, GROUPS, CPG, P]
        if HAS_ZEROS:
            dots = dots - (z - 8.0)[:, :, None, None] * tl.reshape(x_sums, (GROUPS, CPG, P))[None, :, :, :]
        return tl.reshape(dots * s[:, :, None, None], (BLOCK_N, CHUNKS, P))
