"""Sparse outlier slots in the decode kernel (nuq2, vq): a page's slots (token, channel, value) fixed per
tile after the product, 16 slots at a time through one-hot products (the MMA's smallest K)."""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.common import pow2_at_least

NUQ2_SLOT_CHUNK = 16  # outlier slots handled per one-hot product (the MMA's smallest K)


@triton.jit
def used_slot_chunks(pool, page_base, OIDX_OFF: tl.constexpr, S: tl.constexpr, NPG: tl.constexpr):
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
def slot_chunk_index(page_base, tok0, chunk, BLOCK_N: tl.constexpr, P: tl.constexpr):
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
def add_slot_scores(s, corr, colm, used, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """s [G_PAD, BLOCK_N] plus each used slot's score correction corr [G_PAD, n] at its token's tile
    column colm [n]: corr @ the one-hot of those columns [n, BLOCK_N] (outlier slots of nuq2 and vq)."""
    hit = (colm[:, None] == tl.arange(0, BLOCK_N)[None, :]) & used[:, None]  # [n, BLOCK_N]
    s += tl.dot(corr.to(DOT), tl.where(hit, 1.0, 0.0).to(DOT))
    return s


@triton.jit
def add_slot_values(pv, p, colm, col, delta, used, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """pv [G_PAD, D] plus p [G_PAD, BLOCK_N] at each used slot's token (tile column colm [n]) times its
    delta [n], at its channel's tile column col [n]: p @ one-hot [BLOCK_N, n], times delta, @ one-hot
    [n, D] (outlier slots of nuq2 and vq)."""
    at_tok = (tl.arange(0, BLOCK_N)[:, None] == colm[None, :]) & used[None, :]  # [BLOCK_N, n]
    p_at = tl.dot(p.to(DOT), tl.where(at_tok, 1.0, 0.0).to(DOT))  # [G_PAD, n]
    at_col = (col[:, None] == tl.arange(0, D)[None, :]) & used[:, None]  # [n, D]
    pv += tl.dot((p_at * delta[None, :]).to(DOT), tl.where(at_col, 1.0, 0.0).to(DOT))
    return pv
