"""Fused MoE experts step with weight-only quantized experts (fp8, int4 or mxfp4 QuantizedWeight w13 / w2).

Semantics are those of `moekv.ops.reference.fused_moe_ref` on the dequantized weights (with gpt-oss's
expert biases and clamped SwiGLU: `clamped_swiglu_moe_ref`, the epilogues of ops/fused_moe.py); the paths and
grids are those of ops/fused_moe.py (read it first), with each weight tile dequantized in registers
(ops/quant_tiles.dequant_tile) instead of loaded:
- GEMV for decode (T*k <= GEMV_MAX_PAIRS): program (pair, n-block[, k-split]) streams the codes of a
  [BLOCK_N, K] slab of its pair's expert, reducing products to row sums every K step.
- run GEMV for decode where pairs share experts (path "runs"; `default_path`): the pairs sorted by expert in
  one launch (`moe_align_small`, runs padded to P pairs); program (run, n-block[, k-split]) decodes each
  tile once and applies it to the activation rows of its up to P pairs (`quant_tiles.run_code_dots`; int4 with
  f16_dots: `run_f16_dots`, a word decoded to packed halves once for the P pairs), so an expert's codes are
  unpacked once per P pairs instead of once per pair.
- grouped GEMM for prefill / large batch: the pairs sorted by expert (`moe_align_block_size`); each
  K step dequantizes a [BLOCK_K, BLOCK_N] weight tile to the activations' dtype, then `tl.dot`.
All are free of host syncs (capturable in a CUDA graph).

`quant_gemm` is the down projection's GEMM with one expert and weight 1: the dense projections'
path at more tokens than their GEMV takes (ops/quant_linear.py).

Shape legend: T = tokens, k = experts per token, M = T*k pairs, E = experts, H = hidden,
I = expert intermediate size, S = k-splits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekv.ops.fused_moe import (
    ALIGN_MAX_PAIRS,
    GEMV_MAX_PAIRS,
    GemmConfig,
    activate,
    default_gemm_config,
    default_splits,
    dot_tiles,
    epilogue_args,
    fused_moe,
    interpreting,
    mean_run,
    moe_align_block_size,
    moe_align_small,
    num_sms_of,
    sum_partials,
)
from moekv.ops.fused_moe import default_path as default_path_16bit
from moekv.ops.quant_tiles import (
    SCALES_PER_TILE,
    code_dots,
    code_values,
    dequant_tile,
    f16_activations,
    int4_f16_dots,
    quant_row_dots,
    run_chunks,
    run_code_dots,
    run_f16_dots,
    scale_mode,
    tile_scales,
    use_f16_dots,
)
from moekv.ops.quantized_weight import QuantizedWeight


@dataclass(frozen=True)
class QuantGemvShape:
    """A quantized GEMV's tile and launch: the projection GEMV's (ops/quant_linear.py) whole config."""
    block_n: int = 4
    block_k: int = 1024  # a multiple of 8 (int4 words) and of the int4 group where one tile spans several
    num_warps: int = 4
    num_stages: int = 4
    # int4's dots in packed halves (quant_tiles.int4_f16_dots, the run GEMV's run_f16_dots; use_f16_dots: CUDA
    # only, int4 groups read per tile or per group); None: quant_tiles.F16_DOTS_DEFAULT
    f16_dots: bool | None = None


@dataclass(frozen=True)
class QuantGemvConfig(QuantGemvShape):
    """The MoE GEMVs' config: the tile, the down projection's K splits and the run GEMV's pairs a program."""
    block_n: int = 8
    num_splits: int | None = None  # of the down projection's K; None: enough programs to fill the GPU
    # path "runs": pairs a program takes from one expert's run (a power of 2); None: default_run_pairs
    run_pairs: int | None = None


DEFAULT_QUANT_GEMV = QuantGemvConfig()
# 4-bit codes: 16 rows a program, so a K step's fixed work (x's layout change and group sums) spreads over
# twice the weight bytes and a program keeps as many bytes in flight as fp8's 8 rows (sm_90 SASS at
# Mixtral-8x7B's shape: 0.37 -> 0.31 warp instructions a weight byte; docs/decisions.md, "The int4 GEMV's unpack")
DEFAULT_PACKED_GEMV = QuantGemvConfig(block_n=16)


def default_quant_gemv(w: QuantizedWeight) -> QuantGemvConfig:
    return DEFAULT_PACKED_GEMV if w.method in ("int4", "mxfp4") else DEFAULT_QUANT_GEMV


def default_path(num_pairs: int, num_experts: int, method: str) -> str:
    """fused_moe_quant's path for path=None: where fused_moe.default_path takes the grouped GEMM (past GEMV_MAX_PAIRS,
    or where the experts' runs average GEMM_MIN_MEAN_RUN pairs), a path that decodes a tile once for its expert's
    pairs: for int4 the run GEMV (H200, Mixtral-8x7B's experts at T=8: 0.54 ms against the pair GEMV's 0.59 and the
    GEMM's 0.71), for fp8 and mxfp4 the grouped GEMM (fp8: 0.39 against 0.61 and the run GEMV's 0.58); else the pair
    GEMV. Past GEMV_MAX_PAIRS int4 takes the grouped GEMM's transposed form, its decoded tile the MMA's register
    operand (H100, Mixtral-8x7B's experts: 0.67 / 0.73 / 0.90 / 1.35 ms at T = 16 / 64 / 128 / 256 against 0.78 /
    1.10 / 1.44 / 2.44; fp8 is slower in that form below T = 256, mxfp4 gathers a scale a code there)."""
    path = default_path_16bit(num_pairs, num_experts)
    if method != "int4" or path == "gemv":
        return path
    return "gemm_swap" if num_pairs > GEMV_MAX_PAIRS else "runs"


def default_run_pairs(num_pairs: int, num_experts: int) -> int:
    """P for the run GEMV: the mean run length rounded up to a power of 2, 2 or 4 (8 spills at 16 x 1024
    tiles). A longer run splits into several programs, each decoding the tiles again; a shorter one leaves
    slots empty whose products are computed and dropped."""
    return min(4, max(2, triton.next_power_of_2(math.ceil(mean_run(num_pairs, num_experts)))))


# path "gemm_swap"'s launch by pairs an expert (up to the first column): BLOCK_M pairs are the MMA's N, so a
# block as wide as an expert's usual load costs little, and each m-block more re-reads and decodes the
# expert's tiles; BLOCK_N weight rows are the MMA's M, 64 a warp group. Offline sm_90 builds at Mixtral-8x22B's
# shape (benchmarks/tools/sass_moe_quant_gemm.py): no spills; 73-161 registers (int4, fp8), to 244 (mxfp4).
SWAP_CONFIGS = ((12, GemmConfig(16, 64, 128, 8, 4, 4)),
                (24, GemmConfig(32, 128, 64, 8, 8, 4)),
                (math.inf, GemmConfig(64, 128, 64, 8, 8, 3)))


def default_swap_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """SWAP_CONFIGS' launch for the mean pairs an expert (num_pairs / num_experts)."""
    rows = num_pairs / num_experts
    return next(cfg for limit, cfg in SWAP_CONFIGS if rows <= limit)


def weight_args(w: QuantizedWeight):
    """(codes, scales, zeros-or-scales, expert stride of codes, row stride of codes, expert stride of
    scales, row stride of scales) as the kernels take them; [N, K] matrices have expert stride 0.
    The codes are contiguous (QuantizedWeight keeps them so): quant_tiles relies on it."""
    if not w.codes.is_contiguous():
        raise ValueError("the quantized kernels read contiguous codes; this weight's are a strided view")
    zeros = w.scales if w.zeros is None else w.zeros
    if w.codes.dim() == 3:
        return w.codes, w.scales, zeros, w.codes.stride(0), w.codes.stride(1), w.scales.stride(0), w.scales.stride(1)
    return w.codes, w.scales, zeros, 0, w.codes.stride(0), 0, w.scales.stride(0)


def layout_constants(w: QuantizedWeight) -> dict:
    SN, SK = w.scale_block
    return dict(INT4=w.method == "int4", MXFP4=w.method == "mxfp4", HAS_ZEROS=w.zeros is not None, SN=SN, SK=SK)


# -- GEMV kernels (decode) ----------------------------------------------------------------------
@triton.jit
def _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N: tl.constexpr, stride_ce, stride_se, BLOCK_N: tl.constexpr):
    """Every kernel's block of an expert's rows: their offsets, mask and int64 indices, and the expert's
    codes, scales and zero points."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    return (offs_n, n_ok, offs_n.to(tl.int64), c_ptr + expert * stride_ce, s_ptr + expert * stride_se,
            z_ptr + expert * stride_se)


@triton.jit
def _gate_up_tiles(c_e, s_e, z_e, rows, n_ok, k0, N: tl.constexpr, K: tl.constexpr, stride_cn, stride_sn,
                   INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                   SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   F16_DOTS: tl.constexpr = False):
    """The GEMVs' K step of w13: the gate (rows) and up (rows + N) tiles' codes and scales, both loaded before
    the activations, so that they are in flight while those wait at their layout change's barrier (F16_DOTS: the
    codes undecoded, for quant_tiles.int4_f16_dots)."""
    q_g = code_values(c_e, rows, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K, F16_DOTS)
    q_u = code_values(c_e, rows + N, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K, F16_DOTS)
    s_g, z_g = tile_scales(s_e, z_e, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE,
                           BLOCK_N, BLOCK_K)
    s_u, z_u = tile_scales(s_e, z_e, rows + N, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE,
                           BLOCK_N, BLOCK_K)
    return q_g, s_g, z_g, q_u, s_u, z_u


@triton.jit
def _qgate_up_gemv_kernel(x_ptr, c_ptr, s_ptr, z_ptr, h_ptr, expert_ids_ptr, num_pairs,
                          N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                          stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_hm,
                          INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                          SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          b13_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
                          ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = 0.0, F16_DOTS: tl.constexpr = False):
    """Program (pair, n-block): h[pair, n-block] = silu(gate) * up (with HAS_BIAS / CLAMPED:
    fused_moe.activate's epilogue) from the dequantized rows n and N + n of its expert's w13 (N = I, K = H).
    F16_DOTS: int4's dots in packed halves (quant_tiles.int4_f16_dots)."""
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q_g, s_g, z_g, q_u, s_u, z_u = _gate_up_tiles(c_e, s_e, z_e, rows, n_ok, k0, N, K, stride_cn, stride_sn, INT4,
                                                      MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, F16_DOTS)
        if F16_DOTS:
            h0, h1, h2, h3, down, x_sums = f16_activations(x_ptr + token * stride_xt, k0, K, HAS_ZEROS, SK,
                                                           SCALE_MODE, BLOCK_K)
            acc_g += int4_f16_dots(q_g, s_g, z_g, h0, h1, h2, h3, down, x_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N,
                                   BLOCK_K)
            acc_u += int4_f16_dots(q_u, s_u, z_u, h0, h1, h2, h3, down, x_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N,
                                   BLOCK_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            acc_g += code_dots(q_g, s_g, z_g, s_e, z_e, rows, n_ok, k0, xv, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN,
                               SK, SCALE_MODE, BLOCK_N, BLOCK_K)
            acc_u += code_dots(q_u, s_u, z_u, s_e, z_e, rows + N, n_ok, k0, xv, K, stride_sn, INT4, MXFP4, HAS_ZEROS,
                               SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K)
    h = activate(acc_g, acc_u, b13_ptr, expert * stride_be, offs_n, n_ok, N, HAS_BIAS, CLAMPED, ALPHA, LIMIT)
    tl.store(h_ptr + pair * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _qdown_gemv_kernel(h_ptr, c_ptr, s_ptr, z_ptr, y_ptr, weights_ptr, expert_ids_ptr, num_pairs,
                       N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                       stride_hm, stride_ce, stride_cn, stride_se, stride_sn, stride_ys, stride_ym,
                       INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                       SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, F16_DOTS: tl.constexpr = False):
    """Program (pair, n-block, split): y[split, pair, n-block] = weight * the partial dot of h[pair]
    with the dequantized rows of its expert's w2 over K_PER_SPLIT columns (N = H, K = I); with
    HAS_BIAS the expert's b2 added by split 0. F16_DOTS: int4's dots in packed halves (quant_tiles.int4_f16_dots)."""
    pid = tl.program_id(0)
    pair = pid % num_pairs
    rest = pid // num_pairs
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = rest % num_n
    split = rest // num_n
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = split * K_PER_SPLIT + kk
        acc += quant_row_dots(c_e, s_e, z_e, rows, n_ok, k0, h_ptr + pair * stride_hm, K, stride_cn, stride_sn, INT4,
                              MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, F16_DOTS)
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc = acc * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(y_ptr + split * stride_ys + pair * stride_ym + offs_n, acc, mask=n_ok)


# -- run GEMV kernels (decode, pairs sharing an expert) -------------------------------------------
@triton.jit
def _run_pairs(sorted_ids_ptr, block_expert_ptr, num_pairs, num_runs, P: tl.constexpr):
    """The run of this program (the run index varies fastest in the grid): its expert (-1: none, past the
    padded length) and the P slots of sorted_ids it takes, each a pair index (num_pairs where the expert's
    run ends first) and whether it is one."""
    b = tl.program_id(0) % num_runs
    expert = tl.load(block_expert_ptr + b).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + b * P + tl.arange(0, P))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _qgate_up_runs_kernel(x_ptr, c_ptr, s_ptr, z_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, num_runs,
                          N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                          stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_hm,
                          INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                          SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          P: tl.constexpr, CHUNKS: tl.constexpr, b13_ptr=None, stride_be=0,
                          HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0,
                          LIMIT: tl.constexpr = 0.0, F16_DOTS: tl.constexpr = False):
    """Program (run, n-block): h[pair, n-block] for the up-to-P pairs of one
    expert's run (sorted_ids / block_expert_ids as moe_align_block_size gives them with block_m = P), each
    K step's two tiles decoded once and applied to every pair's x row. F16_DOTS: int4's dots in packed halves,
    each word decoded once for the P pairs (quant_tiles.run_f16_dots)."""
    expert, pairs, ok = _run_pairs(sorted_ids_ptr, block_expert_ptr, num_pairs, num_runs, P)
    if expert < 0:
        return
    pid_n = tl.program_id(0) // num_runs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc_g = tl.zeros((BLOCK_N, CHUNKS, P), dtype=tl.float32)  # per chunk of K, reduced after the loop
    acc_u = tl.zeros((BLOCK_N, CHUNKS, P), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q_g, s_g, z_g, q_u, s_u, z_u = _gate_up_tiles(c_e, s_e, z_e, rows, n_ok, k0, N, K, stride_cn, stride_sn, INT4,
                                                      MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, F16_DOTS)
        if F16_DOTS:
            h0, h1, h2, h3, down, x_sums = f16_activations(x_ptr + tokens * stride_xt, k0, K, HAS_ZEROS, SK,
                                                           SCALE_MODE, BLOCK_K, ok, P, CHUNKS)
            acc_g += run_f16_dots(q_g, s_g, z_g, h0, h1, h2, h3, down, x_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N,
                                  BLOCK_K, P, CHUNKS)
            acc_u += run_f16_dots(q_u, s_u, z_u, h0, h1, h2, h3, down, x_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N,
                                  BLOCK_K, P, CHUNKS)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + tokens[None, :] * stride_xt + offs_k[:, None],
                         mask=ok[None, :] & (offs_k < K)[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, P]
            acc_g += run_code_dots(q_g, s_g, z_g, s_e, z_e, rows, n_ok, k0, xs, K, stride_sn, INT4, MXFP4, HAS_ZEROS,
                                   SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, P, CHUNKS)
            acc_u += run_code_dots(q_u, s_u, z_u, s_e, z_e, rows + N, n_ok, k0, xs, K, stride_sn, INT4, MXFP4,
                                   HAS_ZEROS, SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, P, CHUNKS)
    h = activate(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), b13_ptr, expert * stride_be, offs_n[:, None],
                 n_ok[:, None], N, HAS_BIAS, CLAMPED, ALPHA, LIMIT)  # [BLOCK_N, P]
    tl.store(h_ptr + pairs.to(tl.int64)[None, :] * stride_hm + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
             mask=n_ok[:, None] & ok[None, :])


@triton.jit
def _qdown_runs_kernel(h_ptr, c_ptr, s_ptr, z_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs,
                       num_runs,
                       N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                       stride_hm, stride_ce, stride_cn, stride_se, stride_sn, stride_ys, stride_ym,
                       INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                       SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       P: tl.constexpr, CHUNKS: tl.constexpr, b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False,
                       F16_DOTS: tl.constexpr = False):
    """Program (run, n-block, split): y[split, pair, n-block] for the
    up-to-P pairs of one expert's run, each tile decoded once: weight[pair] * the partial dot of h[pair]
    over K_PER_SPLIT columns (N = H, K = I); with HAS_BIAS the expert's b2 added by split 0. F16_DOTS: int4's
    dots in packed halves (quant_tiles.run_f16_dots)."""
    expert, pairs, ok = _run_pairs(sorted_ids_ptr, block_expert_ptr, num_pairs, num_runs, P)
    if expert < 0:
        return
    rest = tl.program_id(0) // num_runs
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = rest % num_n
    split = rest // num_n
    pairs = pairs.to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc = tl.zeros((BLOCK_N, CHUNKS, P), dtype=tl.float32)  # per chunk of K, reduced after the loop
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = split * K_PER_SPLIT + kk
        q = code_values(c_e, rows, n_ok, k0, K, stride_cn, INT4, MXFP4, BLOCK_N, BLOCK_K, F16_DOTS)
        s, z = tile_scales(s_e, z_e, rows, n_ok, k0, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE,
                           BLOCK_N, BLOCK_K)
        if F16_DOTS:
            h0, h1, h2, h3, down, h_sums = f16_activations(h_ptr + pairs * stride_hm, k0, K, HAS_ZEROS, SK,
                                                           SCALE_MODE, BLOCK_K, ok, P, CHUNKS)
            acc += run_f16_dots(q, s, z, h0, h1, h2, h3, down, h_sums, HAS_ZEROS, SK, SCALE_MODE, BLOCK_N, BLOCK_K,
                                P, CHUNKS)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            hs = tl.load(h_ptr + pairs[None, :] * stride_hm + offs_k[:, None],
                         mask=ok[None, :] & (offs_k < K)[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, P]
            acc += run_code_dots(q, s, z, s_e, z_e, rows, n_ok, k0, hs, K, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                                 SCALE_MODE, BLOCK_N, BLOCK_K, P, CHUNKS)
    acc = tl.sum(acc, axis=1)
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    acc = acc * tl.load(weights_ptr + pairs, mask=ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + pairs[None, :] * stride_ym + offs_n[:, None], acc,
             mask=n_ok[:, None] & ok[None, :])


# -- grouped GEMM kernels -----------------------------------------------------------------------
@triton.jit
def _block_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """As fused_moe._block_coords: GROUP_M m-blocks sweep the n-blocks together (L2 reuse)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _orient(m_vals, n_vals, SWAP_AB: tl.constexpr):
    """A vector along the pairs (m) and one along the weight rows or K (n) broadcast to the grouped GEMM's
    tile orientation: [BLOCK_M, BLOCK_N] (pairs as rows), or with SWAP_AB [BLOCK_N, BLOCK_M] (pairs as columns)."""
    if SWAP_AB:
        return m_vals[None, :], n_vals[:, None]
    else:
        return m_vals[:, None], n_vals[None, :]


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _pair_rows(src_ptr, rows, row_ok, k0, K: tl.constexpr, stride, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """The activations of the block's pairs (rows: int64 row indices of src, valid where row_ok) over columns
    k0 .. k0 + BLOCK_K, 0 past K and on absent pairs: [BLOCK_M, BLOCK_K], or with SWAP_AB [BLOCK_K, BLOCK_M]."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    r, k = _orient(rows, offs_k, SWAP_AB)
    r_ok, k_ok = _orient(row_ok, offs_k < K, SWAP_AB)
    return tl.load(src_ptr + r * stride + k, mask=r_ok & k_ok, other=0.0)


@triton.jit
def _weight_dot(act, w, acc, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + act @ w.T (act [BLOCK_M, BLOCK_K], w the dequantized [BLOCK_N, BLOCK_K] tile), or with SWAP_AB
    acc + w @ act (act [BLOCK_K, BLOCK_M]): the weight tile the MMA's A operand, which wgmma reads from
    registers, the pairs its N (8 .. 256), so 16 or 32 pairs fill an MMA whose M would be at least 64."""
    if SWAP_AB:
        return dot_tiles(w.to(act.dtype), act, acc, UPCAST, IEEE)
    else:
        return dot_tiles(act, tl.trans(w).to(act.dtype), acc, UPCAST, IEEE)


@triton.jit
def _qgate_up_gemm_kernel(x_ptr, c_ptr, s_ptr, z_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr,
                          num_pairs, num_m_blocks, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                          stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_hm,
                          INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                          SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PER_TILE: tl.constexpr,
                          b13_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
                          ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = 0.0, SWAP_AB: tl.constexpr = False):
    """h[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, N + n]) (with HAS_BIAS / CLAMPED:
    fused_moe.activate's epilogue) for the pairs of one block, each weight tile dequantized to x's
    dtype before the dot (SWAP_AB: the transposed product, _weight_dot). N = I, K = H."""
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc_g = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        a = _pair_rows(x_ptr, token, row_ok, k0, K, stride_xt, BLOCK_K, SWAP_AB)
        g = dequant_tile(c_e, s_e, z_e, rows, n_ok, k0, K, stride_cn, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                         BLOCK_N, BLOCK_K, PER_TILE)
        u = dequant_tile(c_e, s_e, z_e, rows + N, n_ok, k0, K, stride_cn, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                         BLOCK_N, BLOCK_K, PER_TILE)
        acc_g = _weight_dot(a, g, acc_g, SWAP_AB, UPCAST, IEEE)
        acc_u = _weight_dot(a, u, acc_u, SWAP_AB, UPCAST, IEEE)
    pair_b, n_b = _orient(pair.to(tl.int64), offs_n, SWAP_AB)
    row_ok_b, n_ok_b = _orient(row_ok, n_ok, SWAP_AB)
    h = activate(acc_g, acc_u, b13_ptr, expert * stride_be, n_b, n_ok_b, N, HAS_BIAS, CLAMPED, ALPHA, LIMIT)
    tl.store(h_ptr + pair_b * stride_hm + n_b, h.to(h_ptr.dtype.element_ty), mask=row_ok_b & n_ok_b)


@triton.jit
def _qdown_gemm_kernel(h_ptr, c_ptr, s_ptr, z_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
                       num_pairs, num_m_blocks, N: tl.constexpr, K: tl.constexpr,
                       stride_hm, stride_ce, stride_cn, stride_se, stride_sn, stride_ym,
                       INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                       SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PER_TILE: tl.constexpr,
                       b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    """y[pair, n] = weight[pair] * (h[pair] . w2[e, n] (+ b2[e, n] with HAS_BIAS)) in fp32, w2's tiles
    dequantized (SWAP_AB: the transposed product, _weight_dot). N = H, K = I."""
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n, n_ok, rows, c_e, s_e, z_e = _expert_rows(c_ptr, s_ptr, z_ptr, expert, pid_n, N, stride_ce, stride_se,
                                                     BLOCK_N)
    acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        a = _pair_rows(h_ptr, pair, row_ok, k0, K, stride_hm, BLOCK_K, SWAP_AB)
        b = dequant_tile(c_e, s_e, z_e, rows, n_ok, k0, K, stride_cn, stride_sn, INT4, MXFP4, HAS_ZEROS, SN, SK,
                         BLOCK_N, BLOCK_K, PER_TILE)
        acc = _weight_dot(a, b, acc, SWAP_AB, UPCAST, IEEE)
    pair_b, n_b = _orient(pair, offs_n, SWAP_AB)
    if HAS_BIAS:
        acc += _orient(pair, tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32),
                       SWAP_AB)[1]
    w = _orient(tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32), offs_n, SWAP_AB)[0]
    row_ok_b, n_ok_b = _orient(row_ok, n_ok, SWAP_AB)
    tl.store(y_ptr + pair_b * stride_ym + n_b, acc * w, mask=row_ok_b & n_ok_b)


# -- launchers ----------------------------------------------------------------------------------
def _check_block_k(block_k: int, *weights: QuantizedWeight) -> None:
    for w in weights:
        if w.method in ("int4", "mxfp4") and block_k % 8:
            raise ValueError(f"block_k={block_k} must be a multiple of 8 for {w.method} weights")


def _launch_gemm_down(h, w2, y, weights, sorted_ids, block_expert_ids, M, H, I, cfg, upcast, ieee, epilogue=None,
                      swap_ab=False):
    c, s, z, sce, scn, sse, ssn = weight_args(w2)
    _qdown_gemm_kernel[(block_expert_ids.numel() * triton.cdiv(H, cfg.block_n),)](
        h, c, s, z, y, weights, sorted_ids, block_expert_ids, M, block_expert_ids.numel(), H, I,
        h.stride(0), sce, scn, sse, ssn, y.stride(0), **layout_constants(w2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=upcast,
        IEEE=ieee, PER_TILE=scale_mode(w2.scale_block[1], I, cfg.block_k) == SCALES_PER_TILE, SWAP_AB=swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **(epilogue or {}))


def fused_moe_quant(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, path: str | None = None,
                    config: GemmConfig | QuantGemvConfig | None = None,
                    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                    clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """fused_moe_ref's contract with quantized experts: x [T, H] (16-bit or fp32); w13 a
    QuantizedWeight [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k] -> [T, H] in x.dtype.
    path: "gemv" (a program per pair) | "runs" (a program per run of up to P pairs of one expert, each tile
    decoded once for all of them; T*k <= ALIGN_MAX_PAIRS) | "gemm" | "gemm_swap" (the grouped GEMM's transposed
    product: the weight tile the MMA's A operand, the pairs its N; config default: default_swap_config) | None
    (default_path: "gemm_swap" for int4 past GEMV_MAX_PAIRS). gpt-oss's experts
    (clamped_swiglu_moe_ref's contract): biases (b13 [E, 2I], b2 [E, H]) and clamped_swiglu (alpha,
    limit), as fused_moe takes them."""
    T, H = x.shape
    E, two_i, H_w = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    if H_w != H or two_i != 2 * I or tuple(w2.shape) != (E, H, I) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe_quant: shapes do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}")
    epilogue = epilogue_args(w13, w2, biases, clamped_swiglu)
    x = x if x.stride(-1) == 1 else x.contiguous()
    M = T * k
    if M == 0:
        return torch.zeros_like(x)
    if path is None:
        path = default_path(M, E, w13.method)
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).contiguous()
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)  # [M, I]
    if path == "gemv":
        cfg = config or default_quant_gemv(w13)
        _check_block_k(cfg.block_k, w13, w2)
        launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        c, s, z, sce, scn, sse, ssn = weight_args(w13)
        _qgate_up_gemv_kernel[(M * triton.cdiv(I, cfg.block_n),)](
            x, c, s, z, h, ids, M, I, H, k, x.stride(0), sce, scn, sse, ssn, h.stride(0),
            **layout_constants(w13), SCALE_MODE=scale_mode(w13.scale_block[1], H, cfg.block_k), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, **epilogue["gate_up"], **launch,
            F16_DOTS=use_f16_dots(cfg.f16_dots, w13.method, x.device.type, w13.scale_block[1], H, cfg.block_k))
        num_n = triton.cdiv(H, cfg.block_n)
        k_blocks = triton.cdiv(I, cfg.block_k)
        splits = min(cfg.num_splits or default_splits(M * num_n, k_blocks, num_sms_of(x.device)), k_blocks)
        k_per_split = triton.cdiv(k_blocks, splits) * cfg.block_k
        splits = triton.cdiv(I, k_per_split)
        y = torch.empty(splits, M, H, dtype=torch.float32, device=x.device)  # [S, M, H]
        c, s, z, sce, scn, sse, ssn = weight_args(w2)
        _qdown_gemv_kernel[(M * num_n * splits,)](
            h, c, s, z, y, weights, ids, M, H, I, k_per_split, h.stride(0), sce, scn, sse, ssn,
            y.stride(0), y.stride(1), **layout_constants(w2), SCALE_MODE=scale_mode(w2.scale_block[1], I, cfg.block_k),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **epilogue["down"], **launch,
            F16_DOTS=use_f16_dots(cfg.f16_dots, w2.method, x.device.type, w2.scale_block[1], I, cfg.block_k))
        return sum_partials(y.view(splits, T, k, H), x.dtype)
    if path == "runs":
        return _runs(x, w13, w2, weights, topk_ids, h, E, k, config or default_quant_gemv(w13), epilogue)
    if path not in ("gemm", "gemm_swap"):
        raise ValueError(f"fused_moe_quant: path must be 'gemv', 'runs', 'gemm', 'gemm_swap' or None, got {path!r}")
    swap = path == "gemm_swap"
    cfg = config or (default_swap_config if swap else default_gemm_config)(M, E)
    _check_block_k(cfg.block_k, w13, w2)
    sorted_ids, block_expert_ids, _ = moe_align_block_size(topk_ids, E, cfg.block_m)
    num_m_blocks = block_expert_ids.numel()
    upcast = interpreting() and x.dtype == torch.bfloat16
    ieee = x.dtype == torch.float32
    c, s, z, sce, scn, sse, ssn = weight_args(w13)
    _qgate_up_gemm_kernel[(num_m_blocks * triton.cdiv(I, cfg.block_n),)](
        x, c, s, z, h, sorted_ids, block_expert_ids, M, num_m_blocks, I, H, k,
        x.stride(0), sce, scn, sse, ssn, h.stride(0), **layout_constants(w13),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=upcast,
        IEEE=ieee, PER_TILE=scale_mode(w13.scale_block[1], H, cfg.block_k) == SCALES_PER_TILE, SWAP_AB=swap,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **epilogue["gate_up"])
    y = torch.empty(M, H, dtype=torch.float32, device=x.device)  # [M, H], one row per pair
    _launch_gemm_down(h, w2, y, weights, sorted_ids, block_expert_ids, M, H, I, cfg, upcast, ieee, epilogue["down"],
                      swap)
    return sum_partials(y.view(1, T, k, H), x.dtype)


def _runs(x, w13, w2, weights, topk_ids, h, E, k, cfg: QuantGemvConfig, epilogue):
    """fused_moe_quant's "runs" path: the pairs sorted by expert in one launch (moe_align_small, runs padded
    to P), then the run GEMVs, program (run, n-block[, split]) with the run varying fastest."""
    T, H = x.shape
    M, I = h.shape
    if M > ALIGN_MAX_PAIRS:
        raise ValueError(f"fused_moe_quant: path 'runs' takes at most {ALIGN_MAX_PAIRS} pairs, got {M}")
    _check_block_k(cfg.block_k, w13, w2)
    P = cfg.run_pairs or default_run_pairs(M, E)
    if P & (P - 1):
        raise ValueError(f"run_pairs must be a power of 2, got {P}")
    sorted_ids, block_expert_ids = moe_align_small(topk_ids, E, P)
    runs = block_expert_ids.numel()
    launch = dict(P=P, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    f16_13 = use_f16_dots(cfg.f16_dots, w13.method, x.device.type, w13.scale_block[1], H, cfg.block_k)
    c, s, z, sce, scn, sse, ssn = weight_args(w13)
    _qgate_up_runs_kernel[(runs * triton.cdiv(I, cfg.block_n),)](
        x, c, s, z, h, sorted_ids, block_expert_ids, M, runs, I, H, k, x.stride(0), sce, scn, sse, ssn, h.stride(0),
        **layout_constants(w13), SCALE_MODE=scale_mode(w13.scale_block[1], H, cfg.block_k), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, CHUNKS=run_chunks(w13.scale_block[1], H, cfg.block_k, f16_13), F16_DOTS=f16_13,
        **epilogue["gate_up"], **launch)
    num_n = triton.cdiv(H, cfg.block_n)
    k_blocks = triton.cdiv(I, cfg.block_k)
    # runs that hold pairs: at most one a pair, one an expert present plus one per P pairs
    busy = min(M, min(E, M) + M // P)
    splits = min(cfg.num_splits or default_splits(busy * num_n, k_blocks, num_sms_of(x.device)), k_blocks)
    k_per_split = triton.cdiv(k_blocks, splits) * cfg.block_k
    splits = triton.cdiv(I, k_per_split)
    y = torch.empty(splits, M, H, dtype=torch.float32, device=x.device)  # [S, M, H]
    f16_2 = use_f16_dots(cfg.f16_dots, w2.method, x.device.type, w2.scale_block[1], I, cfg.block_k)
    c, s, z, sce, scn, sse, ssn = weight_args(w2)
    _qdown_runs_kernel[(runs * num_n * splits,)](
        h, c, s, z, y, weights, sorted_ids, block_expert_ids, M, runs, H, I, k_per_split, h.stride(0),
        sce, scn, sse, ssn, y.stride(0), y.stride(1), **layout_constants(w2),
        SCALE_MODE=scale_mode(w2.scale_block[1], I, cfg.block_k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        CHUNKS=run_chunks(w2.scale_block[1], I, cfg.block_k, f16_2), F16_DOTS=f16_2, **epilogue["down"], **launch)
    return sum_partials(y.view(splits, T, k, H), x.dtype)


def quant_gemm(x: torch.Tensor, w: QuantizedWeight, config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K].T -> fp32 [T, N] through the down GEMM with one expert (every row its
    pair, weight 1): the weight's tiles dequantized in the kernel, no dequantized copy in memory."""
    T, K = x.shape
    N = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = config or default_gemm_config(T, 1)
    _check_block_k(cfg.block_k, w)
    ids = torch.zeros(T, 1, dtype=torch.int64, device=x.device)
    sorted_ids, block_expert_ids, _ = moe_align_block_size(ids, 1, cfg.block_m)
    ones = torch.ones(T, dtype=torch.float32, device=x.device)
    y = torch.empty(T, N, dtype=torch.float32, device=x.device)
    upcast = interpreting() and x.dtype == torch.bfloat16
    _launch_gemm_down(x, w, y, ones, sorted_ids, block_expert_ids, T, N, K, cfg, upcast, x.dtype == torch.float32)
    return y


def fused_experts(x: torch.Tensor, w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """fused_moe for 16-bit experts, fused_moe_quant for quantized ones (both quantized or neither);
    biases / clamped_swiglu: gpt-oss's epilogues (fused_moe's contract)."""
    if isinstance(w13, QuantizedWeight) != isinstance(w2, QuantizedWeight):
        raise ValueError("w13 and w2 must both be quantized or both not")
    if isinstance(w13, QuantizedWeight):
        return fused_moe_quant(x, w13, w2, topk_weights, topk_ids, biases=biases, clamped_swiglu=clamped_swiglu)
    return fused_moe(x, w13, w2, topk_weights, topk_ids, biases=biases, clamped_swiglu=clamped_swiglu)
