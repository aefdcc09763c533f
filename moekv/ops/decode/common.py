"""What every paged decode kernel shares: the format contract (DecodeSpec, TileReader) and the jit helpers
of the split-K loop (the products in either orientation, the online-softmax step, the 16-bit tail's tile,
a split's share of the tiles, L2 prefetch, storing a split's partial and merging the partials).

A format reads its pages through tile readers (one module per format beside this one: plain.py, fp8.py,
int4.py, kivi2.py, nuq2.py, vq.py). A tile is BLOCK_N consecutive tokens of one KV head; it spans
NPG = BLOCK_N / min(P, BLOCK_N) pages. A reader loads the tile's bytes from `pool` and dequantizes them
in registers:

    fn(pool, base, tok, page_base, tok0, valid, D, BLOCK_N, P, ASM, P0, P1, P2, P3, P4, P5)
        -> (x [BLOCK_N, D], row_scale [BLOCK_N] fp32)

base is the element offset in `pool` of each token's (page, head) slab ([BLOCK_N], or a scalar
when the tile lies in one page, NPG == 1: write `(base + vector)[:, None]`, never `base[:, None]`)
and tok [BLOCK_N] its row in the page; page_base is the same offset per page ([NPG], or the
scalar) and tok0 the tile's first row in its page (0 when pages are shorter than tiles), for
fields laid out along the tokens. valid masks the tokens to load (the others must load nothing and
give finite values). P0..P5 are the layout's constexprs (field byte offsets from
`PageLayout.offsets`, group sizes). ASM: compiled for an NVIDIA GPU, so inline PTX is allowed (False
under the interpreter, whose plain-Triton path is what the CPU tests check). A `row_scaled` reader
leaves a per-token factor out of x and returns it as row_scale; the others return any [BLOCK_N]
tensor there. Tiles are fp16 (exact for every code here), or the pool's own 16-bit dtype for plain
pages.

An outlier reader (`TileReader.outlier_fn`, called for o in range(outliers)) gives channels whose
exact value differs from what x holds there, one channel per page and slot:

    outlier_fn(pool, base, tok, page_base, tok0, valid, o, D, BLOCK_N, P, P0..P5)
        -> (channel per page [NPG] int32, channel per token [BLOCK_N] int32, delta [BLOCK_N] fp32)
           (both channels scalars when NPG == 1)

The math of each reader is its format's `dequantize` (the reference) restricted to a tile. To plug
in a format: write its readers in a module here and return a DecodeSpec from the format's
`decode_spec`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekv.ops.pdl import prefetch_l2

LOG2E = 1.4426950408889634


SWAP_MIN_ROWS = 8  # query rows of a group under swap_ab (the n8 of mma.m16n8k16)


NO_WINDOW = 1 << 30  # a window longer than any context


NUM_PARAMS = 6  # constexpr slots a tile reader gets for its layout (field offsets, group sizes)


NUM_TABLES = 4  # DecodeSpec.tables: per-layer tensors outside the pages (codebooks, channel scales)


@dataclass(frozen=True)
class TileReader:
    """How to read one of K or V (the signatures are in this module's docstring).

    fn -> (x [BLOCK_N, D], row_scale [BLOCK_N]): the tile, dequantized in registers. A row-scaled
    reader leaves a per-token factor out of x (the kernel folds it into the scores for keys and
    into the probabilities for values). outlier_fn -> (channel per page [NPG], channel per token
    [BLOCK_N], delta [BLOCK_N]) for each of `outliers` slots: the exact value minus what x holds at
    that channel, added by the kernel to the scores (keys) or the output (values) instead of
    patching every element of x.
    """

    fn: object  # a @triton.jit function
    params: tuple[int, ...] = ()
    row_scaled: bool = False
    outlier_fn: object = None  # a @triton.jit function, or None
    outliers: int = 0
    # planes > 1: column planes*j + i of the tile holds channel i*(D/planes) + j (codes stored in
    # planes, unpacked without a shuffle); the kernel reads q and writes the output in that order
    planes: int = 1
    # keys only: fold a per-channel affine of the page into q, for tiles inside one page (NPG == 1):
    # fold_fn -> (q' [G_PAD, D], bias [G_PAD]) with scores = q' @ x^T + bias; fn must then leave
    # the affine out of x (it keeps it in tiles spanning pages)
    fold_fn: object = None
    # a per-tile correction after the product (sparse outliers at arbitrary positions): keys
    # fix_fn(..., s) -> s [G_PAD, BLOCK_N]; values fix_fn(..., p, pv) -> pv [G_PAD, D] (tile order)
    fix_fn: object = None

    def constexprs(self) -> tuple[int, ...]:
        return tuple(self.params) + (0,) * (NUM_PARAMS - len(self.params))


@dataclass(frozen=True)
class DecodeSpec:
    """What the decode kernel needs to know about a format (built by `KVFormat.decode_spec`)."""

    key: TileReader
    value: TileReader
    k_pool: str = "k_pages"  # cache tensors holding the pages ([N, Hkv, ...], a slab per (page, head))
    v_pool: str = "v_pages"
    dot_dtype: torch.dtype = torch.float16  # what the tile readers produce (MMA operand type)
    # the newest page (partly filled, or full: a decode step quantizes the pages it fills after all
    # layers have attended) is read from k_staging / v_staging ([S, Hkv, P, D])
    staged: bool = False
    residual: int = 0  # a residual window (kivi2, nuq2, vq): the newest R tokens from k_residual / v_residual
    # per-layer tables outside the pages (e.g. vq's codebooks): up to NUM_TABLES tensors [Hkv, ...],
    # each contiguous per head, or a function of the cache (a LayerKVCache: its .layer) returning
    # them. When there are any, every hook (fn, fold_fn, fix_fn; not outlier_fn) takes their
    # pointers at its program's KV head as NUM_TABLES trailing arguments (T0..T3, unused ones stand-ins)
    tables: object = ()
    # ask L2 for the slabs of the tile this many tiles ahead (0: off): see paged_decode_attention
    prefetch: int = 0
    # splits per (sequence, KV head) = num_splits_for's x this (default_num_splits)
    split_factor: int = 1
    # transposed products (scores [BLOCK_N, G], output [D, G]): the group is the MMA's N, padded to
    # SWAP_MIN_ROWS instead of M's 16
    swap_ab: bool = False
    # ptxas's register cap for the kernel (.maxnreg; None: its own choice): more programs per SM
    max_registers: int | None = None
    # the last split reads the 16-bit tail after its pages (False: a program of its own per head,
    # dispatched after the splits' programs; see paged_decode_attention's separate_tail)
    tail_in_last_split: bool = True
    # the pages hold keys before RoPE (keys_before_rope): the key reader takes its tokens' positions
    # [BLOCK_N] and log2 of the cache's RoPE base (LayerKVCache.rope_theta) after its constexprs
    # (before the tables) and returns the whole tile rotated (moekv/ops/decode/rope.py; no fold_fn,
    # fix_fn or outlier_fn). The 16-bit tail holds rotated keys, as the layer wrote them
    key_rope: bool = False


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# The products in either orientation (SWAP_AB): scores [G_PAD, BLOCK_N] = q @ k^T and output
# [G_PAD, D] = p @ v, or (SWAP_AB) scores [BLOCK_N, G_PAD] = k @ q^T and output [D, G_PAD] = v^T @ p.
@triton.jit
def per_token(x, SWAP_AB: tl.constexpr):
    """A [BLOCK_N] vector broadcast along the tokens axis of the scores."""
    if SWAP_AB:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def per_head(x, SWAP_AB: tl.constexpr):
    """A [G_PAD] vector broadcast along the heads axis of the scores (and of the output)."""
    if SWAP_AB:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


# The operands are cast to DOT inside, the first operand of the product first: the order of the
# casts changes how Triton schedules the loop (shared memory, registers, spills); the kernels' timings
# (and their tuning) are for this order.
@triton.jit
def tile_scores(q, k, acc, DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """q [G_PAD, D] against k [BLOCK_N, D], added to acc (or None)."""
    if SWAP_AB:
        s = tl.dot(k.to(DOT), tl.trans(q.to(DOT)), acc)
    else:
        s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), acc)
    return s


@triton.jit
def weighted_values(p, v, DOT: tl.constexpr, SWAP_AB: tl.constexpr, token_scale=None):
    """Probabilities p (the scores' orientation; times token_scale [BLOCK_N] when given) times
    v [BLOCK_N, D]."""
    if SWAP_AB:
        v_t = tl.trans(v.to(DOT))
        if token_scale is not None:
            p = p * token_scale[:, None]
        o = tl.dot(v_t, p.to(DOT))
    else:
        if token_scale is not None:
            p = p * token_scale[None, :]
        o = tl.dot(p.to(DOT), v.to(DOT))
    return o


@triton.constexpr_function
def tokens_axis(swap_ab):
    """The axis of the tokens in the scores (and probabilities): 0 under SWAP_AB, else 1."""
    return 0 if swap_ab else 1


@triton.jit
def softmax_step(s, valid, m, l, qk_scale, SWAP_AB: tl.constexpr = False):
    """Online softmax over one tile's raw scores s (fp32, before the scale; [G_PAD, BLOCK_N], or
    [BLOCK_N, G_PAD] under SWAP_AB): returns the new running max m and sum l [G_PAD], the tile's
    probabilities p and the factor alpha that rescales what was accumulated before (all base 2)."""
    s = tl.where(per_token(valid, SWAP_AB), s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=tokens_axis(SWAP_AB)))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - per_head(m_new, SWAP_AB))
    l = l * alpha + tl.sum(p, axis=tokens_axis(SWAP_AB))
    return m_new, l, p, alpha


@triton.jit
def tail_values_in_acc_order(t_v, PL: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """A tail value tile [BLOCK_N, D] from channel order to a planar format's accumulator columns
    (column PL * j + s holds channel s * D / PL + j): permuted in registers, after whole-row loads."""
    return tl.reshape(tl.permute(tl.reshape(t_v, (BLOCK_N, PL, D // PL)), (0, 2, 1)), (BLOCK_N, D))


@triton.jit
def tail_tile_step(q_tail, t_k, t_v, t_valid, m, l, acc, qk_scale, SWAP_AB: tl.constexpr, TAIL_DOT: tl.constexpr):
    """One tile of the 16-bit tail (t_k, t_v [BLOCK_N, D] in TAIL_DOT): the online softmax's new
    (m, l, acc), acc [G_PAD, D], or [D, G_PAD] under SWAP_AB."""
    t_s = tile_scores(q_tail, t_k, None, TAIL_DOT, SWAP_AB)
    m, l, t_p, t_alpha = softmax_step(t_s, t_valid, m, l, qk_scale, SWAP_AB)
    acc = acc * per_head(t_alpha, SWAP_AB) + weighted_values(t_p, t_v, TAIL_DOT, SWAP_AB)
    return m, l, acc


@triton.constexpr_function
def pow2_at_least(n):
    """The smallest power of two >= n (>= 1), for tl.arange lengths in jit code."""
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def split_share(first, quantized, split, num_splits, BLOCK_N: tl.constexpr):
    """Tiles [t0, t1) of a split: the tiles of tokens [first, quantized) cut into num_splits
    contiguous shares (flash-decoding split-K; the window's first tile is where the share starts)."""
    first_tile = first // BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(quantized, BLOCK_N) - first_tile, 0)
    per_split = tl.cdiv(num_tiles, num_splits)
    t0 = first_tile + split * per_split
    return t0, tl.minimum(t0 + per_split, first_tile + num_tiles)


@triton.jit
def prefetch_slab(pool, offset, SLAB: tl.constexpr, enabled=True):
    """Ask L2 for the SLAB bytes at element `offset` of `pool` (a (page, head) slab), one prefetch
    per 128-byte line; none where `enabled` (a scalar condition) is false."""
    LINES: tl.constexpr = (SLAB + 127) // 128
    line = tl.arange(0, pow2_at_least(LINES))
    start = (pool + offset).to(tl.pointer_type(tl.uint8), bitcast=True)
    prefetch_l2(tl.where((line < LINES) & enabled, (start + line * 128).to(tl.int64, bitcast=True), 0))


@triton.jit
def store_partial(part_o, part_lse, head, split, ns_total, out_col, row_ok, m, l, acc, D: tl.constexpr):
    """A split's normalised partial output (columns out_col of each head's row) and its
    log2-sum-exp; an empty share writes (0, -inf). head [G_PAD] int64, row_ok masks padding rows."""
    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(part_o + (head * ns_total + split)[:, None] * D + out_col[None, :], o, mask=row_ok[:, None])
    tl.store(part_lse + head * ns_total + split, lse, mask=row_ok)


@triton.jit
def reduce_head(part_o, part_lse, out, stride_ob, stride_oh, ns_total, b, hq, sinks,
                NUM_HEADS: tl.constexpr, NS_PAD: tl.constexpr, D: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """out[b, hq] = sum_s w_s o_s / (sum_s w_s + w_sink) with w_s = 2^(lse_s - top); with
    HAS_SINKS head hq's sink logit (sinks[hq], natural log units of the scaled scores) is one more
    split whose output is 0 (w_sink = 2^(sinks[hq] * log2(e) - top)), else w_sink = 0."""
    head = (b * NUM_HEADS + hq).to(tl.int64)
    s = tl.arange(0, NS_PAD)
    d = tl.arange(0, D)
    lse = tl.load(part_lse + head * ns_total + s, mask=s < ns_total, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        # log2(e) written out: compiled (not interpreted) Triton reads no plain module globals
        sink = tl.load(sinks + hq).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    w = tl.exp2(lse - top)  # [NS_PAD]; empty shares weigh 0
    o = tl.load(part_o + (head * ns_total + s)[:, None] * D + d[None, :], mask=(s < ns_total)[:, None], other=0.0)
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - top)
    res = tl.sum(w[:, None] * o, axis=0) / denom
    tl.store(out + b * stride_ob + hq * stride_oh + d, res.to(out.dtype.element_ty))


def check_block_n(kernel: str, block_n: int) -> None:
    """Tiles are a power of two >= 16 tokens (the MMA's smallest); `kernel` names the launcher in the error."""
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{kernel}: block_n={block_n} must be a power of two >= 16 (the MMA's smallest tile)")
