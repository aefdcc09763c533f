"""Tile readers of fp8_e4m3 pages (moekv/kvcache/formats/fp8.py) for the paged decode kernel: codes with a
per-token fp16 scale, row-scaled (the scale is folded into the scores for keys, the probabilities for values)."""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.common import DecodeSpec, TileReader
from moekv.ops.decode.launch import spec_launch


@triton.jit
def fp8_row_scale(pool, base, tok, valid, SCALE_OFF: tl.constexpr):
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
    return x.to(tl.float16), fp8_row_scale(pool, base, tok, valid, SCALE_OFF)


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
    return tl.trans(x_t.to(tl.float16)), fp8_row_scale(pool, base, tok, valid, SCALE_OFF)


def fp8_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(fp8_key_tile, (koff["scale"],), row_scaled=True),
                      value=TileReader(fp8_value_tile, (voff["scale"],), row_scaled=True), staged=True,
                      **spec_launch("fp8_e4m3", block_size))
