"""Tile readers for the paged decode kernel (moekv/ops/decode_attention.py), one per page layout.

A tile is BLOCK_N consecutive tokens of one KV head; it spans NPG = BLOCK_N / min(P, BLOCK_N)
pages. A reader loads the tile's bytes from `pool` and dequantizes them in registers:

    fn(pool, base, tok, page_base, tok0, valid, D, BLOCK_N, P, ASM, P0, P1, P2, P3, P4, P5)
        -> (x [BLOCK_N, D], row_scale [BLOCK_N] fp32)

base is the element offset in `pool` of each token's (page, head) slab ([BLOCK_N], or a scalar
when the tile lies in one page, NPG == 1: write `(base + vector)[:, None]`, never `base[:, None]`)
and tok [BLOCK_N] its row in the page; page_base is the same offset per page ([NPG], or the
scalar) and tok0 the tile's first row in its page (0 when pages are shorter than tiles), for
fields laid out along the tokens. valid masks the
tokens to load (the others must load nothing and give finite values). P0..P5 are the layout's
constexprs (field byte offsets from `PageLayout.offsets`, group sizes). ASM: compiled for an
NVIDIA GPU, so inline PTX is allowed (False under the interpreter, whose plain-Triton path is
what the CPU tests check). A `row_scaled` reader leaves a per-token factor out of x and returns
it as row_scale; the others return any [BLOCK_N] tensor there. Tiles are fp16 (exact for every
code here), or the pool's own 16-bit dtype for plain pages.

An outlier reader (`TileReader.outlier_fn`, called for o in range(outliers)) gives channels whose
exact value differs from what x holds there, one channel per page and slot:

    outlier_fn(pool, base, tok, page_base, tok0, valid, o, D, BLOCK_N, P, P0..P5)
        -> (channel per page [NPG] int32, channel per token [BLOCK_N] int32, delta [BLOCK_N] fp32)
           (both channels scalars when NPG == 1)

The math of each reader is its format's `dequantize` (the reference) restricted to a tile. To
plug in a format: write its readers (here or in its own module) and return a DecodeSpec from the
format's `decode_spec`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.decode_attention import DecodeSpec, TileReader, pow2_at_least


@triton.jit
def plain_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
               ASM: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
               P4: tl.constexpr, P5: tl.constexpr):
    """Uncompressed pages [N, Hkv, P, D] in bf16 / fp16."""
    d = tl.arange(0, D)
    x = tl.load(pool + (base + tok * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return x, valid


@triton.jit
def _fp8_row_scale(pool, base, tok, valid, SCALE_OFF: tl.constexpr):
    """The tokens' fp16 scales, 0 where not valid. Loaded without a mask (a per-token mask splits
    the load into 2-byte pieces, which Triton's pipeliner leaves in the loop, one memory latency a
    tile): every token's row lies in a page that exists (see fp8_value_tile)."""
    scale_ptr = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    scale = tl.load(scale_ptr + (((base + SCALE_OFF) >> 1) + tok)).to(tl.float32)
    return tl.where(valid, scale, 0.0)


@triton.jit
def fp8_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                 ASM: tl.constexpr, SCALE_OFF: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                 P4: tl.constexpr, P5: tl.constexpr):
    """fp8_e4m3 key slab: codes e4m3 [P, D] at 0, scale fp16 [P] at SCALE_OFF. E4M3 values are
    exact in fp16: x is the codes, the scale is the row scale (folded into the scores)."""
    d = tl.arange(0, D)
    codes = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    x = tl.load(codes + (base + tok * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return x.to(tl.float16), _fp8_row_scale(pool, base, tok, valid, SCALE_OFF)


@triton.jit
def fp8_value_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, P1: tl.constexpr,
                   P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """fp8_e4m3 value slab: codes e4m3 [D, P] at 0 (token-major, so the tile enters the P @ V
    product with its reduction dim contiguous and is read from shared memory as whole 8-bit
    rows, not byte by byte), scale fp16 [P] at SCALE_OFF (folded into the probabilities).

    The codes are loaded without a per-token mask, which would split every vector load into
    bytes: a tile reads whole rows of pages that exist (a token past the context, or in a page
    the table does not hold, reads page 0), and those tokens weigh exactly 0 (their scale loads
    as 0). Codes are always finite: quantize clamps to +-448 and pools start zeroed."""
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N
    NPG: tl.constexpr = BLOCK_N // PP
    d = tl.arange(0, D)
    r = tl.arange(0, PP)
    codes = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    if NPG == 1:  # the tile lies in one page: a plain 2-D load
        # slabs are 128-byte aligned and the tile starts at a multiple of BLOCK_N (>= 16) in its
        # page: say so, or the compiler cannot use vector loads
        row0 = tl.multiple_of(page_base + tok0, 16)
        x_t = tl.load(codes + (row0 + (d * P)[:, None] + r[None, :]))  # [D, BLOCK_N]
    else:
        offs = page_base[None, :, None] + (d * P)[:, None, None] + r[None, None, :]  # [D, NPG, PP]
        x_t = tl.reshape(tl.load(codes + offs), (D, BLOCK_N))
    return tl.trans(x_t.to(tl.float16)), _fp8_row_scale(pool, base, tok, valid, SCALE_OFF)


# Inline PTX that turns packed codes into fp16 with integer ops on whole 32-bit registers: a code c
# OR-ed into the mantissa of 1024.0 (0x6400) is the fp16 1024 + c * 2^k; one packed fp16x2 sub or
# fma then gives c exactly, for two codes per instruction. pack=4: each asm call gets 4 bytes
# b0..b3 in one register; prmt spreads (b0, b1) and (b2, b3) to the two 16-bit halves.
_NIBBLES_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, m, s, o;
prmt.b32 t0, $4, $4, 0x1110;
prmt.b32 t1, $4, $4, 0x3332;
mov.b32 m, 0x64006400;
mov.b32 s, 0x2C002C00;
mov.b32 o, 0xD400D400;
lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
fma.rn.f16x2 $2, $2, s, o;
fma.rn.f16x2 $3, $3, s, o;
}
""")  # $0,$1: low nibbles of b0..b3 (1024 + c - 1024); $2,$3: high nibbles ((1024 + 16c) / 16 - 64)

_CRUMBS_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, m, s1, o1, s2, o2, s3, o3;
prmt.b32 t0, $8, $8, 0x1110;
prmt.b32 t1, $8, $8, 0x3332;
mov.b32 m, 0x64006400;
mov.b32 s1, 0x34003400;
mov.b32 o1, 0xDC00DC00;
mov.b32 s2, 0x2C002C00;
mov.b32 o2, 0xD400D400;
mov.b32 s3, 0x24002400;
mov.b32 o3, 0xCC00CC00;
lop3.b32 $0, t0, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $1, t1, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $2, t0, 0x000C000C, 0x64006400, 0xEA;
lop3.b32 $3, t1, 0x000C000C, 0x64006400, 0xEA;
lop3.b32 $4, t0, 0x00300030, 0x64006400, 0xEA;
lop3.b32 $5, t1, 0x00300030, 0x64006400, 0xEA;
lop3.b32 $6, t0, 0x00C000C0, 0x64006400, 0xEA;
lop3.b32 $7, t1, 0x00C000C0, 0x64006400, 0xEA;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
fma.rn.f16x2 $2, $2, s1, o1;
fma.rn.f16x2 $3, $3, s1, o1;
fma.rn.f16x2 $4, $4, s2, o2;
fma.rn.f16x2 $5, $5, s2, o2;
fma.rn.f16x2 $6, $6, s3, o3;
fma.rn.f16x2 $7, $7, s3, o3;
}
""")  # bits 2i..2i+1 of each byte -> code i: (1024 + 4^i c) / 4^i - 1024 / 4^i


@triton.jit
def _unpack_nibbles(packed, ASM: tl.constexpr):
    """[BLOCK_N, D/2] bytes -> [BLOCK_N, D] fp16 codes, channel 2j from the low nibble of byte j."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_PTX, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo = (packed & 0xF).to(tl.float16)
        hi = (packed >> 4).to(tl.float16)
    return tl.interleave(lo, hi)


@triton.jit
def _unpack_crumbs(packed, ASM: tl.constexpr):
    """[BLOCK_N, D/4] bytes -> [BLOCK_N, D] fp16 2-bit codes, channel 4j+i from bits 2i..2i+1 of byte j."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_CRUMBS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
    else:
        c0 = (packed & 3).to(tl.float16)
        c1 = ((packed >> 2) & 3).to(tl.float16)
        c2 = ((packed >> 4) & 3).to(tl.float16)
        c3 = (packed >> 6).to(tl.float16)
    return tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))


# Tiles with a side of 16 (16 tokens, or a head_dim of 16) unpack without tl.interleave: on the H200
# (Triton 3.6) a join feeding the MMA of a 16-token tile gave wrong products in the decode loop (int4,
# nuq2 and tiered, every head_dim, warps, stages and page size tried), while the same readers stored
# to memory, a lone join + dot, and tiles of 32 or more were right (results/h200/probe_tile16*.txt,
# NOTES session 6); calibrated nuq2 at head_dim 16 failed the same way. Each column then loads its
# own byte (every byte two or four times, from L1): slower, but only tiles of 16 tokens (pages of 16)
# or 16 channels use it.
JOIN_FREE_BELOW = tl.constexpr(32)


@triton.jit
def _codes_per_column(pool, base, tok, valid, D: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_N, D] int32 codes of each token's packed row, column c from bits (c % K) * BITS of
    byte c // K (K = 8 / BITS codes a byte): the order _unpack_nibbles / _unpack_crumbs give."""
    K: tl.constexpr = 8 // BITS
    c = tl.arange(0, D)
    byte = tl.load(pool + (base + tok * (D // K))[:, None] + (c // K)[None, :], mask=valid[:, None], other=0)
    return (byte.to(tl.int32) >> ((c % K) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _packed_codes(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                  ASM: tl.constexpr):
    """[BLOCK_N, D] fp16 codes of each token's packed row at base + tok * D * BITS / 8 (BITS 4 or 2)."""
    if BLOCK_N < JOIN_FREE_BELOW or D < JOIN_FREE_BELOW:
        codes = _codes_per_column(pool, base, tok, valid, D, BITS).to(tl.float16)
    else:
        j = tl.arange(0, D * BITS // 8)
        packed = tl.load(pool + (base + tok * (D * BITS // 8))[:, None] + j[None, :], mask=valid[:, None], other=0)
        if BITS == 4:
            codes = _unpack_nibbles(packed, ASM)
        else:
            codes = _unpack_crumbs(packed, ASM)
    return codes


@triton.jit
def _per_token_groups(codes, pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, GS: tl.constexpr,
                      SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr):
    """codes [BLOCK_N, D] fp16 * scale + zero, with fp16 scale and zero [P, D/GS] per (token, group)."""
    NG: tl.constexpr = D // GS
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    g = tl.arange(0, NG)[None, :]
    scale = tl.load(half + (((base + SCALE_OFF) >> 1) + tok * NG)[:, None] + g, mask=valid[:, None], other=0.0)
    zero = tl.load(half + (((base + ZERO_OFF) >> 1) + tok * NG)[:, None] + g, mask=valid[:, None], other=0.0)
    x = tl.reshape(codes, (BLOCK_N, NG, GS)) * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))


@triton.jit
def int4_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
              ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
              OIDX_OFF: tl.constexpr, GS: tl.constexpr, NO: tl.constexpr):
    """int4 slab: codes uint8 [P, D/2] (even channel in the low nibble) at 0, scale and zero fp16
    [P, D/GS], outlier values bf16 [P, NO], outlier channels uint8 [NO]. The outlier channels'
    codes are 0, so x holds their group's zero there; int4_outliers gives the rest."""
    codes = _packed_codes(pool, base, tok, valid, D, BLOCK_N, 4, ASM)
    return _per_token_groups(codes, pool, base, tok, valid, D, BLOCK_N, GS, SCALE_OFF, ZERO_OFF), valid


@triton.jit
def int4_outliers(pool, base, tok, page_base, tok0, valid, o, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  P: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                  OIDX_OFF: tl.constexpr, GS: tl.constexpr, NO: tl.constexpr):
    """Outlier slot o of each page: its channel, and per token the bf16 value minus the zero that
    int4_tile left at that channel."""
    NG: tl.constexpr = D // GS
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    ch_page = tl.load(pool + page_base + OIDX_OFF + o).to(tl.int32)  # [NPG] or scalar
    if NPG == 1:
        ch_tok = ch_page  # one page: the same channel for every token
    else:
        ch_tok = tl.load(pool + (base + OIDX_OFF + o), mask=valid, other=0).to(tl.int32)  # [BLOCK_N]
    bf = pool.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    # whole rows (every slot's value, every group's zero), selected in registers: contiguous loads
    # without a per-token mask, which Triton pipelines, and none waits for the channel load (rows
    # of tokens past the context lie in pages that exist, as in fp8_value_tile; they weigh 0)
    slot = tl.arange(0, pow2_at_least(NO))
    g = tl.arange(0, NG)
    vals = tl.load(bf + (((base + OVAL_OFF) >> 1) + tok * NO)[:, None] + slot[None, :], mask=(slot < NO)[None, :],
                   other=0.0).to(tl.float32)
    zeros = tl.load(half + (((base + ZERO_OFF) >> 1) + tok * NG)[:, None] + g[None, :]).to(tl.float32)
    val = tl.sum(tl.where(slot[None, :] == o, vals, 0.0), axis=1)
    if NPG == 1:
        zero = tl.sum(tl.where(g[None, :] == ch_tok // GS, zeros, 0.0), axis=1)
    else:
        zero = tl.sum(tl.where(g[None, :] == (ch_tok // GS)[:, None], zeros, 0.0), axis=1)
    return ch_page, ch_tok, tl.where(valid, val - zero, 0.0)


@triton.jit
def kivi_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                  GROUP: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 key slab: codes [P, D/4] at 0; scale, zero fp16 [P/GROUP, D] (per channel over
    GROUP tokens, KIVI's G)."""
    codes = _packed_codes(pool, base, tok, valid, D, BLOCK_N, 2, ASM)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    d = tl.arange(0, D)
    row = (tok // GROUP) * D  # the token's group row of the [P/GROUP, D] side tables
    scale = tl.load(half + (((base + SCALE_OFF) >> 1) + row)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    zero = tl.load(half + (((base + ZERO_OFF) >> 1) + row)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return codes * scale + zero, valid


@triton.jit
def kivi_value_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                    GROUP: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 value slab: codes [P, D/4] at 0; scale, zero fp16 [P, D/GROUP] (per token over
    GROUP channels: G, or the whole head when it is narrower)."""
    codes = _packed_codes(pool, base, tok, valid, D, BLOCK_N, 2, ASM)
    return _per_token_groups(codes, pool, base, tok, valid, D, BLOCK_N, GROUP, SCALE_OFF, ZERO_OFF), valid


# -- specs: what each format's decode_spec returns ------------------------------------------------
# L2 prefetch distance (tiles ahead) of each format's spec, the best of 1 and 2 over the benchmark's
# six points on the H200 (results/h200/decode_attention.json: 5-15% at batch >= 16 and 1 x 128k);
# plain pages take none (their loads are all pipelined already, and prefetching slowed batch 64 by 6-20%),
# nor does fp8 with its doubled splits (below: its best launches all had prefetch off)
PREFETCH = {"fp8_e4m3": 0, "int4": 2, "kivi2": 1, "nuq2": 2}
# fp8 runs twice num_splits_for's splits: its best launch at every one of the six points (11-32%
# faster than the single count with prefetch 2, session 7's results/h200/decode_attention.json);
# it reads half bf16's bytes a tile, so more, shorter programs keep more loads in flight. Since
# session 12 the launcher chooses splits by the compiled kernel's programs per SM (wave_splits);
# the factor only serves launches whose occupancy is unknown (the interpreter).
# swap_ab (scores as k @ q^T): fp8, int4, nuq2 and vq, session 12's sweep
# (results/h200/decode_attention_splits_*.json: at whole waves fp8 311 against 339 us at (16, 32k),
# int4 607 against 688, vq 1162 against 1271, nuq2 -1%); bf16 and kivi2 keep q @ k^T (no gain)
FP8_SPLIT_FACTOR = 2
# fp8 capped at 80 registers (96 without): 6 programs per SM instead of 5, no spills (sm_90 SASS),
# 0.312 -> 0.291 ms at (16, 32k), 85.9 -> 81.7 us at (1, 128k), 1.209 -> 1.129 ms at (64, 32k)
# (session 12, results/h200/decode_attention_fp8_maxnreg.json); 72 spills
FP8_MAX_REGISTERS = 80
# the other formats' caps (session 13, results/h200/decode_attention_caps_session13_*.json, the
# default launch at (16, 32k), (1, 128k), (64, 32k)): int4 126 -> 96 registers (4 -> 5 programs per SM, 32 B
# of spills) 2-4% faster, vq 120 -> 96 (4 -> 5, 48 B) 9-10%, nuq2 196 -> 168 (2 -> 3, 120 B) 15-16%;
# the spills are loop invariants reloaded from L1, cheaper than the idle issue slots they buy back;
# tiered's kernel (decode_tiered.py) 255 -> 168 (2 -> 3, 416 B: 64 local loads a tile) 9-10%
MAX_REGISTERS = {"fp8_e4m3": FP8_MAX_REGISTERS, "int4": 96, "vq": 96, "nuq2": 168, "tiered": 168}
# measured with pages of 64 (the engine's default for compressed formats): tiles inside one page.
# With pages of 16 a tile of 64 spans 4 pages and needs more registers: the same caps spill 132 B
# (int4) to 948 B (vq) a tile there, so smaller pages keep ptxas's choice (fp8 does not spill there)
CAPPED_MIN_PAGE = 64
# fp8 keeps the 16-bit tail's own program (DecodeSpec.tail_in_last_split): with the tail after its
# pages its kernel (80 registers) spilled 16 B and ran 2.6-3% slower at (16, 32k) and (1, 128k), on
# one machine (session 14, results/h200/decode_attention_tail_session14_old_new.json). The other
# formats read it in the last split: at 1 x 4k tiered -9%, int4 -6%; within 1% elsewhere, but int4
# +1.6% at (1, 128k)
FP8_TAIL_IN_LAST_SPLIT = False


def register_cap(fmt_name: str, block_size: int) -> int | None:
    """DecodeSpec.max_registers of a format at this page size (None: ptxas's own choice); for
    tiered, its launcher's default."""
    if fmt_name == "fp8_e4m3" or block_size >= CAPPED_MIN_PAGE:
        return MAX_REGISTERS.get(fmt_name)
    return None


def plain_spec(dtype: torch.dtype) -> DecodeSpec | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 pages keep the reference path
    reader = TileReader(plain_tile)
    return DecodeSpec(key=reader, value=reader, dot_dtype=dtype)


def fp8_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(fp8_key_tile, (koff["scale"],), row_scaled=True),
                      value=TileReader(fp8_value_tile, (voff["scale"],), row_scaled=True), staged=True,
                      prefetch=PREFETCH["fp8_e4m3"], split_factor=FP8_SPLIT_FACTOR, swap_ab=True,
                      max_registers=register_cap("fp8_e4m3", block_size), tail_in_last_split=FP8_TAIL_IN_LAST_SPLIT)


def int4_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        outliers = fmt.num_outliers(head_dim)
        params = (off["scale"], off["zero"], off["outlier_val"], off["outlier_idx"], fmt.group_size, outliers)
        readers.append(TileReader(int4_tile, params, outlier_fn=int4_outliers, outliers=outliers))
    return DecodeSpec(key=readers[0], value=readers[1], staged=True, prefetch=PREFETCH["int4"], swap_ab=True,
                      max_registers=register_cap("int4", block_size))


def kivi_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(kivi_key_tile, (koff["scale"], koff["zero"], fmt.group)),
                      value=TileReader(kivi_value_tile, (voff["scale"], voff["zero"], fmt.value_group(head_dim))),
                      staged=True, residual=fmt.residual, prefetch=PREFETCH["kivi2"])


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
# passed (their defaults are None) and the code is what it was.
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
    QD: tl.constexpr = D // 4
    if BLOCK_N < JOIN_FREE_BELOW or D < JOIN_FREE_BELOW:  # no tl.interleave (see JOIN_FREE_BELOW)
        c0, c1, c2, c3 = _nuq2_centroids(pool, base, tok, valid, CENT_OFF, NPG, CB)
        x = _nuq2_select(_codes_per_column(pool, base, tok, valid, D, 2), c0, c1, c2, c3, NPG, CENT_OFF)
    else:
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
        x = tl.interleave(tl.interleave(x0, x2), tl.interleave(x1, x3))
    return x


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


NUQ2_SLOT_CHUNK = 16  # outlier slots handled per one-hot product (the MMA's smallest K)


@triton.jit
def _nuq2_used_chunks(pool, page_base, OIDX_OFF: tl.constexpr, S: tl.constexpr, NPG: tl.constexpr):
    """How many 16-slot chunks the tile's pages use (the most of any page): quantize fills the slots
    in order, so chunk k is in use iff its first slot is. One small load of each chunk's first
    position; a uniform scalar, so that unused chunks cost a compare and a branch."""
    SC: tl.constexpr = 16
    NCP: tl.constexpr = pow2_at_least((S + SC - 1) // SC + 1)  # a power of two above the chunk count
    u16 = pool.to(tl.pointer_type(tl.uint16), bitcast=True)
    i = tl.arange(0, NCP) * SC
    if NPG == 1:
        first = tl.load(u16 + ((page_base + OIDX_OFF) >> 1) + i, mask=i < S, other=0xFFFF).to(tl.int32)
        n = tl.sum((first != 0xFFFF).to(tl.int32), axis=0)
    else:
        first = tl.load(u16 + ((page_base + OIDX_OFF) >> 1)[:, None] + i[None, :], mask=(i < S)[None, :],
                        other=0xFFFF).to(tl.int32)  # [NPG, NCP]
        n = tl.max(tl.sum((first != 0xFFFF).to(tl.int32), axis=1), axis=0)
    return n


@triton.jit
def _slot_chunk_index(page_base, tok0, chunk, BLOCK_N: tl.constexpr, P: tl.constexpr):
    """Outlier slots [chunk * 16, chunk * 16 + 16) of each page of the tile (nuq2, vq), flattened to
    [NPG * 16]: (i, the slot's index in its page's slot arrays; pb, its page's slab offset, a scalar
    when the tile lies in one page; first, the tile column of its page's row 0)."""
    SC: tl.constexpr = 16
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    i = chunk * SC + tl.arange(0, SC)
    if NPG == 1:
        pb = page_base
        first = tl.zeros([SC], tl.int32) - tok0  # the tile's column of a page row t is t - tok0
    else:
        pb = tl.reshape(tl.broadcast_to(page_base[:, None], (NPG, SC)), (NPG * SC,))
        first = tl.reshape(tl.broadcast_to((tl.arange(0, NPG) * P)[:, None], (NPG, SC)), (NPG * SC,))
        i = tl.reshape(tl.broadcast_to(i[None, :], (NPG, SC)), (NPG * SC,))
    return i, pb, first


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
    i, pb, first = _slot_chunk_index(page_base, tok0, chunk, BLOCK_N, P)
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
def _add_slot_scores(s, corr, colm, used, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """s [G_PAD, BLOCK_N] plus each used slot's score correction corr [G_PAD, n] at its token's tile
    column colm [n]: corr @ the one-hot of those columns [n, BLOCK_N] (outlier slots of nuq2 and vq)."""
    hit = (colm[:, None] == tl.arange(0, BLOCK_N)[None, :]) & used[:, None]  # [n, BLOCK_N]
    s += tl.dot(corr.to(DOT), tl.where(hit, 1.0, 0.0).to(DOT))
    return s


@triton.jit
def _add_slot_values(pv, p, colm, col, delta, used, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """pv [G_PAD, D] plus p [G_PAD, BLOCK_N] at each used slot's token (tile column colm [n]) times its
    delta [n], at its channel's tile column col [n]: p @ one-hot [BLOCK_N, n], times delta, @ one-hot
    [n, D] (outlier slots of nuq2 and vq)."""
    at_tok = (tl.arange(0, BLOCK_N)[:, None] == colm[None, :]) & used[None, :]  # [BLOCK_N, n]
    p_at = tl.dot(p.to(DOT), tl.where(at_tok, 1.0, 0.0).to(DOT))  # [G_PAD, n]
    at_col = (col[:, None] == tl.arange(0, D)[None, :]) & used[:, None]  # [n, D]
    pv += tl.dot((p_at * delta[None, :]).to(DOT), tl.where(at_col, 1.0, 0.0).to(DOT))
    return pv


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
    chunks = _nuq2_used_chunks(pool, page_base, OIDX_OFF, S, NPG)
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
    i, pb, first = _slot_chunk_index(page_base, tok0, 0, BLOCK_N, P)
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
    return _add_slot_scores(s, corr, colm, used, BLOCK_N, DOT)


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
    chunks = _nuq2_used_chunks(pool, page_base, OIDX_OFF, S, NPG)
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
    return _add_slot_values(pv, p, colm, 4 * (c % (D // 4)) + c // (D // 4), delta, used, D, BLOCK_N, DOT)


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
    """(The first version, kept for timing beside nuq2_key_fix: every chunk's slot loads, layout
    conversions and a cross-warp `any` ran on every tile, used or not.) Scores of the outlier slots: s[g, t] += q[g, c] * scale[c] * delta for each used slot (t, c),
    16 slots at a time: corr [G_PAD, 16] @ one-hot of the slots' tile columns [16, BLOCK_N].
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
            s = _add_slot_scores(s, corr, colm, used, BLOCK_N, DOT)
    return s


@triton.jit
def nuq2_value_fix_eager(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, DOT: tl.constexpr, CENT_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                   OIDX_OFF: tl.constexpr, S: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
                   T0=None, T1=None, T2=None, T3=None):
    """(The first version, kept for timing beside nuq2_value_fix.) Output of the outlier slots: pv[g, col(c)] += p[g, t] * delta for each used slot (t, c):
    p @ one-hot [BLOCK_N, 16] gathers p at the slots' tokens, times delta, @ one-hot [16, D]
    scatters to their channels' tile columns."""
    SC: tl.constexpr = 16
    for chunk in tl.static_range((S + SC - 1) // SC):
        used, colm, c, delta, pb = _nuq2_slots(pool, page_base, tok0, chunk, D, BLOCK_N, P, CENT_OFF, OVAL_OFF,
                                              OIDX_OFF, S, T1)
        if tl.max(used.to(tl.int32), axis=0) > 0:
            pv = _add_slot_values(pv, p, colm, 4 * (c % (D // 4)) + c // (D // 4), delta, used, D, BLOCK_N, DOT)
    return pv


NUQ2_SLOT_MODES = ("lazy", "first", "eager", "off")


def nuq2_spec(fmt, block_size: int, head_dim: int, slots: str = "lazy") -> DecodeSpec:
    """slots: how the kernel applies the outlier slots. 'lazy' (the default): only the chunks of 16
    slots in use, each behind one uniform branch; 'first': the first chunk on every tile without a
    branch (with 3.5-sigma outliers nearly every page uses it; its loads then need not wait for the
    used-chunk count), the others as 'lazy' (a candidate, not yet timed); 'eager': the first version (every chunk's loads
    on every tile), kept to time beside it; 'off': not at all, a bound on what the slots cost
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
        if kind == "key":
            readers.append(TileReader(nuq2_key_tile, params + (off["chan_mean"], off["chan_scale"]), planes=4,
                                      fold_fn=nuq2_key_fold, fix_fn=key_fix if n_slots else None))
        else:
            readers.append(TileReader(nuq2_value_tile, params, planes=4,
                                      fix_fn=value_fix if n_slots else None))
    if not fmt.calibrated:
        return DecodeSpec(key=readers[0], value=readers[1], staged=True, prefetch=PREFETCH["nuq2"], swap_ab=True,
                          max_registers=register_cap("nuq2", block_size))

    def tables(cache):
        return fmt.decode_tables(getattr(cache, "layer", 0), cache["k_pages"].device)

    return DecodeSpec(key=readers[0], value=readers[1], staged=True, tables=tables, prefetch=PREFETCH["nuq2"],
                      swap_ab=True, max_registers=register_cap("nuq2", block_size))
