"""Tile readers for the paged decode kernel (moekv/ops/decode_attention.py), one per page layout.

A tile reader loads BLOCK_N tokens of K or V of one KV head — token i sits in row tok[i] of the
slab that starts at element base[i] of `pool` — and dequantizes them in registers:

    fn(pool, base, tok, valid, D, BLOCK_N, P0, P1, P2, P3, P4, P5) -> (x [BLOCK_N, D], row_scale [BLOCK_N] fp32)

P0..P5 are the layout's constexprs (field byte offsets from `PageLayout.offsets`, group sizes).
Invalid tokens must load nothing (mask) and give finite values. A reader whose DecodeSpec marks
it `row_scaled` returns x without a per-token factor and that factor as row_scale; the others
return any [BLOCK_N] tensor there (unused). Readers return fp16 tiles (exact for the codes), or
the pool's own 16-bit dtype for plain pages.

The math of each reader is its format's `dequantize` (the reference), restricted to a tile.
To plug in a new format: write its reader here (or in its own module) and return a DecodeSpec
from the format's `decode_spec`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.decode_attention import DecodeSpec, TileReader


@triton.jit
def plain_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
               P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr,
               P5: tl.constexpr):
    """Uncompressed pages [N, Hkv, P, D] in bf16 / fp16."""
    d = tl.arange(0, D)
    x = tl.load(pool + (base + tok * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return x, valid


@triton.jit
def fp8_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
             SCALE_OFF: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr,
             P5: tl.constexpr):
    """fp8_e4m3 slab: codes e4m3 [P, D] at 0, scale fp16 [P] at SCALE_OFF. E4M3 values are exact
    in fp16, so x is the codes and the scale is the row scale (folded by the kernel)."""
    d = tl.arange(0, D)
    codes_ptr = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    x = tl.load(codes_ptr + (base + tok * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    scale_ptr = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    scale = tl.load(scale_ptr + ((base + SCALE_OFF) >> 1) + tok, mask=valid, other=0.0)
    return x.to(tl.float16), scale.to(tl.float32)


@triton.jit
def int4_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
              SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr,
              GS: tl.constexpr, NO: tl.constexpr):
    """int4 slab: codes uint8 [P, D/2] (even channel in the low nibble) at 0, scale and zero fp16
    [P, D/GS], outlier values bf16 [P, NO], outlier channel indices uint8 [NO]."""
    NG: tl.constexpr = D // GS
    j = tl.arange(0, D // 2)
    packed = tl.load(pool + (base + tok * (D // 2))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, D]: channel 2j from the low nibble
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    g = tl.arange(0, NG)
    side = (tok * NG)[:, None] + g[None, :]  # [BLOCK_N, NG]
    scale = tl.load(half + ((base + SCALE_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    zero = tl.load(half + ((base + ZERO_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    x = codes.to(tl.float16).reshape(BLOCK_N, NG, GS) * scale[:, :, None] + zero[:, :, None]
    x = x.reshape(BLOCK_N, D)
    d = tl.arange(0, D)
    bf = pool.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    for o in tl.static_range(NO):  # outlier channels of each token's page overwrite their column
        idx = tl.load(pool + base + OIDX_OFF + o, mask=valid, other=0).to(tl.int32)
        val = tl.load(bf + ((base + OVAL_OFF) >> 1) + tok * NO + o, mask=valid, other=0.0)
        x = tl.where(d[None, :] == idx[:, None], val.to(tl.float16)[:, None], x)
    return x, valid


@triton.jit
def _unpack_crumbs(packed):
    """[BLOCK_N, D/4] bytes -> [BLOCK_N, D] 2-bit codes, channel 4j+i from bits 2i..2i+1 of byte j."""
    c0 = packed & 3
    c1 = (packed >> 2) & 3
    c2 = (packed >> 4) & 3
    c3 = packed >> 6
    return tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))


@triton.jit
def kivi_key_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, GROUP: tl.constexpr, P3: tl.constexpr,
                  P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 key slab: codes [P, D/4] at 0; scale, zero fp16 [P/GROUP, D] (per channel over
    GROUP tokens)."""
    j = tl.arange(0, D // 4)
    packed = tl.load(pool + (base + tok * (D // 4))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = _unpack_crumbs(packed)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    d = tl.arange(0, D)
    side = ((tok // GROUP) * D)[:, None] + d[None, :]  # [BLOCK_N, D]
    scale = tl.load(half + ((base + SCALE_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    zero = tl.load(half + ((base + ZERO_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    return codes.to(tl.float16) * scale + zero, valid


@triton.jit
def kivi_value_tile(pool, base, tok, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, GROUP: tl.constexpr, P3: tl.constexpr,
                    P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 value slab: codes [P, D/4] at 0; scale, zero fp16 [P, D/GROUP] (per token over
    GROUP channels)."""
    NG: tl.constexpr = D // GROUP
    j = tl.arange(0, D // 4)
    packed = tl.load(pool + (base + tok * (D // 4))[:, None] + j[None, :], mask=valid[:, None], other=0)
    codes = _unpack_crumbs(packed)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    g = tl.arange(0, NG)
    side = (tok * NG)[:, None] + g[None, :]  # [BLOCK_N, NG]
    scale = tl.load(half + ((base + SCALE_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    zero = tl.load(half + ((base + ZERO_OFF) >> 1)[:, None] + side, mask=valid[:, None], other=0.0)
    x = codes.to(tl.float16).reshape(BLOCK_N, NG, GROUP) * scale[:, :, None] + zero[:, :, None]
    return x.reshape(BLOCK_N, D), valid


# -- specs: what each format's decode_spec returns ------------------------------------------------
def plain_spec(dtype: torch.dtype) -> DecodeSpec | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 pages keep the reference path
    reader = TileReader(plain_tile)
    return DecodeSpec(key=reader, value=reader, dot_dtype=dtype)


def fp8_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        readers.append(TileReader(fp8_tile, (off["scale"],), row_scaled=True))
    return DecodeSpec(key=readers[0], value=readers[1], staged=True)


def int4_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        params = (off["scale"], off["zero"], off["outlier_val"], off["outlier_idx"], fmt.group_size,
                  fmt.num_outliers(head_dim))
        readers.append(TileReader(int4_tile, params))
    return DecodeSpec(key=readers[0], value=readers[1], staged=True)


def kivi_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    from moekv.kvcache.formats.kivi import GROUP

    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(kivi_key_tile, (koff["scale"], koff["zero"], GROUP)),
                      value=TileReader(kivi_value_tile, (voff["scale"], voff["zero"], GROUP)),
                      staged=True, residual=fmt.residual)
