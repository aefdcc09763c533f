#!/usr/bin/env python3
"""Compile the paged decode kernel for sm_90 without a GPU and count the SASS of its main loop.

Triton's wheel ships ptxas and cuobjdump, so a CPU-only machine can build the exact cubin the H200
would run: this catches compile errors (inline PTX included) before device time is spent, and the
instruction mix of the loop over tiles (per thread, per BLOCK_N-token tile of K and V) shows where
a format's dequantization costs. A static count, not a measurement: it says what the loop issues,
not how fast the GPU retires it.

    python benchmarks/tools/sass_decode_attention.py
        # every kernelised format, the benchmark's default launch
    python benchmarks/tools/sass_decode_attention.py --formats int4 --block-size 16 --block-n 64 --no-asm
    python benchmarks/tools/sass_decode_attention.py --formats nuq2 nuq2_eager nuq2_first nuq2_noslots --num-warps 8
    python benchmarks/tools/sass_decode_attention.py --dump-sass /tmp/sass_a
        # then diff -r against another tree's dump

Besides the opcode mix it reports what ptxas says about spills (bytes of local memory stored and
loaded: LDL/STL in the loop are spills) and splits the loop's instructions into those every tile
executes and those behind a forward branch (skipped at run time when, e.g., a chunk of nuq2's
outlier slots is unused): barriers and global loads on the always path are what cost latency.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops.decode import paged as da  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))
from bench_decode_attention import NUQ2_VARIANTS  # noqa: E402  (nuq2 kernel variants: label -> slots mode)

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
FORMATS = {"bf16": ("bf16", {}), "fp8_e4m3": ("fp8_e4m3", {}), "int4": ("int4", {"group_size": 32}),
           "kivi2": ("kivi2", {"residual": 128}), "nuq2": ("nuq2", {"codebook": "page"}),
           "vq": ("vq", {}),  # vq: a random calibration (vq.random_calibration) made on first use
           "tiered": ("tiered", {"codebook": "page"}),  # its own kernel (moekv/ops/decode/tiered.py), mass output on
           "fp16": ("fp16", {})}
KEYS = ["BAR", "LDG", "LDGSTS", "LDL", "STL", "LDS", "STS", "LDSM", "HMMA"]


def compile_launch(fn: JITFunction, args, kwargs):
    """What fn[grid](*args, **kwargs) would compile, built for TARGET instead of launched."""
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def build(label: str, head_dim: int, group: int, block_size: int, block_n: int, num_warps: int, num_stages: int,
          use_asm: bool, prefetch: int | None = None, swap_ab: bool | None = None,
          max_registers: int | None = None):
    """The compiled decode kernel for one format and launch shape (CPU tensors stand in for the GPU's)."""
    name, options = FORMATS["nuq2" if label in NUQ2_VARIANTS else label]
    if name == "vq":
        options = {**options, "calibration": _vq_calibration(head_dim)}
    fmt = get_kv_format(name, torch.bfloat16, **options)
    if label in NUQ2_VARIANTS:
        from moekv.ops.decode.nuq2 import nuq2_spec

        spec = nuq2_spec(fmt, block_size, head_dim, slots=NUQ2_VARIANTS[label])
    else:
        spec = fmt.decode_spec(block_size, head_dim) if name != "tiered" else None
    num_kv_heads = 8
    cache = fmt.allocate(8, num_kv_heads, block_size, head_dim, torch.device("cpu"), 2, torch.bfloat16)
    q = torch.zeros(2, num_kv_heads * group, head_dim, dtype=torch.bfloat16)
    compiled = COMPILED
    compiled.clear()
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        compiled[self.fn.__name__] = compile_launch(self, args, kwargs)

    JITFunction.run = run
    try:
        # the default cap, passed explicitly: the launchers would otherwise compile to decide whether to
        # keep it for this short context (decode/launch.py choose_launch)
        if name == "tiered":
            from moekv.ops.decode.launch import register_cap
            from moekv.ops.decode.tiered import tiered_decode_attention

            if max_registers is None:
                max_registers = register_cap("tiered", block_size) or 0

            tiered_decode_attention(q, cache, cache.state.tier_dev, cache.state.slot_dev,
                                    torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32),
                                    torch.arange(2), 0.1, None, fmt.hi, fmt.lo, num_splits=2, block_n=block_n,
                                    num_warps=num_warps, num_stages=num_stages, use_asm=use_asm,
                                    swap_ab=swap_ab, max_registers=max_registers)
            return compiled["_tiered_decode_kernel"]
        if max_registers is None:
            max_registers = spec.max_registers or 0
        da.paged_decode_attention(q, cache, torch.zeros(2, 4, dtype=torch.int32),
                                  torch.full((2,), 100, dtype=torch.int32), torch.arange(2), 0.1, None, spec,
                                  block_n=block_n, num_splits=2,
                                  num_warps=num_warps, num_stages=num_stages, use_asm=use_asm, prefetch=prefetch,
                                  swap_ab=swap_ab, max_registers=max_registers)
    finally:
        JITFunction.run = original
    return compiled["_paged_decode_kernel"]


COMPILED: dict = {}  # kernel name -> compiled kernel, of the last build (the decode kernel and its reduce)
_VQ_CALIBRATIONS: dict[int, Path] = {}


def _vq_calibration(head_dim: int) -> Path:
    """A random vq calibration for 8 KV heads (the codebooks' values do not change the code)."""
    if head_dim not in _VQ_CALIBRATIONS:
        from moekv.kvcache.formats.vq import random_calibration

        _VQ_CALIBRATIONS[head_dim] = random_calibration(Path(tempfile.mkdtemp(prefix="vqcal")), 8, head_dim,
                                                        iters=1, max_vectors=512)
    return _VQ_CALIBRATIONS[head_dim]


def dump_sass(label: str, folder: Path) -> None:
    """The SASS of every kernel of the last build, one file each (label.kernel.sass), without the addresses
    and the header that names the cubin: two trees' dumps diff to nothing when their kernels are the same."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, kernel in COMPILED.items():
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        body = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).rstrip() for line in sass.splitlines() if "/*" in line]
        (folder / f"{label}.{name}.sass").write_text("\n".join(body) + "\n")


def spills(kernel) -> dict:
    """ptxas -v on the kernel's PTX: registers, stack frame and spill bytes (stores, loads)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        arch = re.search(r"\.target\s+(sm_\w+)", kernel.asm["ptx"]).group(1)
        err = subprocess.run([str(BIN / "ptxas"), "-v", f"-arch={arch}", str(ptx), "-o", str(Path(tmp) / "v.cubin")],
                             capture_output=True, text=True).stderr
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
    return dict(zip(("stack", "spill_stores", "spill_loads"), map(int, found.groups()))) if found else {}


def split_loop(lines, start: int, end: int) -> tuple[collections.Counter, collections.Counter]:
    """Opcodes of the loop body [start, end] on the always-executed path, and behind forward branches."""
    body = [(a, pred, op, line) for a, pred, op, line in lines if start <= a <= end]
    regions = []
    for a, pred, op, line in body:
        target = re.search(r"BRA\s+(0x[0-9a-f]+)", line)
        if op == "BRA" and pred and target and a < int(target.group(1), 16) <= end:
            regions.append((a, int(target.group(1), 16)))
    skipped = lambda a: any(s < a < e for s, e in regions)  # noqa: E731
    always = collections.Counter(op for a, _, op, _ in body if not skipped(a))
    behind = collections.Counter(op for a, _, op, _ in body if skipped(a))
    return always, behind


def sass_loops(kernel) -> tuple[dict, list[tuple[int, collections.Counter]]]:
    """Resource usage and, for each backward branch (a loop), the opcode counts of its body (and
    its always / behind-a-branch split)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", res)}
    lines = [(int(m.group(1), 16), m.group(2), m.group(3), line) for line in sass.splitlines()
             if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line))]
    loops = []
    for addr, _, op, line in lines:
        target = re.search(r"BRA\s+(0x[0-9a-f]+)", line)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            loops.append((start, collections.Counter(o for a, _, o, _ in lines if start <= a <= addr),
                          split_loop(lines, start, addr)))
    return usage, loops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="*", default=list(FORMATS), help=f"among {list(FORMATS) + list(NUQ2_VARIANTS)}")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--no-asm", dest="asm", action="store_false", help="plain-Triton unpacking, no inline PTX")
    p.add_argument("--swap-ab", type=int, default=None, choices=(0, 1),
                   help="transposed products (1) or not (0); default: the spec's")
    p.add_argument("--max-registers", type=int, default=None,
                   help="ptxas register cap (.maxnreg; default: the format's, decode/launch.py register_cap; 0: none)")
    p.add_argument("--prefetch", type=int, default=None, help="L2 prefetch distance in tiles (default: the spec's)")
    p.add_argument("--dump-sass", type=Path, default=None, help="also write each kernel's SASS into this folder")
    args = p.parse_args()
    elements = 2 * args.block_n * args.head_dim  # K and V elements of one tile
    threads = 32 * args.num_warps
    for label in args.formats:
        kernel = build(label, args.head_dim, args.group, args.block_size, args.block_n, args.num_warps,
                       args.num_stages, args.asm, args.prefetch, args.swap_ab, args.max_registers)
        usage, loops = sass_loops(kernel)
        spill = spills(kernel)
        if args.dump_sass:
            dump_sass(label, args.dump_sass)
        print(f"{label}: {usage.get('REG')} registers, {kernel.metadata.shared} B shared memory, "
              f"spills {spill.get('spill_stores')} B stored / {spill.get('spill_loads')} B loaded "
              f"(stack {spill.get('stack')} B)")
        for i, (start, ops, (always, behind)) in enumerate(loops):
            n = sum(ops.values())
            role = "pages" if i == 0 else "inner/tail"  # the pages loop comes first in the SASS
            print(f"  {role} loop @{start:#x}: {n} instructions per thread per tile "
                  f"({n * threads / elements:.2f} per K/V element): {dict(ops.most_common(12))}")
            if i == 0:
                for name, ops_ in (("always", always), ("behind branches", behind)):
                    print(f"    {name}: {sum(ops_.values())} {dict((k, ops_[k]) for k in KEYS)}")


if __name__ == "__main__":
    main()
