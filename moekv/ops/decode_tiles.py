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

from moekv.ops.decode_attention import DecodeSpec, TileReader


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
    scale_ptr = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    return tl.load(scale_ptr + (((base + SCALE_OFF) >> 1) + tok), mask=valid, other=0.0).to(tl.float32)


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
    j = tl.arange(0, D // 2)
    packed = tl.load(pool + (base + tok * (D // 2))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = _unpack_nibbles(packed, ASM)
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
    val = tl.load(bf + (((base + OVAL_OFF) >> 1) + tok * NO + o), mask=valid, other=0.0).to(tl.float32)
    zero = tl.load(half + (((base + ZERO_OFF) >> 1) + tok * NG + ch_tok // GS), mask=valid, other=0.0)
    return ch_page, ch_tok, val - zero.to(tl.float32)


@triton.jit
def kivi_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                  GROUP: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 key slab: codes [P, D/4] at 0; scale, zero fp16 [P/GROUP, D] (per channel over
    GROUP tokens, KIVI's G)."""
    j = tl.arange(0, D // 4)
    packed = tl.load(pool + (base + tok * (D // 4))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = _unpack_crumbs(packed, ASM)
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
    j = tl.arange(0, D // 4)
    packed = tl.load(pool + (base + tok * (D // 4))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = _unpack_crumbs(packed, ASM)
    return _per_token_groups(codes, pool, base, tok, valid, D, BLOCK_N, GROUP, SCALE_OFF, ZERO_OFF), valid


# -- specs: what each format's decode_spec returns ------------------------------------------------
def plain_spec(dtype: torch.dtype) -> DecodeSpec | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 pages keep the reference path
    reader = TileReader(plain_tile)
    return DecodeSpec(key=reader, value=reader, dot_dtype=dtype)


def fp8_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(fp8_key_tile, (koff["scale"],), row_scaled=True),
                      value=TileReader(fp8_value_tile, (voff["scale"],), row_scaled=True), staged=True)


def int4_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        outliers = fmt.num_outliers(head_dim)
        params = (off["scale"], off["zero"], off["outlier_val"], off["outlier_idx"], fmt.group_size, outliers)
        readers.append(TileReader(int4_tile, params, outlier_fn=int4_outliers, outliers=outliers))
    return DecodeSpec(key=readers[0], value=readers[1], staged=True)


def kivi_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(kivi_key_tile, (koff["scale"], koff["zero"], fmt.group)),
                      value=TileReader(kivi_value_tile, (voff["scale"], voff["zero"], fmt.value_group(head_dim))),
                      staged=True, residual=fmt.residual)
