"""Packed low-bit codes to fp16 in registers, for the tile readers of int4, kivi2 and nuq2: 4-bit codes
(two a byte) and 2-bit codes (four a byte), unpacked with inline PTX on the GPU or with plain shifts
(the interpreter's path), and tiles with a side of 16 unpacked column by column (JOIN_FREE_BELOW)."""
from __future__ import annotations

import triton
import triton.language as tl

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


# Tiles with a side of 16 (16 tokens, or a head_dim of 16) unpack without tl.interleave, one byte load per
# column: a join feeding the MMA of such a tile gives wrong products on the H200 (Triton 3.6).
JOIN_FREE_BELOW = tl.constexpr(32)


@triton.jit
def codes_per_column(pool, base, tok, valid, D: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_N, D] int32 codes of each token's packed row, column c from bits (c % K) * BITS of
    byte c // K (K = 8 / BITS codes a byte): the order _unpack_nibbles / _unpack_crumbs give."""
    K: tl.constexpr = 8 // BITS
    c = tl.arange(0, D)
    byte = tl.load(pool + (base + tok * (D // K))[:, None] + (c // K)[None, :], mask=valid[:, None], other=0)
    return (byte.to(tl.int32) >> ((c % K) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def packed_codes(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                  ASM: tl.constexpr):
    """[BLOCK_N, D] fp16 codes of each token's packed row at base + tok * D * BITS / 8 (BITS 4 or 2)."""
    if BLOCK_N < JOIN_FREE_BELOW or D < JOIN_FREE_BELOW:
        codes = codes_per_column(pool, base, tok, valid, D, BITS).to(tl.float16)
    else:
        j = tl.arange(0, D * BITS // 8)
        packed = tl.load(pool + (base + tok * (D * BITS // 8))[:, None] + j[None, :], mask=valid[:, None], other=0)
        if BITS == 4:
            codes = _unpack_nibbles(packed, ASM)
        else:
            codes = _unpack_crumbs(packed, ASM)
    return codes


@triton.jit
def per_token_groups(codes, pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, GS: tl.constexpr,
                      SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr):
    """codes [BLOCK_N, D] fp16 * scale + zero, with fp16 scale and zero [P, D/GS] per (token, group)."""
    NG: tl.constexpr = D // GS
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    g = tl.arange(0, NG)[None, :]
    scale = tl.load(half + (((base + SCALE_OFF) >> 1) + tok * NG)[:, None] + g, mask=valid[:, None], other=0.0)
    zero = tl.load(half + (((base + ZERO_OFF) >> 1) + tok * NG)[:, None] + g, mask=valid[:, None], other=0.0)
    x = tl.reshape(codes, (BLOCK_N, NG, GS)) * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))
