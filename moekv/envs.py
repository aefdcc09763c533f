"""Every environment variable moekv reads, in one place.

Each one switches a kernel off or emulates a path for diagnosis, and none changes what a run
computes: what a run computes (its KV format, the decode kernel its pools are laid out for, ...) is
its configuration, EngineConfig and the command-line flags made from it. The rest of the code calls
these functions rather than reading os.environ.

The server's API key (MOEKV_API_KEY) is read by moekv/server/options.py, beside the option it is
the default of: a credential, not a kernel switch, and it changes what the server accepts.
"""
from __future__ import annotations

import os

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
