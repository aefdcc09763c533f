#!/usr/bin/env python3
"""The absorbed MLA decode kernels (ops/decode/mla.py) built offline for sm_90 at DeepSeek-V3's entry (512 + 64),
64 heads a program: for each launch config of the table (and any given), registers, local memory (spills), shared
memory, the MMA instructions (HGMMA shapes and counts; QGMMA for the e4m3 forms of fp8_mma configs) and the
asynchronous copies. No GPU needed; run without TRITON_INTERPRET:

    PYTHONPATH=. python benchmarks/tools/sass_mla_decode.py [--sass-dir DIR]
    PYTHONPATH=. python benchmarks/tools/sass_mla_decode.py --formats fp8 --configs n64f8=64,8,2,0,1 [--block-h 64]

An H100 SM has 227 KiB of shared memory for one program: a config that needs more does not launch (reported).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import triton  # noqa: E402
from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moekv.ops.decode import mla  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SMEM_LIMIT = 232448  # bytes of shared memory one program may use on sm_90
LATENT = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int4": "*u8"}


def signature(fmt: str) -> dict:
    if fmt == "int4":
        sig = {"q_ptr": "*bf16", "codes_ptr": "*u8", "rope_ptr": "*bf16", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
               "tables_ptr": "*i32", "lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        strides = ["stride_qb", "stride_qh", "stride_cp", "stride_ct", "stride_rp", "stride_rt", "stride_gp",
                   "stride_gt", "stride_tb", "stride_ob", "stride_oh", "stride_os", "stride_eb", "stride_eh"]
    else:
        sig = {"q_ptr": "*bf16", "q8_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "latent_ptr": LATENT[fmt],
               "rope_ptr": "*bf16", "scales_ptr": "*fp32",
               "tables_ptr": "*i32", "lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        strides = ["stride_qb", "stride_qh", "stride_lp", "stride_lt", "stride_rp", "stride_rt", "stride_sp",
                   "stride_tb", "stride_ob", "stride_oh", "stride_os", "stride_eb", "stride_eh"]
    sig |= {n: "i32" for n in strides}
    sig |= {"qk_scale": "fp32", "num_heads": "i32", "num_splits": "i32"}
    return sig


def build(fmt: str, cfg: mla.MLAConfig, block_h: int = 64):
    """(SASS text, resource line, shared bytes) of one build; pointers and strides 16-divisible as Triton
    specializes them at run time."""
    sig = signature(fmt)
    consts = dict(R=512, RP=64, PAGE=64, BLOCK_H=block_h, BLOCK_N=cfg.block_n, PRECISION="tf32",
                  NUM_STAGES=cfg.num_stages)
    if fmt == "int4":
        kernel = mla._mla_int4_split_kernel
        consts |= dict(GROUP=32)
    else:
        kernel = mla._mla_split_kernel
        consts |= dict(FP8=fmt == "fp8", SWAP=cfg.swap, FP8_MMA=cfg.fp8_mma)
    names = list(sig)
    divisible = [n for n in names if sig[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(kernel, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    k = triton_compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=cfg.num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return sass, res, k.metadata.shared


def opcodes(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins = m.group(1).strip()
            ins = ins.split(None, 1)[1] if ins.startswith("@") else ins
            ops[ins.split()[0]] += 1
    return ops


def summary(sass: str, res: str, shared: int) -> str:
    ops = opcodes(sass)
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    local = sum(n for op, n in ops.items() if op.startswith(("LDL", "STL")))
    mma = {op: n for op, n in ops.items() if op.startswith(("HGMMA", "QGMMA"))}  # QGMMA: the fp8 (e4m3) forms
    copies = sum(n for op, n in ops.items() if op.startswith("LDGSTS"))
    loads = sum(n for op, n in ops.items() if op.startswith("LDG.") or op == "LDG")
    fits = "fits" if shared <= SMEM_LIMIT else "DOES NOT LAUNCH"
    return (f"registers {regs} stack {stack} local ld/st {local} shared {shared} B ({fits}); "
            f"{sum(ops.values())} instructions, MMAs {mma}, cp.async {copies}, LDG {loads}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass-dir", type=Path, default=None, help="write each build's SASS here")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int4"])
    p.add_argument("--configs", nargs="+", default=None, metavar="NAME=BN,WARPS,STAGES,SWAP,FP8MMA",
                   help="build these instead of the table's (e.g. f8=64,8,2,0,1)")
    p.add_argument("--block-h", type=int, default=64, help="heads a program")
    args = p.parse_args()
    configs = mla.tuning()["configs"]
    if args.configs:
        configs = {}
        for spec in args.configs:
            name, _, values = spec.partition("=")
            bn, warps, stages, *flags = (int(v) for v in values.split(","))
            configs[name] = mla.MLAConfig(bn, warps, stages, *map(bool, flags))
    for fmt in args.formats:
        for name, cfg in configs.items():
            if (fmt == "int4" and cfg.swap) or (fmt != "fp8" and cfg.fp8_mma):
                continue  # the int4 kernel has no transposed form; fp8 MMAs read the fp8 latent only
            try:
                sass, res, shared = build(fmt, cfg, args.block_h)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row too
                print(f"{fmt:5s} {name:10s} {cfg}: does not compile: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            print(f"{fmt:5s} {name:10s} {cfg}: {summary(sass, res, shared)}", flush=True)
            if args.sass_dir:
                args.sass_dir.mkdir(parents=True, exist_ok=True)
                (args.sass_dir / f"{fmt}_{name}.sass").write_text(sass)


if __name__ == "__main__":
    main()
