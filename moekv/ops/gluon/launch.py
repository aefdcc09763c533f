"""What the Gluon decode launchers (nuq2, int4, kivi2, vq) share: the default split count, the device
checks, the partial buffers and the staged tail's (and residual ring's) kernel arguments, and the reduce. Each format's
launcher (moekv/ops/gluon/<format>_decode.py) adds its own kernel's tables and constants; the input
checks are in checks.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.ops.decode.launch import sm_count
from moekv.ops.gluon.checks import Staged, check_extras, check_inputs, check_tail_splits
from moekv.ops.gluon.tables import HEAD_DIM, PAGE_TOKENS

NO_WINDOW = 1 << 30  # a window longer than any context (moekv.ops.decode.common.NO_WINDOW)
TARGET_PROGRAMS = 4096  # one-warp programs per launch the default split count aims at (~3 waves on an H200)
# more splits at batch 1 cost more in the reduce and per-split setup than they gain in parallelism
# (docs/decisions.md, "nuq2's outlier slots folded into the tile loop as one-hot MMAs")
MAX_SPLITS = 256
REGISTERS_PER_SM = 65536
MAX_PROGRAMS_PER_SM = 32  # resident blocks an SM holds (sm_80 .. sm_90)


def programs_per_sm(max_registers: int | None) -> int:
    """One-warp programs an SM holds at a register cap (None: ptxas's own choice, taken as 255: every
    Gluon decode kernel reaches it uncapped)."""
    regs = -(-(max_registers or 255) // 8) * 8  # a warp's registers are allocated in units of 256
    return max(1, min(MAX_PROGRAMS_PER_SM, REGISTERS_PER_SM // (32 * regs)))


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, extra: int = 0, wave: int | None = None) -> int:
    """Splits per (sequence, KV head): about TARGET_PROGRAMS programs, each with at least 2 pages,
    and with the `extra` splits (the staged tail's programs) at most MAX_SPLITS in all: more splits at batch 1
    cost more in the reduce and per-split setup than they gain in parallelism, and the reduce pads
    the split count to a power of two (257 partials are reduced as 512).
    wave: programs the GPU runs at once (SMs x programs_per_sm). A launch of between one and two waves
    (the staged split's programs counted) is cut to one: a partial second wave runs its programs after
    the first on an almost empty GPU, and staged programs left out of the wave wait for a whole paged
    one to end (docs/decisions.md, "Prefetch and whole waves for the Gluon launches")."""
    rows = max(1, batch * num_kv_heads)
    want = -(-TARGET_PROGRAMS // rows)
    splits = max(1, min(want, -(-max_pages // 2), MAX_SPLITS - extra))
    if wave and wave < rows * (splits + extra) < 2 * wave:
        splits = max(1, wave // rows - extra)
    return splits


# tokens of a residual ring's tail one program reads where the wave has room for more tail programs: the
# tail's tokens are read 16 a step, each step waiting on the last (the online softmax), so one program
# walking a whole ring of 128 (nuq2) or 256 (vq) tokens outlasted every page split at batch 1 (their 2
# pages each at 4k): +23% and 2x the time without the ring (docs/decisions.md, "The windows' decode cost
# and keys before RoPE in Triton, measured"); 32 tokens are 2 steps, shorter than a page split's pages
TAIL_TOKENS = 32


def default_tail_splits(rows: int, num_splits: int, ring: int, wave: int) -> int:
    """Programs per (sequence, KV head) reading the 16-bit tail beside num_splits page splits: with a
    residual ring of `ring` tokens, its tail (the ring's tokens, or up to a page's staged ones when the
    ring is shorter) in shares of TAIL_TOKENS, as many as one wave of `wave` programs holds beside the
    page splits (and MAX_SPLITS partials): there the tail's serial walk is the launch's critical path.
    Where the page splits fill the wave (a launch of several waves, batch 16 and more at 32k) one: the
    tail programs run after the pages' in the dispatch order, among many, and more of them would only
    add programs. Without a ring (the staged page alone, at most 64 tokens) one, as the kernels without
    a ring read it."""
    if ring <= 0:
        return 1
    want = -(-max(ring, PAGE_TOKENS) // TAIL_TOKENS)
    return max(1, min(want, wave // max(rows, 1) - num_splits, MAX_SPLITS - num_splits))


def plan_splits(B: int, Hkv: int, max_pages: int, staged: bool, ring: int, wave: int, num_splits: int | None = None,
                tail_splits: int | None = None) -> tuple[int, int]:
    """(page splits, tail splits) of a launch (tail splits 0 without the staged tail); None: the default
    rules. The pages take default_num_splits with room left for the tail's default_tail_splits (at batch
    1 the wave holds both); where the tail then has no room in the wave, the page splits are those of a
    single tail program (the launch without a ring)."""
    rows = max(1, B * Hkv)
    if num_splits is None:
        want = default_tail_splits(rows, 0, ring, wave) if staged and tail_splits is None else (tail_splits or 1)
        num_splits = default_num_splits(B, Hkv, max_pages, int(staged) * want, wave)
        if staged and tail_splits is None and want > 1 and default_tail_splits(rows, num_splits, ring, wave) == 1:
            num_splits = default_num_splits(B, Hkv, max_pages, 1, wave)
    if not staged:
        return num_splits, 0
    if tail_splits is None:
        tail_splits = default_tail_splits(rows, num_splits, ring, wave)
    return num_splits, check_tail_splits(tail_splits, ring)


def check_device(fmt: str, q: torch.Tensor) -> None:
    """ValueError unless q can go to a Gluon kernel: a CUDA tensor in fp16 or bf16."""
    if not q.is_cuda:
        raise ValueError(f"{fmt} Gluon decode runs on CUDA devices only (Gluon has no CPU or interpreter backend); "
                         f"{fmt}_decode_split_reference computes the same on any device")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{fmt} Gluon decode: q must be fp16 or bf16, got {q.dtype}")


def check_launch(fmt: str, q: torch.Tensor, frag, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 num_splits: int | None, staged: Staged | None, sliding_window: int | None) -> tuple[int, int, int]:
    """(B, Hkv, G) of a launch over fmt's fragment pages, or ValueError: the inputs (check_inputs,
    check_extras), then the device (check_device)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits or 1, fmt)
    check_extras(staged, sliding_window, B, Hkv)
    check_device(fmt, q)
    return B, Hkv, G


def gluon_missing(fmt: str, e: ImportError) -> RuntimeError:
    """The error a launcher raises when its kernel module does not import (Triton without Gluon)."""
    return RuntimeError(f"{fmt} Gluon decode needs triton.experimental.gluon (Triton >= 3.6): {e}")


def fills_wave(rows: int, ns_total: int, wave: int) -> bool:
    """Whether a launch of rows x ns_total one-warp programs (the staged split's included) fills a wave of
    the device: it leaves no room for one more split. The rule of the shared-memory stagings (and of vq's
    shared codebooks), which cost a small launch more than they save; a launch the split rule cuts to one
    wave counts as full."""
    return rows * (ns_total + 1) > wave


@dataclass
class Launch:
    """A launch's split count, grid, partial buffers and staged-tail arguments."""
    num_splits: int
    ns_total: int  # num_splits + tail_splits
    tail_splits: int  # programs reading the staged tail (and residual ring): 0 without staging
    grid: tuple[int, int]  # (B * Hkv, ns_total)
    part_o: torch.Tensor  # fp32 [B, Hq, ns_total, 128]
    part_lse: torch.Tensor  # fp32 [B, Hq, ns_total]
    seq_slots: torch.Tensor
    k_stage: torch.Tensor
    v_stage: torch.Tensor
    stage_strides: tuple[int, int, int]
    window: int  # NO_WINDOW for none
    wave: int  # programs the device runs at once at the kernel's register cap (SMs x programs_per_sm)

    @property
    def fills_wave(self) -> bool:
        """fills_wave of this launch's grid (the shared-memory stagings' rule)."""
        return fills_wave(self.grid[0], self.ns_total, self.wave)


def plan_launch(q: torch.Tensor, B: int, Hkv: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                num_splits: int | None, staged: Staged | None, sliding_window: int | None,
                max_registers: int | None = None, ring: int = 0, tail_splits: int | None = None) -> Launch:
    """The split counts (plan_splits: pages and, with `staged`, the tail's programs, a residual ring of
    `ring` tokens in shares; whole waves of the device at the kernel's register cap), the fp32 partials
    and the staged tail's arguments (without a tail, q and context_lens stand in: the kernel does not
    read them)."""
    wave = sm_count(q.device) * programs_per_sm(max_registers)
    num_splits, tail_splits = plan_splits(B, Hkv, block_tables.shape[1], staged is not None, ring, wave,
                                          num_splits, tail_splits)
    ns_total = num_splits + tail_splits
    Hq = q.shape[1]
    part_o = torch.empty(B, Hq, ns_total, HEAD_DIM, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, Hq, ns_total, dtype=torch.float32, device=q.device)
    if staged is not None:
        k_stage, v_stage, seq_slots = staged
        st = k_stage.stride()
    else:  # unused: any tensors stand in
        k_stage = v_stage = q
        seq_slots = context_lens
        st = (0, 0, 0)
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    return Launch(num_splits, ns_total, tail_splits, (B * Hkv, ns_total), part_o, part_lse, seq_slots, k_stage,
                  v_stage, tuple(st[:3]), window, wave)


def ring_args(run: Launch, residual) -> tuple:
    """A residual ring's kernel arguments: (k_ring, v_ring, (stride_rs, stride_rh, stride_rt)); without
    one the staging tensors stand in, strides 0 (the kernel does not read them)."""
    if residual is None:
        return run.k_stage, run.v_stage, (0, 0, 0)
    k_ring, v_ring = residual
    return k_ring, v_ring, tuple(k_ring.stride()[:3])


def register_cap(max_registers: int | None) -> dict:
    """The launch option capping ptxas's registers ({} for its own choice)."""
    return {"maxnreg": int(max_registers)} if max_registers else {}


def reduce_on_device(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The paged decode kernel's reduce (the partials have its layout) into out [B, Hq, D]; sinks
    [Hq]: each head's sink logit joining the merge (ops/decode/common.reduce_head), or None."""
    from moekv.ops.decode.paged import reduce_partials

    reduce_partials(part_o, part_lse, out, part_o.shape[2], pdl=False, sinks=sinks)
    return out
