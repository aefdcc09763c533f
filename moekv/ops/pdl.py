"""Programmatic dependent launch (PDL, Hopper and later): let a weight-streaming GEMV start while the
small kernel before it is still running.

At batch 1 a decode step is ~15 launches per layer, and each large GEMV begins with an idle ramp:
its programs are scheduled only once the previous kernel has finished, and their first weight loads
take a full memory latency. With PDL the previous kernel signals early (`launch_dependents`); the
GEMV's programs become resident, issue L2 prefetches for their weight slab (the weights do not
depend on the previous kernel), then wait (`wait_for_inputs`) until the previous kernel has
completed and its writes are visible, and only then read activations.

Rules that keep this race-free (every kernel named here follows them):
- a kernel launched with PDL calls `wait_for_inputs` before it reads anything an earlier kernel
  wrote (except as below) and before it writes anything;
- a kernel calls `let_dependents_launch` only after its own `wait_for_inputs` (if it has one), so a
  dependent that starts early knows every kernel before its predecessor has completed: the MoE
  down GEMV reads its expert ids (written by the top-k kernel, two launches back) before waiting.

On by default on CUDA devices of compute capability >= 9.0 (MOEKV_PDL=0 turns it off: moekv/envs.py);
the flags are constexprs, so kernels built without it (and the CPU interpreter) carry none of this. Measured on
the H200 (benchmarks/sweep_decode_b1.py): batch-1 step 7.30 -> 7.19 ms without prefetch; prefetching
the first 1 or 2 K tiles made it slower (7.38 / 7.40 ms), the whole slab much slower (+0.5 ms:
the prefetches of every resident program thrash the 50 MB L2 and compete with the kernel before).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moekv import envs

LINE_ELEMENTS_16BIT = tl.constexpr(64)  # 16-bit elements per 128-byte line


@lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (Hopper+, unless MOEKV_PDL=0)."""
    if device.type != "cuda" or not envs.pdl():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword that asks for PDL (none when off: the interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(row_ptrs, n_ok, num_cols, LINES: tl.constexpr):
    """Ask L2 for num_cols 16-bit elements from each of the rows starting at row_ptrs [BLOCK_N]
    (rows with n_ok False are skipped): one prefetch per 128-byte line, LINES >= num_cols / 64 a
    power of two; nothing is read into registers."""
    line = tl.arange(0, LINES)
    ok = n_ok[:, None] & (line[None, :] * LINE_ELEMENTS_16BIT < num_cols)
    prefetch_l2(tl.where(ok, (row_ptrs[:, None] + line[None, :] * LINE_ELEMENTS_16BIT).to(tl.int64, bitcast=True), 0))


@triton.jit
def prefetch_l2(addr):
    """Ask L2 for the 128-byte line at each address of `addr` (int64; 0: none); no register is
    written, so nothing waits for it. Compiled kernels only (inline PTX)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s64 p, $1, 0; @p prefetch.global.L2 [$1]; } // $0", "=r,l",
                              [addr], dtype=tl.int32, is_pure=False, pack=1)


# How much of its slab a GEMV prefetches into L2 before waiting, in its own K tiles (None: all of
# it). 0: none, the measured best (see the module docstring); kept settable for the sweep.
PREFETCH_TILES: int | None = 0


def prefetch_cols(num_cols: int, block_k: int) -> int:
    """Columns of a row to prefetch: PREFETCH_TILES tiles of block_k, at most num_cols."""
    return num_cols if PREFETCH_TILES is None else min(num_cols, PREFETCH_TILES * block_k)


def prefetch_lines(num_cols: int) -> int:
    """LINES for prefetch_rows_l2: 128-byte lines in num_cols 16-bit elements, rounded up to a power
    of two (0 when nothing is prefetched)."""
    return triton.next_power_of_2(triton.cdiv(num_cols, LINE_ELEMENTS_16BIT.value)) if num_cols else 0
