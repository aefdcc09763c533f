"""Tile readers of nuq2 pages (moekv/kvcache/formats/nuq2.py) for the paged decode kernel: 2-bit codes into a
4-centroid codebook, planar codes, a per-channel affine on the keys, sparse FP8 outliers.

Codes are planar (channel s*D/4 + j in bits 2s..2s+1 of byte j of a row): the readers unpack the
four planes with uniform shifts and interleave them, so tile column 4j + s holds channel
s*D/4 + j (TileReader.planes = 4: the kernel reads q and writes the output in that order).
Centroid lookup with inline PTX: a byte permute (prmt) of the page's packed fp16 centroids
(T0 = c0 | c1 << 16, T1 = c2 | c3 << 16), its selector built from the codes by one integer
multiply-add: a code k in byte b, times 0x22, gives the nibbles (2k, 2k) of byte b, + 0x10 makes
them (2k, 2k + 1): the two bytes of centroid k. mad.lo serves bytes 0, 1 of a register,
mad.hi (x * 0x220000 >> 32 = x * 0x22 >> 16) bytes 2, 3. ~23 operations per 16 elements.
Calibrated codebooks (NUQ2Format(codebook='calibrated')) are not in the slab: the spec passes the
layer's centroids as DecodeSpec.tables (T0 keys, T1 values: [Hkv, 4] fp16, each hook gets its
KV head's row) and CENT_OFF = NUQ2_TABLE_CENTROIDS (a constexpr) makes the readers load the four
from there, the same for every token of the head. With page codebooks the T arguments are not
passed (their defaults are None).
"""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.codes import JOIN_FREE_BELOW, codes_per_column
from moekv.ops.decode.common import DecodeSpec, TileReader
from moekv.ops.decode.launch import spec_launch
from moekv.ops.decode.rope import add_slot_elements, rope_pair
from moekv.ops.decode.slots import (
    add_slot_scores,
    add_slot_values,
    slot_chunk_index,
    used_slot_chunks,
)

# -- nuq2: 2-bit codes into a 4-centroid codebook, planar codes, sparse FP8 outliers -------------------
# Codes are planar (channel s*D/4 + j in bits 2s..2s+1 of byte j of a row): the readers unpack the
# four planes with uniform shifts and interleave them, so tile column 4j + s holds channel
# s*D/4 + j (TileReader.planes = 4: the kernel reads q and writes the output in that order).
# Centroid lookup with inline PTX: a byte permute (prmt) of the page's packed fp16 centroids
# (T0 = c0 | c1 << 16, T1 = c2 | c3 << 16), its selector built from the codes by one integer
# multiply-add: a code k in byte b, times 0x22, gives the nibbles (2k, 2k) of byte b, + 0x10 makes
# them (2k, 2k + 1): the two bytes of centroid k. mad.lo serves bytes 0, 1 of a register,
# mad.hi (x * 0x220000 >> 32 = x * 0x22 >> 16) bytes 2, 3. ~23 operations per 16 elements.
# Calibrated codebooks (NUQ2Format(codebook='calibrated')) are not in the slab: the spec passes the
# layer's centroids as DecodeSpec.tables (T0 keys, T1 values: [Hkv, 4] fp16, each hook gets its
# KV head's row) and CENT_OFF = NUQ2_TABLE_CENTROIDS (a constexpr) makes the readers load the four
# from there, the same for every token of the head. With page codebooks the T arguments are not
# passed (their defaults are None) and the centroids are read from the slab.
NUQ2_TABLE_CENTROIDS = -1  # CENT_OFF: the centroids are the hook's table (T0 keys, T1 values), not a slab field


_NUQ2_LOOKUP_PTX = tl.constexpr("""
{
.reg .b32 x, y, r;
and.b32 x, $8, 0x03030303;
mad.lo.u32 r, x, 0x22, 0x1010;
prmt.b32 $0, $9, $13, r;
mad.hi.u32 r, x, 0x220000, 0x1010;
prmt.b32 $1, $9, $13, r;
shr.b32 y, $8, 2;
and.b32 x, y, 0x03030303;
mad.lo.u32 r, x, 0x22, 0x1010;
prmt.b32 $2, $9, $13, r;
mad.hi.u32 r, x, 0x220000, 0x1010;
prmt.b32 $3, $9, $13, r;
shr.b32 y, $8, 4;
and.b32 x, y, 0x03030303;
mad.lo.u32 r, x, 0x22, 0x1010;
prmt.b32 $4, $9, $13, r;
mad.hi.u32 r, x, 0x220000, 0x1010;
prmt.b32 $5, $9, $13, r;
shr.b32 y, $8, 6;
and.b32 x, y, 0x03030303;
mad.lo.u32 r, x, 0x22, 0x1010;
prmt.b32 $6, $9, $13, r;
mad.hi.u32 r, x, 0x220000, 0x1010;
prmt.b32 $7, $9, $13, r;
}
""")  # $0..$7: planes 0..3, two registers each (bytes 0, 1 then 2, 3); $9..$12 T0, $13..$16 T1


@triton.jit
def _nuq2_centroids(pool, base, tok, valid, CENT_OFF: tl.constexpr, NPG: tl.constexpr, CB):
    """The page's 4 fp16 centroids as fp32 scalars (NPG == 1) or per token [BLOCK_N]; calibrated
    (CENT_OFF < 0): the head's, CB [4] fp16, as scalars whatever NPG."""
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    cp = half + ((base + CENT_OFF) >> 1)
    if CENT_OFF < 0:
        c0 = tl.load(CB).to(tl.float32)
        c1 = tl.load(CB + 1).to(tl.float32)
        c2 = tl.load(CB + 2).to(tl.float32)
        c3 = tl.load(CB + 3).to(tl.float32)
    elif NPG == 1:
        c0 = tl.load(cp).to(tl.float32)
        c1 = tl.load(cp + 1).to(tl.float32)
        c2 = tl.load(cp + 2).to(tl.float32)
        c3 = tl.load(cp + 3).to(tl.float32)
    else:
        c0 = tl.load(cp, mask=valid, other=0.0).to(tl.float32)
        c1 = tl.load(cp + 1, mask=valid, other=0.0).to(tl.float32)
        c2 = tl.load(cp + 2, mask=valid, other=0.0).to(tl.float32)
        c3 = tl.load(cp + 3, mask=valid, other=0.0).to(tl.float32)
    return c0, c1, c2, c3


@triton.jit
def _nuq2_select(k, c0, c1, c2, c3, NPG: tl.constexpr, CENT_OFF: tl.constexpr):
    """fp16 centroid c_k of each 2-bit code k [BLOCK_N, n]; the centroids are scalars, or per token
    [BLOCK_N] when the tile spans pages with their own codebooks."""
    if NPG > 1 and CENT_OFF >= 0:
        x = tl.where(k == 0, c0[:, None], tl.where(k == 1, c1[:, None], tl.where(k == 2, c2[:, None], c3[:, None])))
    else:
        x = tl.where(k == 0, c0, tl.where(k == 1, c1, tl.where(k == 2, c2, c3)))
    return x.to(tl.float16)


@triton.jit
def _nuq2_lookup_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, NPG: tl.constexpr,
                      ASM: tl.constexpr, CENT_OFF: tl.constexpr, CB):
    """[BLOCK_N, D] centroids of the tile's codes (fp16, column 4j + s = channel s*D/4 + j): the
    page's (at CENT_OFF in its slab), or the head's calibrated ones CB [4] fp16 (CENT_OFF < 0)."""
    if BLOCK_N < JOIN_FREE_BELOW or D < JOIN_FREE_BELOW:  # no tl.interleave (see JOIN_FREE_BELOW)
        c0, c1, c2, c3 = _nuq2_centroids(pool, base, tok, valid, CENT_OFF, NPG, CB)
        x = _nuq2_select(codes_per_column(pool, base, tok, valid, D, 2), c0, c1, c2, c3, NPG, CENT_OFF)
    else:
        x0, x1, x2, x3 = _nuq2_code_planes(pool, base, tok, valid, D, BLOCK_N, NPG, ASM, CENT_OFF, CB)
        x = tl.interleave(tl.interleave(x0, x2), tl.interleave(x1, x3))
    return x


@triton.jit
def _nuq2_code_planes(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, NPG: tl.constexpr,
                      ASM: tl.constexpr, CENT_OFF: tl.constexpr, CB):
    """The centroids of the tile's codes as its four planes [BLOCK_N, D/4] fp16 (plane s, column j:
    channel s*D/4 + j), unpacked from whole bytes (tiles of 32 tokens and channels or more)."""
    QD: tl.constexpr = D // 4
    j = tl.arange(0, QD)
    if NPG == 1:
        packed = tl.load(pool + (base + tok * QD)[:, None] + j[None, :])
    else:
        packed = tl.load(pool + (base + tok * QD)[:, None] + j[None, :], mask=valid[:, None], other=0)
    if ASM:
        words = pool.to(tl.pointer_type(tl.int32), bitcast=True)
        if CENT_OFF < 0:  # the head's codebook: one pair of words for every token
            cb_words = CB.to(tl.pointer_type(tl.int32), bitcast=True)
            t0 = tl.load(cb_words)
            t1 = tl.load(cb_words + 1)
        elif NPG == 1:
            t0 = tl.load(words + ((base + CENT_OFF) >> 2))
            t1 = tl.load(words + ((base + CENT_OFF) >> 2) + 1)
        else:
            t0 = tl.load(words + ((base + CENT_OFF) >> 2), mask=valid, other=0)[:, None]
            t1 = tl.load(words + ((base + CENT_OFF) >> 2) + 1, mask=valid, other=0)[:, None]
        t0 = tl.broadcast_to(t0, (BLOCK_N, QD))
        t1 = tl.broadcast_to(t1, (BLOCK_N, QD))
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            _NUQ2_LOOKUP_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [packed, t0, t1],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        c0, c1, c2, c3 = _nuq2_centroids(pool, base, tok, valid, CENT_OFF, NPG, CB)
        codes = packed.to(tl.int32)
        x0 = _nuq2_select(codes & 3, c0, c1, c2, c3, NPG, CENT_OFF)
        x1 = _nuq2_select((codes >> 2) & 3, c0, c1, c2, c3, NPG, CENT_OFF)
        x2 = _nuq2_select((codes >> 4) & 3, c0, c1, c2, c3, NPG, CENT_OFF)
        x3 = _nuq2_select((codes >> 6) & 3, c0, c1, c2, c3, NPG, CENT_OFF)
    return x0, x1, x2, x3


@triton.jit
def nuq2_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  P: tl.constexpr, ASM: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                  OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                  T0=None, T1=None, T2=None, T3=None):
    """nuq2 key slab: codes [P, D/4] (planar) at 0, chan_mean and chan_scale fp8 [D], centroids
    fp16 [4] (calibrated, CENT_OFF < 0: none, the head's are T0 [4]), out_val fp8 [S], out_idx
    uint16 [S]. A tile inside one page is the centroids alone (nuq2_key_fold moves the channel
    affine into q); a tile over several pages gets z * scale + mean."""
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    x = _nuq2_lookup_tile(pool, base, tok, valid, D, BLOCK_N, NPG, ASM, CENT_OFF, T0)
    if NPG > 1:
        d = tl.arange(0, D)
        col = (d % 4) * (D // 4) + d // 4  # the channel of each tile column
        f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
        scale = tl.load(f8 + (base + SCALE_OFF)[:, None] + col[None, :], mask=valid[:, None], other=0.0)
        mean = tl.load(f8 + (base + MEAN_OFF)[:, None] + col[None, :], mask=valid[:, None], other=0.0)
        x = x.to(tl.float32) * scale.to(tl.float32) + mean.to(tl.float32)
    return x, valid


@triton.jit
def nuq2_key_tile_rope(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       P: tl.constexpr, ASM: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                       OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                       pos, log2_theta, T0=None, T1=None, T2=None, T3=None):
    """Keys stored before RoPE (DecodeSpec.key_rope): the tile as `dequantize` gives it (centroids,
    the outlier slots written in, z * scale + mean), rotated by RoPE at the tokens' positions pos
    [BLOCK_N] (fp32, tile column order). Done on the four code planes before they are interleaved:
    planes s and s + 2 hold the rotary pairs (j + s*D/4, j + (s+2)*D/4) element for element. Neither
    the affine nor the slots can go into q or the scores, as nuq2_key_fold and nuq2_key_fix put them
    for keys stored after RoPE."""
    SC: tl.constexpr = 16
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    QD: tl.constexpr = D // 4
    if BLOCK_N < JOIN_FREE_BELOW or D < JOIN_FREE_BELOW:  # byte loads per column, then split into planes
        c0, c1, c2, c3 = _nuq2_centroids(pool, base, tok, valid, CENT_OFF, NPG, T0)
        x = _nuq2_select(codes_per_column(pool, base, tok, valid, D, 2), c0, c1, c2, c3, NPG, CENT_OFF)
        even, odd = tl.split(tl.reshape(x, (BLOCK_N, QD, 2, 2)))  # column 4j + 2a + b: b = 0, 1
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
    else:
        x0, x1, x2, x3 = _nuq2_code_planes(pool, base, tok, valid, D, BLOCK_N, NPG, ASM, CENT_OFF, T0)
    x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < chunks:
            used, colm, c, delta, pb = _nuq2_slot_chunk(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF,
                                                        OVAL_OFF, OIDX_OFF, S, T0)
            plane, j = c // QD, c % QD
            x0 = add_slot_elements(x0, colm, tl.where(plane == 0, j, -1), delta, used, BLOCK_N, QD)
            x1 = add_slot_elements(x1, colm, tl.where(plane == 1, j, -1), delta, used, BLOCK_N, QD)
            x2 = add_slot_elements(x2, colm, tl.where(plane == 2, j, -1), delta, used, BLOCK_N, QD)
            x3 = add_slot_elements(x3, colm, tl.where(plane == 3, j, -1), delta, used, BLOCK_N, QD)
    x0 = _nuq2_plane_affine(pool, base, valid, x0, 0, D, NPG, MEAN_OFF, SCALE_OFF)
    x1 = _nuq2_plane_affine(pool, base, valid, x1, 1, D, NPG, MEAN_OFF, SCALE_OFF)
    x2 = _nuq2_plane_affine(pool, base, valid, x2, 2, D, NPG, MEAN_OFF, SCALE_OFF)
    x3 = _nuq2_plane_affine(pool, base, valid, x3, 3, D, NPG, MEAN_OFF, SCALE_OFF)
    i = tl.arange(0, QD)[None, :]  # plane s < 2, column j: frequency s*D/4 + j
    x0, x2 = rope_pair(x0, x2, pos[:, None], i, log2_theta, D, ASM)
    x1, x3 = rope_pair(x1, x3, pos[:, None], i + QD, log2_theta, D, ASM)
    return tl.interleave(tl.interleave(x0, x2), tl.interleave(x1, x3)), valid


@triton.jit
def _nuq2_plane_affine(pool, base, valid, x, s: tl.constexpr, D: tl.constexpr, NPG: tl.constexpr,
                       MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Plane s of a key tile [BLOCK_N, D/4] fp32 times its channels' scales plus their means (the
    page's, or each token's page's when the tile spans pages)."""
    QD: tl.constexpr = D // 4
    ch = s * QD + tl.arange(0, QD)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    if NPG == 1:
        scale = tl.load(f8 + (base + SCALE_OFF) + ch)[None, :]
        mean = tl.load(f8 + (base + MEAN_OFF) + ch)[None, :]
    else:
        scale = tl.load(f8 + (base + SCALE_OFF)[:, None] + ch[None, :], mask=valid[:, None], other=0.0)
        mean = tl.load(f8 + (base + MEAN_OFF)[:, None] + ch[None, :], mask=valid[:, None], other=0.0)
    return x * scale.to(tl.float32) + mean.to(tl.float32)


@triton.jit
def nuq2_key_fold(pool, page_base, q, D: tl.constexpr, P: tl.constexpr, CENT_OFF: tl.constexpr,
                  OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr,
                  SCALE_OFF: tl.constexpr, T0=None, T1=None, T2=None, T3=None):
    """q (s * z + m) = (q * s) z + q m: q [G_PAD, D] fp32 in tile column order -> (q * s, q . m)."""
    # read in channel order, [4, D/4] (one contiguous run: vector loads, where a gather in tile
    # column order gave D byte loads every tile), then transposed: tile column 4j + s is channel s*D/4 + j
    plane_col = tl.arange(0, 4)[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :]
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    scale = tl.reshape(tl.trans(tl.load(f8 + (page_base + SCALE_OFF) + plane_col).to(tl.float32)), (D,))
    mean = tl.reshape(tl.trans(tl.load(f8 + (page_base + MEAN_OFF) + plane_col).to(tl.float32)), (D,))
    return q * scale[None, :], tl.sum(q * mean[None, :], axis=1)


@triton.jit
def nuq2_value_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    P: tl.constexpr, ASM: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                    OIDX_OFF: tl.constexpr, S: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
                    T0=None, T1=None, T2=None, T3=None):
    """nuq2 value slab: codes [P, D/4] (planar) at 0, centroids fp16 [4] (calibrated, CENT_OFF < 0:
    none, the head's are T1 [4]), out_val fp8 [S], out_idx uint16 [S]: the tile is the centroids."""
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    return _nuq2_lookup_tile(pool, base, tok, valid, D, BLOCK_N, NPG, ASM, CENT_OFF, T1), valid


@triton.jit
def _nuq2_slot_chunk(pool, page_base, tok0, chunk, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                     CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr, CB,
                     c0=None, c1=None, c2=None, c3=None):
    """Outlier slots [chunk * 16, chunk * 16 + 16) of each page of the tile, flattened to
    [NPG * 16]: (used, tile column of the token, channel, delta in codebook units = the slot's
    value minus the centroid of the code under it; 0 where unused). The centroid is selected from
    the page's four (no gather load behind the code's), or from the head's calibrated CB [4]
    (CENT_OFF < 0); c0..c3: those four already loaded (_tile_slot_centroids), else loaded here."""
    QD: tl.constexpr = D // 4
    i, pb, first = slot_chunk_index(page_base, tok0, chunk, BLOCK_N, P)
    u16 = pool.to(tl.pointer_type(tl.uint16), bitcast=True)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    idx = tl.load(u16 + ((pb + OIDX_OFF) >> 1) + i, mask=i < S, other=0xFFFF).to(tl.int32)
    val = tl.load(f8 + pb + OVAL_OFF + i, mask=i < S, other=0.0).to(tl.float32)
    if c0 is None:
        if CENT_OFF < 0:
            cp = CB  # the head's: scalars
        else:
            cp = half + ((pb + CENT_OFF) >> 1)
        c0 = tl.load(cp).to(tl.float32)  # scalars when NPG == 1
        c1 = tl.load(cp + 1).to(tl.float32)
        c2 = tl.load(cp + 2).to(tl.float32)
        c3 = tl.load(cp + 3).to(tl.float32)
    used = idx != 0xFFFF
    idx = tl.where(used, idx, 0)
    t = idx // D
    c = idx % D
    code = (tl.load(pool + pb + t * QD + c % QD).to(tl.int32) >> (2 * (c // QD))) & 3
    cent = tl.where(code == 0, c0, tl.where(code == 1, c1, tl.where(code == 2, c2, c3)))
    unit = tl.maximum(tl.maximum(tl.abs(c0), tl.abs(c1)), tl.maximum(tl.abs(c2), tl.abs(c3)))
    unit = tl.maximum(unit, 1e-6)  # centroid_unit
    delta = tl.where(used, val * unit - cent, 0.0)
    return used, first + t, c, delta, pb


@triton.jit
def nuq2_key_fix(pool, page_base, tok0, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                 OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                 T0=None, T1=None, T2=None, T3=None):
    """Scores of the outlier slots: s[g, t] += q[g, c] * scale[c] * delta for each used slot (t, c),
    16 slots at a time: corr [G_PAD, 16] @ one-hot of the slots' tile columns [16, BLOCK_N].
    Only the chunks in use are touched: their loads, layout changes and product sit behind one
    uniform branch each (quantize fills the slots in order)."""
    return _nuq2_key_slots(pool, page_base, tok0, q_rows, row_ok, s, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF,
                           OIDX_OFF, S, SCALE_OFF, 0, T0)


@triton.jit
def nuq2_key_fix_first(pool, page_base, tok0, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                       OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                       T0=None, T1=None, T2=None, T3=None):
    """nuq2_key_fix with the first chunk outside any branch (slots mode 'first', nuq2_spec)."""
    return _nuq2_key_slots(pool, page_base, tok0, q_rows, row_ok, s, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF,
                           OIDX_OFF, S, SCALE_OFF, 1, T0)


@triton.jit
def _nuq2_key_slots(pool, page_base, tok0, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                    OIDX_OFF: tl.constexpr, S: tl.constexpr, SCALE_OFF: tl.constexpr, ALWAYS: tl.constexpr, CB):
    """The key slots' score corrections; chunks [0, ALWAYS) unconditionally, the rest when in use."""
    SC: tl.constexpr = 16
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N
    NPG: tl.constexpr = BLOCK_N // PP
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    c0, c1, c2, c3 = None, None, None, None  # 'lazy': each chunk loads them behind its own branch
    if ALWAYS > 0:
        c0, c1, c2, c3 = _tile_slot_centroids(pool, page_base, tok0, BLOCK_N, P, CENT_OFF, CB)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < ALWAYS:  # compile time: no branch, and the chunk's loads need not wait for `chunks`
            s = _nuq2_key_chunk(pool, f8, page_base, tok0, chunk, q_rows, row_ok, s, D, BLOCK_N, P, DOT,
                                CENT_OFF, OVAL_OFF, OIDX_OFF, S, SCALE_OFF, CB, c0, c1, c2, c3)
        elif chunk < chunks:
            s = _nuq2_key_chunk(pool, f8, page_base, tok0, chunk, q_rows, row_ok, s, D, BLOCK_N, P, DOT,
                                CENT_OFF, OVAL_OFF, OIDX_OFF, S, SCALE_OFF, CB, c0, c1, c2, c3)
    return s


@triton.jit
def _tile_slot_centroids(pool, page_base, tok0, BLOCK_N: tl.constexpr, P: tl.constexpr, CENT_OFF: tl.constexpr, CB):
    """The centroids every slot chunk of the tile uses ('first' slots mode: loaded once a tile, then
    given to each _nuq2_slot_chunk). The same loads as that function's own; not shared through a
    call, which reorders the default ('lazy') kernel's SASS."""
    i, pb, first = slot_chunk_index(page_base, tok0, 0, BLOCK_N, P)
    if CENT_OFF < 0:
        cp = CB  # the head's: scalars
    else:
        cp = pool.to(tl.pointer_type(tl.float16), bitcast=True) + ((pb + CENT_OFF) >> 1)
    c0 = tl.load(cp).to(tl.float32)
    c1 = tl.load(cp + 1).to(tl.float32)
    c2 = tl.load(cp + 2).to(tl.float32)
    c3 = tl.load(cp + 3).to(tl.float32)
    return c0, c1, c2, c3


@triton.jit
def _nuq2_key_chunk(pool, f8, page_base, tok0, chunk, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                    OIDX_OFF: tl.constexpr, S: tl.constexpr, SCALE_OFF: tl.constexpr, CB, c0, c1, c2, c3):
    used, colm, c, delta, pb = _nuq2_slot_chunk(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF,
                                                OVAL_OFF, OIDX_OFF, S, CB, c0, c1, c2, c3)
    scale = tl.load(f8 + pb + SCALE_OFF + c).to(tl.float32)
    q_c = tl.load(q_rows + c[None, :], mask=row_ok[:, None] & used[None, :], other=0.0).to(tl.float32)
    corr = q_c * (scale * delta)[None, :]  # [G_PAD, NPG * 16]
    return add_slot_scores(s, corr, colm, used, BLOCK_N, DOT)


@triton.jit
def nuq2_value_fix(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                   OIDX_OFF: tl.constexpr, S: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
                   T0=None, T1=None, T2=None, T3=None):
    """Output of the outlier slots: pv[g, col(c)] += p[g, t] * delta for each used slot (t, c):
    p @ one-hot [BLOCK_N, 16] gathers p at the slots' tokens, times delta, @ one-hot [16, D]
    scatters to their channels' tile columns. Only the chunks in use are touched."""
    return _nuq2_value_slots(pool, page_base, tok0, p, pv, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF, OIDX_OFF, S,
                             0, T1)


@triton.jit
def nuq2_value_fix_first(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                         OIDX_OFF: tl.constexpr, S: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
                         T0=None, T1=None, T2=None, T3=None):
    """nuq2_value_fix with the first chunk outside any branch (slots mode 'first', nuq2_spec)."""
    return _nuq2_value_slots(pool, page_base, tok0, p, pv, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF, OIDX_OFF, S,
                             1, T1)


@triton.jit
def _nuq2_value_slots(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                      DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr,
                      S: tl.constexpr, ALWAYS: tl.constexpr, CB):
    """The value slots' output corrections; chunks [0, ALWAYS) unconditionally, the rest when in use."""
    SC: tl.constexpr = 16
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N
    NPG: tl.constexpr = BLOCK_N // PP
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    c0, c1, c2, c3 = None, None, None, None  # 'lazy': each chunk loads them behind its own branch
    if ALWAYS > 0:
        c0, c1, c2, c3 = _tile_slot_centroids(pool, page_base, tok0, BLOCK_N, P, CENT_OFF, CB)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < ALWAYS:  # compile time: no branch, and the chunk's loads need not wait for `chunks`
            pv = _nuq2_value_chunk(pool, page_base, tok0, chunk, p, pv, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF,
                                   OIDX_OFF, S, CB, c0, c1, c2, c3)
        elif chunk < chunks:
            pv = _nuq2_value_chunk(pool, page_base, tok0, chunk, p, pv, D, BLOCK_N, P, DOT, CENT_OFF, OVAL_OFF,
                                   OIDX_OFF, S, CB, c0, c1, c2, c3)
    return pv


@triton.jit
def _nuq2_value_chunk(pool, page_base, tok0, chunk, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                      DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr,
                      S: tl.constexpr, CB, c0, c1, c2, c3):
    used, colm, c, delta, pb = _nuq2_slot_chunk(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF,
                                                OVAL_OFF, OIDX_OFF, S, CB, c0, c1, c2, c3)
    return add_slot_values(pv, p, colm, 4 * (c % (D // 4)) + c // (D // 4), delta, used, D, BLOCK_N, DOT)


@triton.jit
def _nuq2_slots(pool, page_base, tok0, chunk, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr, CB):
    """Outlier slots [chunk * 16, chunk * 16 + 16) of each page of the tile, flattened to
    [NPG * 16]: (used, tile column of the token, channel, delta in codebook units = the slot's
    value minus the centroid of the code under it; 0 where unused)."""
    SC: tl.constexpr = 16
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N
    NPG: tl.constexpr = BLOCK_N // PP
    QD: tl.constexpr = D // 4
    i = chunk * SC + tl.arange(0, SC)
    u16 = pool.to(tl.pointer_type(tl.uint16), bitcast=True)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    if NPG == 1:
        pb = page_base + tl.zeros([SC], tl.int64)
        first = tl.zeros([SC], tl.int32) - tok0  # the tile's column of a page row t is t - tok0
    else:
        pb = tl.reshape(tl.broadcast_to(page_base[:, None], (NPG, SC)), (NPG * SC,))
        first = tl.reshape(tl.broadcast_to((tl.arange(0, NPG) * P)[:, None], (NPG, SC)), (NPG * SC,))
        i = tl.reshape(tl.broadcast_to(i[None, :], (NPG, SC)), (NPG * SC,))
    idx = tl.load(u16 + ((pb + OIDX_OFF) >> 1) + i, mask=i < S, other=0xFFFF).to(tl.int32)
    used = idx != 0xFFFF
    idx = tl.where(used, idx, 0)
    t = idx // D
    c = idx % D
    code = (tl.load(pool + pb + t * QD + c % QD).to(tl.int32) >> (2 * (c // QD))) & 3
    if CENT_OFF < 0:  # calibrated: the head's CB [4]
        cent = tl.load(CB + code).to(tl.float32)
        c0 = tl.load(CB).to(tl.float32)
        c1 = tl.load(CB + 1).to(tl.float32)
        c2 = tl.load(CB + 2).to(tl.float32)
        c3 = tl.load(CB + 3).to(tl.float32)
    else:
        cent = tl.load(half + ((pb + CENT_OFF) >> 1) + code).to(tl.float32)
        c0 = tl.load(half + ((pb + CENT_OFF) >> 1)).to(tl.float32)
        c1 = tl.load(half + ((pb + CENT_OFF) >> 1) + 1).to(tl.float32)
        c2 = tl.load(half + ((pb + CENT_OFF) >> 1) + 2).to(tl.float32)
        c3 = tl.load(half + ((pb + CENT_OFF) >> 1) + 3).to(tl.float32)
    unit = tl.maximum(tl.maximum(tl.abs(c0), tl.abs(c1)), tl.maximum(tl.abs(c2), tl.abs(c3)))
    unit = tl.maximum(unit, 1e-6)  # centroid_unit
    val = tl.load(f8 + pb + OVAL_OFF + i, mask=used, other=0.0).to(tl.float32)
    delta = tl.where(used, val * unit - cent, 0.0)
    return used, first + t, c, delta, pb


@triton.jit
def nuq2_key_fix_eager(pool, page_base, tok0, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                 OIDX_OFF: tl.constexpr, S: tl.constexpr, MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                 T0=None, T1=None, T2=None, T3=None):
    """(A baseline to time nuq2_key_fix against: every chunk's slot loads, layout conversions and a
    cross-warp `any` on every tile, used or not.) Scores of the outlier slots: s[g, t] += q[g, c] *
    scale[c] * delta for each used slot (t, c), 16 slots at a time: corr [G_PAD, 16] @ one-hot of the
    slots' tile columns [16, BLOCK_N].
    A chunk whose slots are all unused is skipped (quantize fills the slots in order)."""
    SC: tl.constexpr = 16
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    for chunk in tl.static_range((S + SC - 1) // SC):
        used, colm, c, delta, pb = _nuq2_slots(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF, OVAL_OFF,
                                              OIDX_OFF, S, T0)
        if tl.max(used.to(tl.int32), axis=0) > 0:
            scale = tl.load(f8 + pb + SCALE_OFF + c).to(tl.float32)
            q_c = tl.load(q_rows + c[None, :], mask=row_ok[:, None] & used[None, :], other=0.0).to(tl.float32)
            corr = q_c * (scale * delta)[None, :]  # [G_PAD, NPG * 16]
            s = add_slot_scores(s, corr, colm, used, BLOCK_N, DOT)
    return s


@triton.jit
def nuq2_value_fix_eager(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                   OIDX_OFF: tl.constexpr, S: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
                   T0=None, T1=None, T2=None, T3=None):
    """(A baseline to time nuq2_value_fix against.) Output of the outlier slots: pv[g, col(c)] +=
    p[g, t] * delta for each used slot (t, c):
    p @ one-hot [BLOCK_N, 16] gathers p at the slots' tokens, times delta, @ one-hot [16, D]
    scatters to their channels' tile columns."""
    SC: tl.constexpr = 16
    for chunk in tl.static_range((S + SC - 1) // SC):
        used, colm, c, delta, pb = _nuq2_slots(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF, OVAL_OFF,
                                              OIDX_OFF, S, T1)
        if tl.max(used.to(tl.int32), axis=0) > 0:
            pv = add_slot_values(pv, p, colm, 4 * (c % (D // 4)) + c // (D // 4), delta, used, D, BLOCK_N, DOT)
    return pv


NUQ2_SLOT_MODES = ("lazy", "first", "eager", "off")


def nuq2_spec(fmt, block_size: int, head_dim: int, slots: str = "lazy") -> DecodeSpec:
    """slots: how the kernel applies the outlier slots. 'lazy' (the default): only the chunks of 16
    slots in use, each behind one uniform branch; 'first': the first chunk on every tile without a
    branch (with 3.5-sigma outliers nearly every page uses it; its loads then need not wait for the
    used-chunk count), the others as 'lazy' (faster, but it spills: docs/decisions.md, "nuq2's outlier
    slots behind a count of the chunks in use"); 'eager': every chunk's loads
    on every tile, a baseline to time against; 'off': not at all, a bound on what the slots cost
    (wrong wherever a slot is used: for benchmarks only).

    Calibrated codebooks (fmt.calibrated): no centroids field; CENT_OFF = NUQ2_TABLE_CENTROIDS and
    the layer's [Hkv, 4] fp16 centroids (key, value) come from `fmt.decode_tables(layer, device)` for
    the cache's layer as DecodeSpec.tables (device copies made on first use)."""
    if slots not in NUQ2_SLOT_MODES:
        raise ValueError(f"nuq2_spec: slots={slots!r}, accepted {NUQ2_SLOT_MODES}")
    key_fix = {"lazy": nuq2_key_fix, "first": nuq2_key_fix_first, "eager": nuq2_key_fix_eager, "off": None}[slots]
    value_fix = {"lazy": nuq2_value_fix, "first": nuq2_value_fix_first, "eager": nuq2_value_fix_eager,
                 "off": None}[slots]
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        n_slots = fmt.outlier_slots(kind, block_size, head_dim)
        cent = NUQ2_TABLE_CENTROIDS if fmt.calibrated else off["centroids"]
        params = (cent, off.get("out_val", 0), off.get("out_idx", 0), n_slots)
        if kind == "key" and fmt.keys_before_rope:  # the whole tile, rotated by the kernel
            readers.append(TileReader(nuq2_key_tile_rope, params + (off["chan_mean"], off["chan_scale"]), planes=4))
        elif kind == "key":
            readers.append(TileReader(nuq2_key_tile, params + (off["chan_mean"], off["chan_scale"]), planes=4,
                                      fold_fn=nuq2_key_fold, fix_fn=key_fix if n_slots else None))
        else:
            readers.append(TileReader(nuq2_value_tile, params, planes=4,
                                      fix_fn=value_fix if n_slots else None))
    rope = fmt.keys_before_rope
    if not fmt.calibrated:
        return DecodeSpec(key=readers[0], value=readers[1], staged=True, residual=fmt.residual, key_rope=rope,
                          **spec_launch("nuq2", block_size))

    def tables(cache):
        return fmt.decode_tables(getattr(cache, "layer", 0), cache["k_pages"].device)

    return DecodeSpec(key=readers[0], value=readers[1], staged=True, residual=fmt.residual, tables=tables,
                      key_rope=rope, **spec_launch("nuq2", block_size))
