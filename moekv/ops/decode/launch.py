"""How a split-K decode launch is shaped (both decode launchers, paged.py and tiered.py): how many splits
share a (sequence, KV head)'s tiles, and whether ptxas's register cap is kept, chosen from the compiled
kernel's programs per SM; and the per-device tuning those choices and the formats' specs read.

Tuning: moekv/ops/configs/decode_attention_<device>.json (moekv.ops.tuning), written by the sweeps'
--write-config (benchmarks/bench_decode_attention.py, sweep_decode_splits.py).
`decode_tuning()` is the current device's, loaded once; an unknown device (and the CPU) gets the
default device's numbers (moekv.ops.tuning.DEFAULT_DEVICE).

Caches (each one object, documented where it is made): OCCUPANCY (launch key -> programs per SM and
spills of the compiled kernel), sm_count (an SMCounts: device -> SMs); LAST_LAUNCH records what the last
launch chose.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import triton

from moekv.ops.decode.common import DecodeSpec
from moekv.ops.tuning import current_device_name, load_tuning


@dataclass(frozen=True)
class FormatTuning:
    """One format's tuned launch (DecodeSpec's fields of the same names; unset: the spec's defaults)."""

    prefetch: int = 0  # L2 prefetch distance in tiles (0: off)
    split_factor: int = 1  # x num_splits_for's splits where the kernel's occupancy is unknown
    swap_ab: bool = False  # transposed products
    max_registers: int | None = None  # ptxas's register cap (None: its own choice)
    capped_min_page: int | None = None  # pages below this keep ptxas's choice (None: DecodeTuning's)
    tail_in_last_split: bool = True  # the last split reads the 16-bit tail (else a program of its own)


@dataclass(frozen=True)
class DecodeTuning:
    """The tuned constants of the decode launchers on one device (a decode_attention_<device>.json)."""

    device: str  # the file's device key (the default device's for an unknown one)
    block_n: int = 64  # tokens per tile of a compiled launch
    split_waves: int = 2  # num_splits_for: programs to fill the GPU this many times ...
    split_double_from: int = 64  # ... twice that from this many (sequence, KV head) pairs on
    split_min_tiles: int = 2  # tiles a split gets at least (num_splits_for, wave_splits)
    max_splits: int = 128
    wave_fill: float = 0.95  # wave_splits: the share of the last wave of programs that must be busy
    min_capped_tiles: int = 8  # a default cap whose kernel spills is dropped below this many tiles a split
    capped_min_page: int = 64  # pages below this keep ptxas's choice (tiles spanning pages need more registers)
    formats: dict[str, FormatTuning] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> DecodeTuning:
        known = {f for f in cls.__dataclass_fields__ if f != "formats"}
        unknown = set(data) - known - {"formats", "comment"}
        if unknown:
            raise ValueError(f"decode tuning for {data.get('device')!r}: unknown keys {sorted(unknown)}")
        formats = {name: FormatTuning(**entry) for name, entry in data.get("formats", {}).items()}
        return cls(**{k: v for k, v in data.items() if k in known}, formats=formats)

    def format(self, name: str) -> FormatTuning:
        return self.formats.get(name, FormatTuning())

    def register_cap(self, fmt_name: str, block_size: int) -> int | None:
        """DecodeSpec.max_registers of a format at this page size (None: ptxas's own choice)."""
        tuned = self.format(fmt_name)
        min_page = self.capped_min_page if tuned.capped_min_page is None else tuned.capped_min_page
        return tuned.max_registers if block_size >= min_page else None


@functools.cache
def tuning_for(device_name: str | None) -> DecodeTuning:
    """The decode tuning of a device named as torch.cuda.get_device_name says (None: no GPU), loaded once."""
    return DecodeTuning.from_json(load_tuning("decode_attention", device_name))


def decode_tuning() -> DecodeTuning:
    """The decode tuning of the current CUDA device (the default device's without one)."""
    return tuning_for(current_device_name())


def format_tuning(fmt_name: str) -> FormatTuning:
    """A format's tuned launch on the current device (what its spec builder puts in its DecodeSpec)."""
    return decode_tuning().format(fmt_name)


def register_cap(fmt_name: str, block_size: int) -> int | None:
    """DecodeSpec.max_registers of a format at this page size on the current device (None: ptxas's own
    choice); for tiered, its launcher's default."""
    return decode_tuning().register_cap(fmt_name, block_size)


def spec_launch(fmt_name: str, block_size: int) -> dict:
    """A DecodeSpec's launch fields (prefetch, split_factor, swap_ab, max_registers, tail_in_last_split) of a
    format at this page size, tuned for the current device: what its spec builder passes on."""
    tuned = format_tuning(fmt_name)
    return {"prefetch": tuned.prefetch, "split_factor": tuned.split_factor, "swap_ab": tuned.swap_ab,
            "max_registers": register_cap(fmt_name, block_size), "tail_in_last_split": tuned.tail_in_last_split}


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Enough programs to fill the GPU split_waves times, each with at least split_min_tiles tiles of
    work, and twice that with split_double_from or more (sequence, KV head) pairs (it evens out the
    last wave of programs); at most max_splits."""
    tuned = decode_tuning()
    want = math.ceil(tuned.split_waves * num_sms / max(1, batch * num_kv_heads))
    if batch * num_kv_heads >= tuned.split_double_from:
        want *= 2
    return max(1, min(want, math.ceil(max_context / (tuned.split_min_tiles * block_n)), tuned.max_splits))


def default_num_splits(spec: DecodeSpec, batch: int, num_kv_heads: int, max_context: int, block_n: int,
                       num_sms: int) -> int:
    """The splits of a launch whose occupancy is unknown (the interpreter, or a kernel that could
    not be compiled ahead): num_splits_for's x spec.split_factor, at most one tile each."""
    splits = num_splits_for(batch, num_kv_heads, max_context, block_n, num_sms) * spec.split_factor
    return max(1, min(splits, math.ceil(max_context / block_n)))


@functools.lru_cache(maxsize=4096)  # called for every layer of an eager step, with the same numbers
def wave_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int,
                programs_per_sm: int) -> int:
    """Splits chosen by how full the last wave of programs is: the fewest, from 2, at which the
    B * Hkv * splits programs fill whole waves of num_sms * programs_per_sm to the tuning's
    wave_fill (all the first wave holds when that is the one), each split at least split_min_tiles
    tiles (at most max_splits); where none does (short contexts at small batch), the fullest. The
    decode kernels' time follows the last wave's fill more than their instruction count."""
    tuned = decode_tuning()
    pairs = max(1, batch * num_kv_heads)
    slots = num_sms * max(1, programs_per_sm)
    cap = max(1, min(tuned.max_splits, math.ceil(max_context / (tuned.split_min_tiles * block_n))))
    best, best_fill = cap, -1.0
    for splits in range(min(2, cap), cap + 1):
        programs = pairs * splits
        fill = programs / (slots * math.ceil(programs / slots))
        if fill >= tuned.wave_fill:  # within one wave: as many as it holds
            return min(cap, slots // pairs) if programs <= slots else splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


class OccupancyCache:
    """(programs per SM, spill bytes) of each compiled decode kernel, by its launch key (occupancy_key,
    or the tiered launcher's): a kernel is compiled ahead of its first launch to learn them, once a
    process. Entries never go stale (the key holds everything the compile depends on)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, tuple[int, int]] = {}

    def get(self, key: tuple, compile_and_measure) -> tuple[int, int]:
        """The entry of `key`, made by compile_and_measure() -> (programs per SM, spills) the first time."""
        found = self._by_key.get(key)
        if found is None:
            found = self._by_key[key] = compile_and_measure()
        return found

    def items(self) -> list[tuple[tuple, tuple[int, int]]]:
        return list(self._by_key.items())

    def forget(self, keep=lambda key: False) -> None:
        """Drop every entry whose key `keep` does not accept (all of them by default)."""
        self._by_key = {k: v for k, v in self._by_key.items() if keep(k)}


class SMCounts:
    """Streaming multiprocessors of each CUDA device, read once (a device query costs microseconds and the
    launchers ask every layer). A non-CUDA device (the interpreter) counts as 4 SMs."""

    INTERPRETER_SMS = 4

    def __init__(self) -> None:
        self._by_index: dict[int, int] = {}

    def __call__(self, device: torch.device) -> int:
        if device.type != "cuda":
            return self.INTERPRETER_SMS
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._by_index:
            self._by_index[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._by_index[index]


OCCUPANCY = OccupancyCache()
sm_count = SMCounts()
# What the last decode launch (paged or tiered) chose: num_splits, max_registers (None: no cap), grid.
# A record for tests and benchmarks, overwritten by every launch.
LAST_LAUNCH: dict = {}


def launch_split_kernel(kernel_fn, kernel_args, launch_key, default_splits: int, num_splits: int | None,
                        max_registers: int, cap_is_default: bool, batch: int, num_kv_heads: int, max_context: int,
                        block_n: int, num_warps: int, num_stages: int, interpret: bool, device: torch.device):
    """Launch a split-K decode kernel (both decode launchers) on grid (batch * num_kv_heads, ns_total)
    and return (part_o, part_lse, ns_total). kernel_args(num_splits) -> (part_o, part_lse, ns_total,
    args); launch_key(regs): what the compiled kernel under cap regs depends on. Compiled: splits
    and cap by choose_launch at the kernel's occupancy (compiled once per key, before the launch);
    interpreted: num_splits or default_splits, no cap."""
    if interpret:
        num_splits, max_registers = num_splits or default_splits, 0
    else:
        def occupancy(regs):
            def compile_and_measure():
                *_, ns_total, args = kernel_args(default_splits)
                return compiled_occupancy(kernel_fn, args, (batch * num_kv_heads, ns_total), num_warps, num_stages,
                                          regs, device)

            return OCCUPANCY.get(launch_key(regs), compile_and_measure)

        num_splits, max_registers = choose_launch(num_splits, max_registers, cap_is_default, occupancy, batch,
                                                  num_kv_heads, max_context, block_n, sm_count(device))
    part_o, part_lse, ns_total, args = kernel_args(num_splits)
    LAST_LAUNCH.update(num_splits=num_splits, max_registers=max_registers or None,
                       grid=(batch * num_kv_heads, ns_total))
    kernel_fn[(batch * num_kv_heads, ns_total)](*args, num_warps=num_warps, num_stages=num_stages,
                                                **({"maxnreg": max_registers} if max_registers else {}))
    return part_o, part_lse, ns_total


def programs_per_sm(n_regs: int, shared: int, num_warps: int, max_regs: int, max_shared: int) -> int:
    """How many programs of a kernel (n_regs registers a thread, `shared` bytes of shared memory,
    num_warps warps) an SM holds at once: the least of what its max_regs registers (allocated per
    warp in units of 256), its shared memory (max_shared, the opt-in limit of one block, + the 1 KiB
    the driver reserves per block) and its 64 warps allow. H200 (65536, 232448): fp8's kernel at 128
    registers and 38 KiB holds 4, at 96 registers 5."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = max_regs // max(1, regs_per_warp * num_warps)
    by_smem = (max_shared + 1024) // (shared + 1024)
    return max(1, min(by_regs, by_smem, 64 // num_warps))


def _kernel_programs_per_sm(kernel, num_warps: int, device: torch.device) -> int:
    """programs_per_sm of a compiled Triton kernel on `device`."""
    kernel._init_handles()  # loads the binary: n_regs is known from then on
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return programs_per_sm(kernel.n_regs, kernel.metadata.shared, num_warps, props["max_num_regs"],
                           props["max_shared_mem"])


def compiled_occupancy(kernel_fn, args, grid, num_warps: int, num_stages: int, max_registers: int,
                       device: torch.device) -> tuple[int, int]:
    """(programs per SM, spill bytes) of kernel_fn compiled (JITFunction.warmup, not launched) for
    (args, grid, launch options) under ptxas's register cap max_registers (0: none)."""
    options = {"maxnreg": int(max_registers)} if max_registers else {}
    kernel = kernel_fn.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **options)
    return _kernel_programs_per_sm(kernel, num_warps, device), int(kernel.n_spills)


def choose_launch(num_splits: int | None, max_registers: int, cap_is_default: bool, occupancy, batch: int,
                  num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, max_registers) of a compiled decode launch. occupancy(max_registers) -> (programs
    per SM, spill bytes) of the kernel under that cap. Splits not given are wave_splits' at the
    kernel's occupancy; a default cap (not one the caller asked for) whose kernel spills is dropped
    when a split would get fewer than the tuning's min_capped_tiles tiles (the spills' reloads then sit
    on a short loop's critical path, and the extra programs buy little), and the splits chosen again
    without it."""
    chosen = num_splits is None
    capped = None  # (programs per SM, spills) under max_registers, asked for only where needed
    if chosen:
        capped = occupancy(max_registers)
        num_splits = wave_splits(batch, num_kv_heads, max_context, block_n, num_sms, capped[0])
    tiles = -(-max_context // block_n)
    if cap_is_default and max_registers and -(-tiles // num_splits) < decode_tuning().min_capped_tiles \
            and (capped or occupancy(max_registers))[1]:
        max_registers = 0
        if chosen:
            num_splits = wave_splits(batch, num_kv_heads, max_context, block_n, num_sms, occupancy(0)[0])
    return num_splits, max_registers


def occupancy_key(spec: DecodeSpec, tables, q, k_pool, v_pool, G: int, P: int, block_n: int, num_warps: int,
                  num_stages: int, use_asm: bool, prefetch: int, swap_ab: bool,
                  max_registers: int | None = None, tail_in_last: bool = True) -> tuple:
    """What the compiled decode kernel (and so its programs per SM) depends on. A spec is rebuilt
    for every call and its tables may be a new closure, so the key is built from its parts; the
    readers' hooks are module-level functions, keyed by id (hashing a JITFunction is slow, and this
    runs for every layer of an eager step)."""
    hooks = tuple(id(f) for r in (spec.key, spec.value) for f in (r.fn, r.outlier_fn, r.fold_fn, r.fix_fn))
    readers = tuple((r.params, r.outliers, r.planes, r.row_scaled) for r in (spec.key, spec.value))
    return (hooks, readers, spec.dot_dtype, spec.staged, spec.residual, tuple(t.dtype for t in tables), q.dtype,
            q.shape[-1], k_pool.dtype, v_pool.dtype, G, P, block_n, num_warps, num_stages, bool(use_asm),
            int(prefetch), bool(swap_ab), max_registers, bool(tail_in_last), spec.key_rope, q.device)
