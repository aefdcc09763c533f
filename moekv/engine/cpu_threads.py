"""The CPU's intra-op thread count (torch.set_num_threads), chosen for the model's size and the machine's load.

torch's default (one thread per physical core) suits large matrix products on an idle machine. A small
model's decode step is a few hundred tiny ops: each thread's share of an op is shorter than the cost of
waking and joining the threads, and where another process keeps a core busy, every op waits for the
thread that lost its core. A model under SMALL_MODEL_PARAMS parameters therefore runs one thread (two
where at least four cores are free); a larger one runs one per free core of those this process may use
(os.sched_getaffinity), at most MAX_CPU_THREADS. Free cores are the allowed ones less the machine's
1-minute load average, in proportion. The ranks of a tensor-parallel engine on the CPU share the host:
each takes its share of the cores and of the load, for its shard of the parameters.

The user's own choice wins: --threads (ParallelConfig.cpu_threads), or OMP_NUM_THREADS set, or
torch.set_num_threads called before the engine starts (torch's count differs from the one at import
and from the engine's last choice); the engine then leaves it as it is.
"""
from __future__ import annotations

import logging
import os

import torch

from moekv import envs

log = logging.getLogger("moekv")

SMALL_MODEL_PARAMS = 100_000_000
MAX_CPU_THREADS = 32

_threads_at_import = torch.get_num_threads()
_chosen: int | None = None  # the engine's last torch.set_num_threads in this process
_logged: set[tuple[int, str]] = set()


def choose_cpu_threads(num_params: int, cores: int, busy: float = 0.0) -> int:
    """Intra-op threads for a model (or a rank's shard) of num_params parameters on `cores` cores of
    which other processes keep `busy` busy (a load average, scaled to these cores)."""
    cores = max(1, int(cores))
    free = max(1, min(cores, int(cores - max(0.0, busy) + 0.5)))
    if num_params < SMALL_MODEL_PARAMS:
        return 2 if free >= 4 else 1
    return min(free, MAX_CPU_THREADS)


def machine_cores() -> tuple[int, float]:
    """(cores this process may run on, how many of them other processes keep busy): os.sched_getaffinity,
    and the 1-minute load average scaled from all the machine's cores to those."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load * cores / max(cores, os.cpu_count() or cores)


def user_threads() -> str | None:
    """How the user chose torch's intra-op threads (None: they did not)."""
    if envs.omp_num_threads() is not None:
        return "OMP_NUM_THREADS"
    if torch.get_num_threads() not in (_threads_at_import, _chosen):
        return "torch.set_num_threads"
    return None


def set_cpu_threads(requested: int | None, num_params: int, ranks_on_host: int = 1) -> int:
    """Set (or keep) torch's intra-op threads for a rank holding num_params parameters (its shard's), one
    of ranks_on_host sharing the host; -> the count. requested: --threads (None: choose). Logged at
    INFO once per choice."""
    global _chosen
    if requested is None and (kept_by := user_threads()) is not None:
        threads, why = torch.get_num_threads(), kept_by  # the user's own setting: left as it is
    else:
        if requested is not None:
            threads, why = requested, "--threads"
        else:
            cores, busy = machine_cores()
            share = max(1, cores // ranks_on_host)
            threads = choose_cpu_threads(num_params, share, busy / ranks_on_host)
            why = (f"chosen for {num_params / 1e6:.1f}M parameters on {share} of {cores} cores, load {busy:.1f}; "
                   "--threads N or OMP_NUM_THREADS overrides")
        torch.set_num_threads(threads)
        _chosen = threads
    if (threads, why) not in _logged:
        _logged.add((threads, why))
        log.info("CPU intra-op threads: %d (%s)", threads, why)
    return threads
