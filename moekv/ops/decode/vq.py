"""Tile readers of the vq format (moekv/kvcache/formats/vq.py) for the paged decode kernel.

vq slab of one (page, kv head), block_size P, head_dim D, SUB channels per code (8):
  codes      uint8  [P, D/SUB]  one code per SUB-channel subvector (a row of a 256-entry codebook)
  tok_scale  fp16   [P]         per-token RMS
  chan_mean  fp8    [D]         keys only: the page's channel means
  out_val    fp8    [S]         outlier slots (unit-RMS units), out_idx uint16 [S] (t * D + c, 0xFFFF unused)

The codebooks ([Hkv, D/SUB, 256, SUB] fp16 per layer and K/V) and the keys' channel scales
([Hkv, D] fp32) are calibration tables outside the pages: the spec hands them to the kernel as
`DecodeSpec.tables` (k codebook, key chan_scale, v codebook), and every hook gets their pointers at
its program's KV head as the trailing arguments T0, T1, T2, T3.

What the kernel computes is `VQFormat.dequantize` restricted to a tile:
  u = codebook rows of the codes (outlier slots overwrite single elements of u)
  values: x = u * tok_scale                   (row-scaled reader: tok_scale goes into the probabilities)
  keys:   x = u * tok_scale * chan_scale + chan_mean
For a key tile inside one page, the reader returns u * tok_scale (fp16) and `vq_key_fold` moves
the channel affine into q: q . x = (q * chan_scale) . (u * tok_scale) + q . chan_mean. The outlier
slots are per-tile corrections (`fix_fn`): for a slot (t, c) the exact element minus what the tile
holds, tok_scale[t] * (val - u[t, c]) (times chan_scale[c] for keys), enters the scores as
q[:, c] * delta (keys) or the output as p[:, t] * delta at column c (values), 16 slots per one-hot
product, only for the chunks of 16 slots in use (quantize fills the slots in order).

The lookup is a gather from the codebook (L1/L2 resident: 64 KB per head for D = 128): one
16-byte load per SUB = 8 elements.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.decode.common import DecodeSpec, TileReader
from moekv.ops.decode.launch import spec_launch
from moekv.ops.decode.rope import add_slot_elements, rope_pair
from moekv.ops.decode.slots import (
    add_slot_scores,
    add_slot_values,
    slot_chunk_index,
    used_slot_chunks,
)

CODEBOOK_SIZE = tl.constexpr(256)


SLOT_CHUNK = 16  # outlier slots per one-hot product (the MMA's smallest K)


@triton.jit
def _vq_lookup(pool, base, tok, valid, CB, D: tl.constexpr, BLOCK_N: tl.constexpr, NPG: tl.constexpr,
               SUB: tl.constexpr):
    """[BLOCK_N, D] fp16 codebook rows of the tile's codes (CB: the head's codebooks [D/SUB, 256, SUB])."""
    NS: tl.constexpr = D // SUB
    j = tl.arange(0, NS)
    if NPG == 1:  # rows of one full page: every code is a code, no mask
        codes = tl.load(pool + (base + tok * NS)[:, None] + j[None, :])
    else:
        codes = tl.load(pool + (base + tok * NS)[:, None] + j[None, :], mask=valid[:, None], other=0)
    e = tl.arange(0, SUB)
    row = (j[None, :] * CODEBOOK_SIZE + codes.to(tl.int32)) * SUB  # [BLOCK_N, NS]
    u = tl.load(CB + row[:, :, None] + e[None, None, :])  # [BLOCK_N, NS, SUB]: one vector load per code
    return tl.reshape(u, (BLOCK_N, D))


@triton.jit
def _vq_tok_scale(pool, base, tok, valid, TOK_OFF: tl.constexpr):
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    return tl.load(half + (((base + TOK_OFF) >> 1) + tok), mask=valid, other=0.0)


@triton.jit
def vq_key_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                ASM: tl.constexpr, TOK_OFF: tl.constexpr, MEAN_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
                OIDX_OFF: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, T0, T1, T2, T3):
    """Keys: u * tok_scale (fp16) for a tile inside one page (vq_key_fold applies the channel
    affine to q); u * tok_scale * chan_scale + chan_mean (fp32) for a tile over several pages."""
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    u = _vq_lookup(pool, base, tok, valid, T0, D, BLOCK_N, NPG, SUB)
    ts = _vq_tok_scale(pool, base, tok, valid, TOK_OFF)
    if NPG == 1:
        x = u * ts[:, None]
    else:
        d = tl.arange(0, D)
        cs = tl.load(T1 + d).to(tl.float32)
        f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
        mean = tl.load(f8 + (base + MEAN_OFF)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        x = u.to(tl.float32) * ts.to(tl.float32)[:, None] * cs[None, :] + mean.to(tl.float32)
    return x, valid


@triton.jit
def _vq_lookup_half(pool, base, tok, valid, CB, HALF: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    NPG: tl.constexpr, SUB: tl.constexpr):
    """[BLOCK_N, D/2] fp16 codebook rows of the first (HALF 0) or second (HALF 1) half of the tile's
    channel groups: column j is channel HALF * D/2 + j."""
    NS: tl.constexpr = D // SUB
    NH: tl.constexpr = NS // 2
    j = HALF * NH + tl.arange(0, NH)
    if NPG == 1:
        codes = tl.load(pool + (base + tok * NS)[:, None] + j[None, :])
    else:
        codes = tl.load(pool + (base + tok * NS)[:, None] + j[None, :], mask=valid[:, None], other=0)
    e = tl.arange(0, SUB)
    row = (j[None, :] * CODEBOOK_SIZE + codes.to(tl.int32)) * SUB  # [BLOCK_N, NH]
    u = tl.load(CB + row[:, :, None] + e[None, None, :])  # [BLOCK_N, NH, SUB]
    return tl.reshape(u, (BLOCK_N, D // 2))


@triton.jit
def _vq_key_half(pool, base, page_base, tok0, valid, u, ts, HALF: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, P: tl.constexpr, TOK_OFF: tl.constexpr, MEAN_OFF: tl.constexpr,
                 OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, T0, T1):
    """Half HALF of a key tile as `dequantize` gives it, [BLOCK_N, D/2] fp32: u * tok_scale, the
    outlier slots of its channels written in, times chan_scale plus the page's channel means."""
    SC: tl.constexpr = 16
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    D2: tl.constexpr = D // 2
    x = u.to(tl.float32) * ts[:, None]
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < chunks:
            used, colm, c, delta = _vq_slot_chunk(pool, page_base, tok0, chunk, T0, D, BLOCK_N, P, TOK_OFF,
                                                  OVAL_OFF, OIDX_OFF, S, SUB)
            x = add_slot_elements(x, colm, tl.where(c // D2 == HALF, c % D2, -1), delta, used, BLOCK_N, D2)
    ch = HALF * D2 + tl.arange(0, D2)
    cs = tl.load(T1 + ch).to(tl.float32)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    if NPG == 1:
        mean = tl.load(f8 + (base + MEAN_OFF) + ch)[None, :]
    else:
        mean = tl.load(f8 + (base + MEAN_OFF)[:, None] + ch[None, :], mask=valid[:, None], other=0.0)
    return x * cs[None, :] + mean.to(tl.float32)


@triton.jit
def vq_key_tile_rope(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     P: tl.constexpr, ASM: tl.constexpr, TOK_OFF: tl.constexpr, MEAN_OFF: tl.constexpr,
                     OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr,
                     pos, log2_theta, T0, T1, T2, T3):
    """Keys stored before RoPE (DecodeSpec.key_rope): the tile as `dequantize` gives it, rotated by
    RoPE at the tokens' positions pos [BLOCK_N], fp32, in 2 planes (column 2j + h: channel h*D/2 + j,
    TileReader.planes = 2). The two halves of the channel groups are looked up apart, so that each
    rotary pair (j, j + D/2) is one element of each; neither the affine nor the slots can go into q
    or the scores, as vq_key_fold and vq_key_fix put them for keys stored after RoPE."""
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    ts = _vq_tok_scale(pool, base, tok, valid, TOK_OFF).to(tl.float32)
    lo = _vq_key_half(pool, base, page_base, tok0, valid, _vq_lookup_half(pool, base, tok, valid, T0, 0, D, BLOCK_N,
                                                                          NPG, SUB),
                      ts, 0, D, BLOCK_N, P, TOK_OFF, MEAN_OFF, OVAL_OFF, OIDX_OFF, S, SUB, T0, T1)
    hi = _vq_key_half(pool, base, page_base, tok0, valid, _vq_lookup_half(pool, base, tok, valid, T0, 1, D, BLOCK_N,
                                                                          NPG, SUB),
                      ts, 1, D, BLOCK_N, P, TOK_OFF, MEAN_OFF, OVAL_OFF, OIDX_OFF, S, SUB, T0, T1)
    lo, hi = rope_pair(lo, hi, pos[:, None], tl.arange(0, D // 2)[None, :], log2_theta, D, ASM)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, D)), valid


@triton.jit
def vq_key_fold(pool, page_base, q, D: tl.constexpr, P: tl.constexpr, TOK_OFF: tl.constexpr,
                MEAN_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr,
                SUB: tl.constexpr, T0, T1, T2, T3):
    """q . (y * chan_scale + chan_mean) = (q * chan_scale) . y + q . chan_mean -> (q * chan_scale, q . chan_mean)."""
    d = tl.arange(0, D)
    cs = tl.load(T1 + d).to(tl.float32)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    mean = tl.load(f8 + (page_base + MEAN_OFF) + d).to(tl.float32)
    return q * cs[None, :], tl.sum(q * mean[None, :], axis=1)


@triton.jit
def vq_value_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                  ASM: tl.constexpr, TOK_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr,
                  S: tl.constexpr, SUB: tl.constexpr, P5: tl.constexpr, T0, T1, T2, T3):
    """Values: u, with tok_scale as the row scale (folded into the probabilities by the kernel)."""
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    u = _vq_lookup(pool, base, tok, valid, T2, D, BLOCK_N, NPG, SUB)
    return u, _vq_tok_scale(pool, base, tok, valid, TOK_OFF).to(tl.float32)


@triton.jit
def _vq_slot_chunk(pool, page_base, tok0, chunk, CB, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                   TOK_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr, S: tl.constexpr,
                   SUB: tl.constexpr):
    """Slots [chunk * 16, chunk * 16 + 16) of each page of the tile, flattened to [NPG * 16]:
    (used, tile column of the slot's token, channel, tok_scale * (slot value - codebook element
    under it); 0 where unused)."""
    NS: tl.constexpr = D // SUB
    i, pb, first = slot_chunk_index(page_base, tok0, chunk, BLOCK_N, P)
    u16 = pool.to(tl.pointer_type(tl.uint16), bitcast=True)
    half = pool.to(tl.pointer_type(tl.float16), bitcast=True)
    f8 = pool.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    idx = tl.load(u16 + ((pb + OIDX_OFF) >> 1) + i, mask=i < S, other=0xFFFF).to(tl.int32)
    val = tl.load(f8 + pb + OVAL_OFF + i, mask=i < S, other=0.0).to(tl.float32)
    used = idx != 0xFFFF
    idx = tl.where(used, idx, 0)
    t = idx // D
    c = idx % D
    g = c // SUB
    code = tl.load(pool + pb + t * NS + g).to(tl.int32)
    u = tl.load(CB + (g * CODEBOOK_SIZE + code) * SUB + c % SUB).to(tl.float32)
    ts = tl.load(half + ((pb + TOK_OFF) >> 1) + t).to(tl.float32)
    delta = tl.where(used, ts * (val - u), 0.0)
    return used, first + t, c, delta


@triton.jit
def vq_key_fix(pool, page_base, tok0, q_rows, row_ok, s, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
               DOT: tl.constexpr, TOK_OFF: tl.constexpr, MEAN_OFF: tl.constexpr, OVAL_OFF: tl.constexpr,
               OIDX_OFF: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, T0, T1, T2, T3):
    """Scores of the outlier slots: s[g, col(t)] += q[g, c] * chan_scale[c] * delta per used slot."""
    SC: tl.constexpr = 16
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < chunks:
            used, colm, c, delta = _vq_slot_chunk(pool, page_base, tok0, chunk, T0, D, BLOCK_N, P, TOK_OFF,
                                                  OVAL_OFF, OIDX_OFF, S, SUB)
            cs = tl.load(T1 + c).to(tl.float32)
            q_c = tl.load(q_rows + c[None, :], mask=row_ok[:, None] & used[None, :], other=0.0).to(tl.float32)
            corr = q_c * (cs * delta)[None, :]  # [G_PAD, NPG * 16]
            s = add_slot_scores(s, corr, colm, used, BLOCK_N, DOT)
    return s


@triton.jit
def vq_value_fix(pool, page_base, tok0, p, pv, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                 DOT: tl.constexpr, TOK_OFF: tl.constexpr, OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr,
                 S: tl.constexpr, SUB: tl.constexpr, P5: tl.constexpr, T0, T1, T2, T3):
    """Output of the outlier slots: pv[g, c] += p[g, col(t)] * delta per used slot (p @ one-hot of
    the slots' tokens, times delta, @ one-hot of their channels)."""
    SC: tl.constexpr = 16
    NPG: tl.constexpr = BLOCK_N // (P if P < BLOCK_N else BLOCK_N)
    chunks = used_slot_chunks(pool, page_base, OIDX_OFF, S, NPG)
    for chunk in tl.static_range((S + SC - 1) // SC):
        if chunk < chunks:
            used, colm, c, delta = _vq_slot_chunk(pool, page_base, tok0, chunk, T2, D, BLOCK_N, P, TOK_OFF,
                                                  OVAL_OFF, OIDX_OFF, S, SUB)
            pv = add_slot_values(pv, p, colm, c, delta, used, D, BLOCK_N, DOT)
    return pv


def vq_spec(fmt, block_size: int, head_dim: int) -> DecodeSpec:
    """The fused decode path of a VQFormat: readers above, the layer's tables from
    `fmt.decode_tables(layer, device)` (the cache's layer; device copies made on first use)."""
    sub = fmt.sub_dim
    if sub & (sub - 1) or head_dim % sub:
        raise ValueError(f"vq decode kernel: sub_dim={sub} must be a power of two dividing head_dim={head_dim}")
    koff = fmt.layout("key", block_size, head_dim).offsets
    voff = fmt.layout("value", block_size, head_dim).offsets
    kslots = fmt.outlier_slots("key", block_size, head_dim)
    vslots = fmt.outlier_slots("value", block_size, head_dim)
    key_params = (koff["tok_scale"], koff["chan_mean"], koff.get("out_val", 0), koff.get("out_idx", 0), kslots, sub)
    if fmt.keys_before_rope:  # the whole tile, rotated by the reader, in 2 planes
        if (head_dim // sub) % 2:
            raise ValueError(f"vq decode kernel: keys_before_rope needs an even number of channel groups, got "
                             f"head_dim={head_dim} / sub_dim={sub}")
        key = TileReader(vq_key_tile_rope, key_params, planes=2)
    else:
        key = TileReader(vq_key_tile, key_params, fold_fn=vq_key_fold, fix_fn=vq_key_fix if kslots else None)
    value = TileReader(vq_value_tile, (voff["tok_scale"], voff.get("out_val", 0), voff.get("out_idx", 0), vslots, sub),
                       row_scaled=True, fix_fn=vq_value_fix if vslots else None)

    def tables(cache):
        return fmt.decode_tables(getattr(cache, "layer", 0), cache["k_pages"].device)

    return DecodeSpec(key=key, value=value, staged=True, residual=fmt.residual, tables=tables,
                      key_rope=fmt.keys_before_rope,
                      **spec_launch("vq", block_size))
