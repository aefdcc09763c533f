"""Every environment variable moekv reads, in one place.

Each one switches a kernel off or emulates a path for diagnosis, and none changes what a run
computes: what a run computes (its KV format, the decode kernel its pools are laid out for, ...) is
its configuration, EngineConfig and the command-line flags made from it. The rest of the code calls
these functions rather than reading os.environ.

OMP_NUM_THREADS is read too (omp_num_threads): a user who sets it has chosen the CPU's intra-op thread
count, and the engine then leaves torch's as it is (engine/cpu_threads.py).

A launcher's (torchrun's) RANK / WORLD_SIZE / LOCAL_RANK / ... are read here too (launcher_env): they
say where this process sits among the ranks of a tensor-parallel engine, not how it computes; the
configuration reads them to check the GPUs a rank needs, engine/parallel.py to join the ranks.

The server's API key (MOEKV_API_KEY) is read by moekv/server/options.py, beside the option it is
the default of: a credential, not a kernel switch, and it changes what the server accepts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

PDL_ENV = "MOEKV_PDL"
NUQ2_QUANTIZE_KERNEL_ENV = "MOEKV_NUQ2_QUANTIZE_KERNEL"
EMULATE_CUDA_GRAPHS_ENV = "MOEKV_EMULATE_CUDA_GRAPHS"
# a setting that belongs to the configuration: refused when set, so that a script written for a
# build that read it does not silently run with the default instead
DECODE_KERNEL_ENV = "MOEKV_DECODE_KERNEL"


def pdl() -> bool:
    """MOEKV_PDL=0 launches kernels without programmatic dependent launch (ops/pdl.py) on Hopper and
    later: launch timing only, the same results."""
    return os.environ.get(PDL_ENV, "1") != "0"


def nuq2_quantize_kernel() -> bool:
    """MOEKV_NUQ2_QUANTIZE_KERNEL=0 quantizes nuq2 pages (and tiered's low tier) on CUDA with the torch
    reference instead of the fused kernel (ops/nuq2_quantize.py), for benchmarks that compare the two;
    the same codes."""
    return os.environ.get(NUQ2_QUANTIZE_KERNEL_ENV, "1") != "0"


def emulate_cuda_graphs() -> bool:
    """MOEKV_EMULATE_CUDA_GRAPHS=1 takes the CUDA-graph path on a device without graphs (tests, CPU), each
    "replay" being the same static-buffer step run eagerly (engine/cuda_graphs.py); the same results.
    Ranks a process spawns inherit it, so that every rank takes the same path."""
    return os.environ.get(EMULATE_CUDA_GRAPHS_ENV, "0") == "1"


def check_decode_kernel_unset() -> None:
    """ValueError when MOEKV_DECODE_KERNEL is set: the decode kernel, and with it the KV pool's page
    layout and how many tokens fit, is the configuration's decode_kernel."""
    value = os.environ.get(DECODE_KERNEL_ENV)
    if value is not None:
        from moekv.kvcache.formats.names import DECODE_KERNELS

        choice = value.strip().lower()
        choice = choice if choice in DECODE_KERNELS else "|".join(DECODE_KERNELS)
        raise ValueError(f"{DECODE_KERNEL_ENV}={value!r} is set, but moekv does not read it: the decode kernel (and "
                         f"with it the KV pool's page layout) is a setting of the engine: pass --decode-kernel "
                         f"{choice} (EngineConfig / LLM(decode_kernel=...), get_kv_format(..., decode_kernel=...)) "
                         f"and unset {DECODE_KERNEL_ENV}")


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as the user set it (None when unset or empty): the engine then keeps torch's
    intra-op thread count instead of choosing one (engine/cpu_threads.py)."""
    return os.environ.get("OMP_NUM_THREADS") or None


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place as a launcher (torchrun) gave it: env:// variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launcher_env() -> LaunchEnv | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE when a launcher (torchrun) started this process
    with torch.distributed's env:// rendezvous (MASTER_ADDR and MASTER_PORT set too); None otherwise."""
    env = os.environ
    if not all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError as e:
        raise ValueError(f"torchrun's environment is not numeric: {e}") from None
    return LaunchEnv(rank, world, local_rank, local_world)
