"""Tile readers of int4 pages (moekv/kvcache/formats/int4.py) for the paged decode kernel: packed 4-bit codes
with a per-(token, group) scale and zero, and a few bf16 outlier channels per page."""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.codes import packed_codes, per_token_groups
from moekv.ops.decode.common import DecodeSpec, TileReader, pow2_at_least
from moekv.ops.decode.launch import spec_launch


@triton.jit
def int4_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
              ASM: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
              OIDX_OFF: tl.constexpr, GS: tl.constexpr, NO: tl.constexpr):
    """int4 slab: codes uint8 [P, D/2] (even channel in the low nibble) at 0, scale and zero fp16
    [P, D/GS], outlier values bf16 [P, NO], outlier channels uint8 [NO]. The outlier channels'
    codes are 0, so x holds their group's zero there; int4_outliers gives the rest."""
    codes = packed_codes(pool, base, tok, valid, D, BLOCK_N, 4, ASM)
    return per_token_groups(codes, pool, base, tok, valid, D, BLOCK_N, GS, SCALE_OFF, ZERO_OFF), valid


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


def int4_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    readers = []
    for kind in ("key", "value"):
        off = fmt.layout(kind, block_size, head_dim).offsets
        outliers = fmt.num_outliers(head_dim)
        params = (off["scale"], off["zero"], off["outlier_val"], off["outlier_idx"], fmt.group_size, outliers)
        readers.append(TileReader(int4_tile, params, outlier_fn=int4_outliers, outliers=outliers))
    return DecodeSpec(key=readers[0], value=readers[1], staged=True, **spec_launch("int4", block_size))
