"""Absorbed multi-head latent attention decode over the paged latent cache (kvcache/formats/latent.py).

One query per sequence, already in the latent space: q [B, H, W] = [q_nope W_UK (R columns), rotated
q_rope (r columns)]. Every head reads the same entries: keys the whole entry [c_kv, k_rope], values
c_kv. So one program takes BLOCK_H heads of one sequence over one split of its tokens, loads each tile
of entries once for all of them, and keeps the [BLOCK_H, R] accumulator of the online softmax;
`_mla_reduce_kernel` merges the splits (split-K flash decoding). Head blocks of one (sequence, split)
are neighbours in the grid, so the second reads of a tile come from L2.

Storage: the latent in bf16 / fp16 (a slice of the entry pages), or float8 e4m3 codes with one fp32
scale per token (folded into the scores for keys and into the probabilities for values), or int4
codes two per byte with an fp16 scale and minimum per token and group of channels
(`_mla_int4_split_kernel`: dequantized in registers, the even and odd channels as two halves); the
rotary key in 16 bits.

Launch: a table by shape (moekv/ops/configs/mla_decode_<device>.json: tile, warps, stages, transposed scores;
`launch_for`), the splits chosen so the last wave of programs is full (`num_splits_for`); config `v1` is
the launch before the table. Why: docs/decisions.md, "MLA decode: where the absorbed kernel's time goes".

Reference: `moekv.ops.reference.mla_decode_ref` over the format's `gather` of each sequence.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekv.ops.decode.common import per_token, softmax_step
from moekv.ops.reference import mla_query_fp8_ref
from moekv.ops.tuning import current_device_name, load_tuning

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAConfig:
    """One launch of the split kernel: BLOCK_N tokens a tile, num_warps, num_stages (the tile loads in
    flight: 1 = none ahead), swap (the scores as [tokens, heads], `_mla_split_kernel`'s SWAP), fp8_mma
    (both latent MMAs on e4m3 operands, `_mla_split_kernel`'s FP8_MMA: the fp8 latent only)."""
    block_n: int
    num_warps: int
    num_stages: int
    swap: bool = False
    fp8_mma: bool = False


SMALL_LATENT = MLAConfig(64, 4, 3, False)  # latents under 256 channels: a [BLOCK_H, R] accumulator fits 4 warps


@functools.cache
def tuning(device_name: str | None = None) -> dict:
    """The launch table (moekv/ops/configs/mla_decode_<device>.json): split_waves, configs {name: MLAConfig},
    formats {storage: [config names by preference]}."""
    data = load_tuning("mla_decode", device_name)
    configs = {name: MLAConfig(int(bn), int(w), int(st), *map(bool, rest)) for name, (bn, w, st, *rest)
               in data["configs"].items()}
    return {"split_waves": int(data["split_waves"]), "configs": configs, "formats": data["formats"]}


def named_config(name: str) -> MLAConfig:
    configs = tuning(current_device_name())["configs"]
    if name not in configs:
        raise ValueError(f"MLA decode: no launch config {name!r}; the table has {sorted(configs)}")
    return configs[name]


@triton.jit
def _split_tiles(lens_ptr, b, s, num_splits, BLOCK_N: tl.constexpr):
    """(length, t0, t1): sequence b's length and split s's share [t0, t1) of its BLOCK_N-token tiles."""
    length = tl.load(lens_ptr + b)
    num_tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t0 = s * per_split
    return length, t0, tl.minimum(t0 + per_split, num_tiles)


@triton.jit
def _tile_entries(tables_ptr, stride_tb, b, t, length, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """(valid, page, off) [BLOCK_N]: which of tile t's tokens sequence b holds, and each one's page (int64)
    and row in it."""
    toks = t * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = toks < length
    page = tl.load(tables_ptr + b * stride_tb + toks // PAGE, mask=valid, other=0).to(tl.int64)
    return valid, page, toks % PAGE


@triton.jit
def _rope_scores(q_rope, kr, PRECISION: tl.constexpr, RP: tl.constexpr, SWAP: tl.constexpr = False):
    """The rotary part of the scores, fp32: q_rope [BLOCK_H, RP] . kr [BLOCK_N, RP]^T, [BLOCK_H, BLOCK_N]
    ([BLOCK_N, BLOCK_H] = kr . q_rope^T under SWAP); a broadcast sum below tl.dot's smallest reduction (16)."""
    if SWAP:
        if RP >= 16:
            r = tl.dot(kr, tl.trans(q_rope), input_precision=PRECISION)
        else:
            r = tl.sum(kr[:, None, :].to(tl.float32) * q_rope[None, :, :].to(tl.float32), 2)
    else:
        if RP >= 16:
            r = tl.dot(q_rope, tl.trans(kr), input_precision=PRECISION)
        else:
            r = tl.sum(q_rope[:, None, :].to(tl.float32) * kr[None, :, :].to(tl.float32), 2)
    return r


@triton.jit
def _store_split(part_o_ptr, part_lse_ptr, b, s, heads, hmask, cols, m, l_sum, acc, stride_ob, stride_oh, stride_os,
                 stride_eb, stride_eh, acc_odd=None):
    """Split s's partial output for `heads` of sequence b, acc / l_sum at columns cols (with acc_odd, the int4
    kernel's halves: acc at the even channels 2 cols, acc_odd at the odd ones 2 cols + 1), and its log2-sum-exp
    (m, l_sum base 2); an empty share writes (0, -inf). common.store_partial is the paged kernels' (contiguous
    rows, no strides). The divisions stay where each kernel had them (one output: before the lse; the halves:
    at their stores): moved, the int4 kernel's sm_90 build takes other registers and spills."""
    has = l_sum > 0
    norm = tl.where(has, l_sum, 1.0)
    if acc_odd is None:
        out = acc / norm[:, None]
    lse = tl.where(has, m + tl.log2(norm), float("-inf"))
    o_row = part_o_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os
    if acc_odd is None:
        tl.store(o_row + cols[None, :], out, mask=hmask[:, None])
    else:
        tl.store(o_row + 2 * cols[None, :], acc / norm[:, None], mask=hmask[:, None])
        tl.store(o_row + 2 * cols[None, :] + 1, acc_odd / norm[:, None], mask=hmask[:, None])
    tl.store(part_lse_ptr + b * stride_eb + heads * stride_eh + s, lse, mask=hmask)


@triton.jit
def _mla_split_kernel(q_ptr, q8_ptr, qs_ptr, latent_ptr, rope_ptr, scales_ptr, tables_ptr, lens_ptr, part_o_ptr,
                      part_lse_ptr,
                      stride_qb, stride_qh, stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_tb,
                      stride_ob, stride_oh, stride_os, stride_eb, stride_eh, qk_scale, num_heads, num_splits,
                      R: tl.constexpr, RP: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
                      NUM_STAGES: tl.constexpr, FP8_MMA: tl.constexpr):
    """SWAP: the scores computed transposed, [BLOCK_N tokens, BLOCK_H heads] = entries . queries^T, so the
    tile of tokens is the MMA's M: on sm_90 Triton lays a dot that feeds another dot with all its warps
    along M, and at M = BLOCK_H = 64 heads two warpgroups would each compute the whole score tile (at
    M = BLOCK_N = 128 tokens each computes its half). Without SWAP, [BLOCK_H, BLOCK_N] = queries . entries^T.

    FP8_MMA (the fp8 latent only): both latent MMAs on e4m3 operands. The latent queries come quantized
    (q8 [B, H, R] e4m3 codes, qs [B, H] their scales, amax / 448 a head: `quantize_queries`, once a
    step; loaded from memory they stay in shared memory as the 16-bit ones do, where codes made in
    registers would be an MMA operand held in registers, 32 a thread), and the scores are multiplied
    back by that scale and the token's. The probabilities times the token's scale are multiplied by
    448 / (the tile's largest token scale) before rounding to e4m3 (a probability of 1 at that token
    is e4m3's largest value), the factor divided back out of the product. The rotary part stays a
    bf16 MMA; the normaliser sums the unrounded probabilities (reference.mla_decode_mma_ref computes
    the same). On sm_90 the value MMA's e4m3 operand must be K-major (tokens contiguous) and the tile
    is stored with its channels contiguous, so Triton moves the tile through registers to transpose
    it: at 64 heads and 8 warps the build spills (docs/decisions.md, "MLA decode with fp8 MMAs")."""
    hb, b, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length, t0, t1 = _split_tiles(lens_ptr, b, s, num_splits, BLOCK_N)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    cols, rcols = tl.arange(0, R), tl.arange(0, RP)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_rope = tl.load(q_row + R + rcols[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, RP]
    if FP8_MMA:
        q8_row = q8_ptr + (b * num_heads + heads[:, None]) * R
        q_mma = tl.load(q8_row + cols[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, R] e4m3
        q_scale = tl.load(qs_ptr + b * num_heads + heads, mask=hmask, other=0.0)
    else:
        q_mma = tl.load(q_row + cols[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, R]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        valid, page, off = _tile_entries(tables_ptr, stride_tb, b, t, length, BLOCK_N, PAGE)
        c = tl.load(latent_ptr + (page * stride_lp + off * stride_lt)[:, None] + cols[None, :],
                    mask=valid[:, None], other=0.0).to(q_mma.dtype)  # [BLOCK_N, R]
        kr = tl.load(rope_ptr + (page * stride_rp + off * stride_rt)[:, None] + rcols[None, :],
                     mask=valid[:, None], other=0.0).to(q_rope.dtype)  # [BLOCK_N, RP]
        if FP8:
            tok_scale = tl.load(scales_ptr + page * stride_sp + off, mask=valid, other=0.0)
        if FP8_MMA:
            p_fold = 448.0 / tl.max(tok_scale, 0)  # a tile holds a valid token, whose scale is > 0
        if SWAP:
            scores = tl.dot(c, tl.trans(q_mma), input_precision=PRECISION)  # [BLOCK_N, BLOCK_H] fp32
            if FP8_MMA:
                scores = scores * tok_scale[:, None] * q_scale[None, :]
            elif FP8:
                scores = scores * tok_scale[:, None]
            scores += _rope_scores(q_rope, kr, PRECISION, RP, SWAP)
        else:
            scores_lat = tl.dot(q_mma, tl.trans(c), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N] fp32
            if FP8_MMA:
                scores_lat = scores_lat * q_scale[:, None] * tok_scale[None, :]
            elif FP8:
                scores_lat = scores_lat * tok_scale[None, :]
            scores = scores_lat + _rope_scores(q_rope, kr, PRECISION, RP)
        m, l_sum, p, alpha = softmax_step(scores, valid, m, l_sum, qk_scale, SWAP)  # log2 units
        if FP8_MMA:
            p = p * per_token(tok_scale * p_fold, SWAP)
        elif FP8:
            p = p * per_token(tok_scale, SWAP)
        p = p.to(c.dtype)
        if SWAP:
            p = tl.trans(p)  # [BLOCK_H, BLOCK_N]
        if FP8_MMA:
            acc = acc * alpha[:, None] + tl.dot(p, c) * (1.0 / p_fold)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision=PRECISION)
    _store_split(part_o_ptr, part_lse_ptr, b, s, heads, hmask, cols, m, l_sum, acc, stride_ob, stride_oh, stride_os,
                 stride_eb, stride_eh)


@triton.jit
def _mla_int4_split_kernel(q_ptr, codes_ptr, rope_ptr, scale_ptr, zero_ptr, tables_ptr, lens_ptr, part_o_ptr,
                           part_lse_ptr, stride_qb, stride_qh, stride_cp, stride_ct, stride_rp, stride_rt, stride_gp,
                           stride_gt, stride_tb, stride_ob, stride_oh, stride_os, stride_eb, stride_eh, qk_scale,
                           num_heads, num_splits, R: tl.constexpr, RP: tl.constexpr, GROUP: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                           NUM_STAGES: tl.constexpr):
    """_mla_split_kernel over the int4 latent: byte j of a token holds channels 2j (low nibble) and
    2j + 1 (high), so the latent is read as its even and odd halves, each [BLOCK_N, R/2] with its own
    half of the query and of the accumulator; a group's fp16 scale and minimum serve both halves."""
    hb, b, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length, t0, t1 = _split_tiles(lens_ptr, b, s, num_splits, BLOCK_N)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    half, rcols = tl.arange(0, R // 2), tl.arange(0, RP)
    groups = half // (GROUP // 2)  # channel 2j and 2j + 1 are in group (2j) // GROUP
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_even = tl.load(q_row + 2 * half[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, R/2]
    q_odd = tl.load(q_row + 2 * half[None, :] + 1, mask=hmask[:, None], other=0.0)
    q_rope = tl.load(q_row + R + rcols[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, RP]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc_even = tl.zeros([BLOCK_H, R // 2], tl.float32)
    acc_odd = tl.zeros([BLOCK_H, R // 2], tl.float32)
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        valid, page, off = _tile_entries(tables_ptr, stride_tb, b, t, length, BLOCK_N, PAGE)
        packed = tl.load(codes_ptr + (page * stride_cp + off * stride_ct)[:, None] + half[None, :],
                         mask=valid[:, None], other=0)  # [BLOCK_N, R/2] uint8
        side = (page * stride_gp + off * stride_gt)[:, None] + groups[None, :]
        step = tl.load(scale_ptr + side, mask=valid[:, None], other=0.0).to(tl.float32)
        low = tl.load(zero_ptr + side, mask=valid[:, None], other=0.0).to(tl.float32)
        c_even = ((packed & 0xF).to(tl.float32) * step + low).to(q_even.dtype)
        c_odd = ((packed >> 4).to(tl.float32) * step + low).to(q_even.dtype)
        kr = tl.load(rope_ptr + (page * stride_rp + off * stride_rt)[:, None] + rcols[None, :],
                     mask=valid[:, None], other=0.0).to(q_rope.dtype)  # [BLOCK_N, RP]
        scores = tl.dot(q_even, tl.trans(c_even), input_precision=PRECISION)
        scores += tl.dot(q_odd, tl.trans(c_odd), input_precision=PRECISION)
        scores += _rope_scores(q_rope, kr, PRECISION, RP)
        m, l_sum, p, alpha = softmax_step(scores, valid, m, l_sum, qk_scale)  # log2 units
        p = p.to(c_even.dtype)
        acc_even = acc_even * alpha[:, None] + tl.dot(p, c_even, input_precision=PRECISION)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p, c_odd, input_precision=PRECISION)
    _store_split(part_o_ptr, part_lse_ptr, b, s, heads, hmask, half, m, l_sum, acc_even, stride_ob, stride_oh,
                 stride_os, stride_eb, stride_eh, acc_odd)


@triton.jit
def _mla_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, stride_os, stride_eb, stride_eh,
                       stride_outb, stride_outh, num_splits, R: tl.constexpr, NS_PAD: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, NS_PAD)
    smask = splits < num_splits
    lse = tl.load(part_lse_ptr + b * stride_eb + h * stride_eh + splits, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    cols = tl.arange(0, R)
    o = tl.load(part_o_ptr + b * stride_ob + h * stride_oh + splits[:, None] * stride_os + cols[None, :],
                mask=smask[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + cols, merged.to(out_ptr.dtype.element_ty))


def quantize_queries(q: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent queries for fp8 MMAs, once a step: q [B, H, W] -> (codes [B, H, R] float8 e4m3, contiguous;
    scales [B, H] fp32, amax / 448 a head: reference.mla_query_fp8_ref, whose torch ops are the step's)."""
    codes, scales = mla_query_fp8_ref(q[..., :kv_lora_rank])
    return codes.contiguous(), scales.contiguous()


def kernel_shape_unsupported(kv_lora_rank: int, rope_dim: int) -> str | None:
    """Why the kernel cannot take this entry shape, or None."""
    if kv_lora_rank < 16 or kv_lora_rank & (kv_lora_rank - 1) or rope_dim < 1 or rope_dim & (rope_dim - 1):
        return (f"the latent decode kernel takes kv_lora_rank a power of two >= 16 and qk_rope_head_dim a power of "
                f"two; got {kv_lora_rank} and {rope_dim}")
    return None


def _is_interpreted(kernel) -> bool:
    return not isinstance(kernel, triton.runtime.jit.JITFunction)


def num_splits_for(batch: int, head_blocks: int, max_len: int, block_n: int, num_sms: int | None,
                   waves: int = 2) -> int:
    """Splits of each sequence's tiles: about `waves` waves of programs (one program an SM: each config's
    shared memory takes most of one), each split at least two tiles; among the counts from half that
    target up to it, the one whose last wave is fullest (time ~ waves rounded up / splits; ties: more
    splits). num_sms None (no GPU): at most 4 splits."""
    tiles = max(-(-max_len // block_n), 1)
    if num_sms is None:
        return min(tiles, 4)
    pairs = max(batch * head_blocks, 1)
    cap = max(1, min(-(-tiles // 2), 64))
    target = min(max(1, -(-waves * num_sms // pairs)), cap)
    return min(range(max(1, target // 2), target + 1), key=lambda s: (-(-pairs * s // num_sms) / s, -s))


def launch_for(storage: str, kv_lora_rank: int, batch: int, head_blocks: int, max_len: int, num_sms: int | None,
               device_name: str | None = None, block_h: int = 64) -> MLAConfig:
    """The launch table's config: the storage's first whose tiles give every program of split_waves waves two
    tiles at least (so its splits fill the GPU), else its last. The table is for latents of 256 channels
    and more (DeepSeek's 512), 64 heads a program; smaller latents take SMALL_LATENT, fewer heads the
    storage's last config (the launch before the table)."""
    if kv_lora_rank < 256:
        return SMALL_LATENT
    table = tuning(device_name)
    names = table["formats"][storage]
    for name in names[:-1] if block_h >= 64 else []:
        cfg = table["configs"][name]
        tiles = max(-(-max_len // cfg.block_n), 1)
        if num_sms is None or batch * head_blocks * (tiles // 2) >= table["split_waves"] * num_sms:
            return cfg
    return table["configs"][names[-1]]


def mla_decode(q: torch.Tensor, tensors: dict[str, torch.Tensor], block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, kv_lora_rank: int, block_h: int | None = None,
               block_n: int | None = None, num_splits: int | None = None, max_len: int | None = None,
               config: MLAConfig | str | None = None, fp8_mma: bool = False) -> torch.Tensor:
    """q [B, H, W] -> [B, H, R] in q's dtype. tensors: `latent` [N, P, R] (bf16 / fp16, or float8
    e4m3 codes with `scales` [N, P] fp32, or int4 codes [N, P, R/2] with `scales` and `zeros`) and `rope`
    [N, P, r], the last dim contiguous (LatentFormat.kernel_tensors); block_tables [B, max_pages];
    context_lens [B] (>= 1). block_h, num_splits: the launch's shape (None: the defaults); config: a
    launch (or its name in the table; None: the table's choice for the shape), block_n overriding its
    tile; max_len: the longest context, for the splits (None: the block tables' capacity, no host sync);
    fp8_mma: both latent MMAs on e4m3 operands whatever the config says (the fp8 latent only; the
    arithmetic of reference.mla_decode_mma_ref(mma='fp8'))."""
    latent, rope = tensors["latent"], tensors["rope"]
    scales, zeros = tensors.get("scales"), tensors.get("zeros")
    B, H, W = q.shape
    R, RP = kv_lora_rank, W - kv_lora_rank
    if zeros is not None and (latent.shape[-1] * 2 != R or latent.dtype != torch.uint8 or scales.stride(-1) != 1
                              or zeros.stride() != scales.stride() or R // scales.shape[-1] < 2):
        raise ValueError(f"int4 latent: codes [N, P, {R // 2}] uint8, scales and zeros [N, P, R / group] with the "
                         f"same contiguous rows expected; got {tuple(latent.shape)}, {tuple(scales.shape)}")
    if ((zeros is None and latent.shape[-1] != R) or rope.shape[-1] != RP or latent.stride(-1) != 1
            or rope.stride(-1) != 1):
        raise ValueError(f"latent [N, P, {R}] and rope [N, P, {RP}] with contiguous rows expected; got "
                         f"{tuple(latent.shape)} and {tuple(rope.shape)}")
    reason = kernel_shape_unsupported(R, RP)
    if reason is not None:
        raise ValueError(reason)
    page = latent.shape[1]
    q = q.contiguous()
    # 64 heads a program where there are that many: each latent tile is read once for more heads (H100,
    # 128 heads: 3.4 against 7.5 ms at (64, 32k), 28 against 36 us at (1, 4k); 16 heads keep 16:
    # benchmarks/results/h100/mla_decode.json)
    block_h = block_h or (64 if H >= 64 else max(16, min(32, triton.next_power_of_2(H))))
    head_blocks = -(-H // block_h)
    storage = "int4" if zeros is not None else "fp8" if scales is not None else "16bit"
    on_gpu = q.device.type == "cuda"
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if on_gpu else None
    context = max_len or block_tables.shape[1] * page
    if isinstance(config, str):
        config = named_config(config)
    if config is None:
        config = launch_for(storage, R, B, head_blocks, context, num_sms, current_device_name(), block_h)
    if block_n is not None or fp8_mma:
        config = MLAConfig(block_n or config.block_n, config.num_warps, config.num_stages, config.swap,
                           config.fp8_mma or fp8_mma)
    if storage == "int4" and config.swap:
        raise ValueError("the int4 latent kernel has no transposed-scores form (config.swap)")
    if config.fp8_mma and storage != "fp8":
        raise ValueError(f"fp8 MMAs (config.fp8_mma) read the fp8 latent's codes; this latent is {storage}")
    if num_splits is None:
        num_splits = num_splits_for(B, head_blocks, context, config.block_n, num_sms,
                                    tuning(current_device_name())["split_waves"])
    part_o = torch.empty(B, H, num_splits, R, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, R, dtype=q.dtype, device=q.device)
    if _is_interpreted(_mla_split_kernel):
        from moekv.ops.decode.interpreter import (
            patch_interpreter_bf16_dot,
            patch_interpreter_fp8_cast,
            patch_interpreter_index,
        )

        patch_interpreter_index()
        patch_interpreter_bf16_dot()
        patch_interpreter_fp8_cast()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_H=block_h, BLOCK_N=config.block_n, PRECISION=precision, NUM_STAGES=config.num_stages,
                  num_warps=config.num_warps)
    if storage == "int4":
        group = 2 * latent.shape[-1] // scales.shape[-1]
        _mla_int4_split_kernel[(head_blocks, B, num_splits)](
            q, latent, rope, scales, zeros, block_tables, context_lens, part_o, part_lse,
            q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), rope.stride(0), rope.stride(1),
            scales.stride(0), scales.stride(1), block_tables.stride(0), part_o.stride(0), part_o.stride(1),
            part_o.stride(2), part_lse.stride(0), part_lse.stride(1), scale * LOG2E, H, num_splits,
            R=R, RP=RP, GROUP=group, PAGE=page, **launch)
    else:
        fp8 = storage == "fp8"
        scales_arg = scales if fp8 else part_lse  # unread without FP8
        q8, q_scales = quantize_queries(q, R) if config.fp8_mma else (q, part_lse)  # unread without FP8_MMA
        _mla_split_kernel[(head_blocks, B, num_splits)](
            q, q8, q_scales, latent, rope, scales_arg, block_tables, context_lens, part_o, part_lse,
            q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), rope.stride(0), rope.stride(1),
            scales_arg.stride(0), block_tables.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), scale * LOG2E, H, num_splits,
            R=R, RP=RP, PAGE=page, FP8=fp8, SWAP=config.swap, FP8_MMA=config.fp8_mma, **launch)
    _mla_reduce_kernel[(B, H)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1), num_splits, R=R,
        NS_PAD=max(triton.next_power_of_2(num_splits), 2))
    return out
