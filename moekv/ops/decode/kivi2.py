"""Tile readers of kivi2 pages (moekv/kvcache/formats/kivi2.py) for the paged decode kernel: 2-bit codes, keys
quantized per channel over groups of tokens, values per token over groups of channels; the newest tokens
are read from the format's 16-bit residual ring (DecodeSpec.residual)."""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.codes import packed_codes, per_token_groups
from moekv.ops.decode.common import DecodeSpec, TileReader
from moekv.ops.decode.launch import spec_launch


@triton.jit
def kivi2_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                  GROUP: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 key slab: codes [P, D/4] at 0; scale, zero fp16 [P/GROUP, D] (per channel over
    GROUP tokens, KIVI's G)."""
    codes = packed_codes(pool, base, tok, valid, D, BLOCK_N, 2, ASM)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    d = tl.arange(0, D)
    row = (tok // GROUP) * D  # the token's group row of the [P/GROUP, D] side tables
    scale = tl.load(half + (((base + SCALE_OFF) >> 1) + row)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    zero = tl.load(half + (((base + ZERO_OFF) >> 1) + row)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return codes * scale + zero, valid


@triton.jit
def kivi2_value_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    P: tl.constexpr, ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                    GROUP: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr):
    """kivi2 value slab: codes [P, D/4] at 0; scale, zero fp16 [P, D/GROUP] (per token over
    GROUP channels: G, or the whole head when it is narrower)."""
    codes = packed_codes(pool, base, tok, valid, D, BLOCK_N, 2, ASM)
    return per_token_groups(codes, pool, base, tok, valid, D, BLOCK_N, GROUP, SCALE_OFF, ZERO_OFF), valid


def kivi2_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    return DecodeSpec(key=TileReader(kivi2_key_tile, (koff["scale"], koff["zero"], fmt.group)),
                      value=TileReader(kivi2_value_tile, (voff["scale"], voff["zero"], fmt.value_group(head_dim))),
                      staged=True, residual=fmt.residual, **spec_launch("kivi2", block_size))
