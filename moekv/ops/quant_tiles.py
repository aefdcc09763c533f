"""Triton helper shared by the quantized-weight kernels: one [BLOCK_N, BLOCK_K] tile of a
QuantizedWeight's matrix, dequantized to fp32 in registers (the layout: ops/quantized_weight.py).

Reference: `QuantizedWeight.dequantize` (fp32), tile by tile.

INT4 and MXFP4 codes share their packing (8 nibbles an int32, the lowest first); an MXFP4 nibble is
an E2M1 value, decoded by placing its bits in an fp16 (`e2m1_values`: exact, 2^-14 times the value,
subnormals included), the 2^14 folded into the group's E8M0 scale (`e8m0_scales`).
"""
from __future__ import annotations

import triton
import triton.language as tl

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
def code_values(codes_ptr, rows, n_ok, k0, K: tl.constexpr, stride_cn, INT4: tl.constexpr, MXFP4: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's codes as fp32 [BLOCK_N, BLOCK_K] (0 past K and on masked rows): fp8 values, int4
    codes 0..15, or MXFP4 values times 2^-14 (8 nibbles an int32 for both; BLOCK_K % 8 == 0)."""
    if INT4 or MXFP4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ptrs = codes_ptr + rows[:, None] * stride_cn + offs_w[None, :]
        if (K // 8) % 4 == 0 and BLOCK_K % 32 == 0:
            # QuantizedWeight's codes are contiguous (stride_cn = K / 8): every row and tile starts 16-byte aligned
            # (the hint is in bytes), which Triton cannot see in a stride like gpt-oss's 360 words; told, it
            # loads 128 bits at a time (4 LDG.128 a K step instead of 16 LDG.32, sm_90 SASS)
            ptrs = tl.multiple_of(ptrs, [1, 16])
        words = tl.load(ptrs,
                        mask=n_ok[:, None] & (offs_w < K // 8)[None, :], other=0)  # [BLOCK_N, BLOCK_K / 8]
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
def quant_row_dots(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, xv, K: tl.constexpr, stride_cn, stride_sn,
                   INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                   SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k dequant(w)[row, k] * xv[k] over the tile's columns k0 .. k0 + BLOCK_K -> fp32 [BLOCK_N]
    (xv: fp32 [BLOCK_K], 0 past K): code_values and tile_scales, then code_dots."""
    q = code_values(codes_ptr, rows, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K)
    s, z = tile_scales(scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                       SCALE_MODE, BLOCK_N, BLOCK_K)
    return code_dots(q, s, z, scales_ptr, zeros_ptr, rows, n_ok, k0, xv, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                     SCALE_MODE, BLOCK_N, BLOCK_K)


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


def run_chunks(scale_k: int, K: int, block_k: int) -> int:
    """CHUNKS for run_code_dots: the partial sums along K it leaves a row and pair. With groups inside the
    tile (SCALES_PER_GROUP), one per chunk of min(SK, BLOCK_K / 32) columns (a lane's share of a row at
    1024-wide tiles, so each chunk's sum is scaled in its thread and no shuffles are spent a K step: sm_90
    SASS, Mixtral's down GEMV at 16 x 1024 and 4 pairs, 96 SHFL a step -> 8); else 1."""
    if scale_mode(scale_k, K, block_k) == SCALES_PER_GROUP:
        return block_k // min(scale_k, max(1, block_k // 32))
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
