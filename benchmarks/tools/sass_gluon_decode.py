#!/usr/bin/env python3
"""Compile the Gluon decode kernels that read a residual window's ring (nuq2, vq, vq's shared-codebook
kernel, kivi2) and tiered's (nuq2's fragment tables beside FP8 pages) for sm_90 without a GPU and write
each build's SASS, to diff two trees' kernels.

Triton's wheel ships ptxas and cuobjdump, so a CPU-only machine builds the cubin an H100 / H200 would
run. Each build is one kernel at the launcher's register cap with one set of its constexprs (with and
without the staged tail, with and without the ring; tiered: with and without the nuq2 pages through
shared memory); the SASS goes to <out>/<kernel>_<build>.sass with
the addresses and encodings stripped, so two trees' dumps differ only where their instructions do:

    PYTHONPATH=. python benchmarks/tools/sass_gluon_decode.py --out /tmp/sass_a
    PYTHONPATH=/other/tree python benchmarks/tools/sass_gluon_decode.py --out /tmp/sass_b
    diff -r /tmp/sass_a /tmp/sass_b
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import triton  # noqa: E402
from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
STAGING = {"seq_slots": "*i64", "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32",
           "stride_st": "i32", "k_ring": "*bf16", "v_ring": "*bf16", "stride_rs": "i32", "stride_rh": "i32",
           "stride_rt": "i32", "R": "i32"}
VQ_TABLES = {"k_codes": "*i32", "v_codes": "*i32", "k_tok_scale": "*fp16", "v_tok_scale": "*fp16",
             "k_mean": "*fp8e4nv", "k_codebook": "*fp8e4nv", "k_chan_scale": "*fp32", "v_codebook": "*fp8e4nv",
             "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32"}
PARTIALS = {"part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32"}
# nuq2's fragment tables (nuq2_layout.slot_tables: the int16 slot positions read as uint16, fp16 deltas, uint8 counts)
NUQ2_TABLES = {"k_codes": "*i32", "v_codes": "*i32", "k_tables": "*i32", "v_tables": "*i32", "k_mean": "*fp8e4nv",
               "k_scale": "*fp8e4nv", "k_idx": "*u16", "k_delta": "*fp16", "k_used": "*u8", "v_idx": "*u16",
               "v_delta": "*fp16", "v_used": "*u8", "SK": "i32", "SV": "i32"}


def kernels():
    """(name, kernel, signature, register cap, aligned pointer args (sass_of), builds {label: constexprs})."""
    from moekv.ops.gluon import kivi2_decode, nuq2_decode, tiered_decode, vq_decode
    from moekv.ops.gluon.kivi2_kernel import kivi2_decode_kernel
    from moekv.ops.gluon.nuq2_kernel import nuq2_decode_kernel
    from moekv.ops.gluon.tiered_kernel import tiered_decode_kernel
    from moekv.ops.gluon.vq_kernel import vq_decode_kernel
    from moekv.ops.gluon.vq_smem_kernel import vq_smem_decode_kernel

    nuq2_sig = {**NUQ2_TABLES, "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32",
                **STAGING, **PARTIALS,
                "zero": "i32", "num_splits": "i32", "ns_total": "i32", "HKV": "constexpr", "G": "constexpr",
                "STAGED": "constexpr", "CHUNK0": "constexpr", "PREFETCH": "constexpr", "SMEM": "constexpr",
                "RING": "constexpr"}
    nuq2 = {"HKV": 8, "G": 4, "CHUNK0": nuq2_decode.DEFAULT_SLOT_CHUNK0, "PREFETCH": nuq2_decode.DEFAULT_PREFETCH,
            "SMEM": nuq2_decode.DEFAULT_SMEM}
    vq_sig = {**VQ_TABLES, **STAGING, **PARTIALS, "num_splits": "i32", "ns_total": "i32", "split0": "i32",
              "HKV": "constexpr", "G": "constexpr", "STAGED": "constexpr", "RING": "constexpr"}
    smem_sig = {**VQ_TABLES, **PARTIALS, "num_splits": "i32", "ns_total": "i32", "R": "i32", "HKV": "constexpr",
                "G": "constexpr", "W": "constexpr", "STAGED": "constexpr", "RING": "constexpr"}
    kivi2_sig = {"k_codes": "*i32", "v_codes": "*i32", "k_scale": "*fp16", "k_zero": "*fp16", "v_scale": "*fp16",
                 "v_zero": "*fp16", "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32",
                 "context_lens": "*i32", **STAGING, **PARTIALS, "num_splits": "i32", "ns_total": "i32",
                 "HKV": "constexpr", "G": "constexpr", "STAGED": "constexpr", "PREFETCH": "constexpr",
                 "SIDE_SMEM": "constexpr", "CODES_SMEM": "constexpr"}
    kivi2 = {"HKV": 8, "G": 4, "PREFETCH": kivi2_decode.DEFAULT_PREFETCH, "SIDE_SMEM": kivi2_decode.DEFAULT_SIDE_SMEM,
             "CODES_SMEM": False}
    tiered_sig = {**NUQ2_TABLES, "kf_w": "*i32", "vf_w": "*i32", "kf_h": "*fp16", "vf_h": "*fp16", "page_tier": "*i32",
                  "page_slot": "*i32", "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32",
                  "context_lens": "*i32", "seq_slots": "*i64", "k_stage": "*bf16", "v_stage": "*bf16",
                  "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32", "part_o": "*fp32", "part_lse": "*fp32",
                  "tile_sum": "*fp32", "tile_max": "*fp32", "max_tiles": "i32", "qk_scale": "fp32", "window": "i32",
                  "zero": "i32", "num_splits": "i32", "ns_total": "i32", "HKV": "constexpr", "G": "constexpr",
                  "STAGED": "constexpr", "CHUNK0": "constexpr", "EMIT_MASS": "constexpr", "FW": "constexpr",
                  "F_KS": "constexpr", "F_VS": "constexpr", "FP8_PREFETCH": "constexpr", "SMEM": "constexpr"}
    # FP8 slabs of 64 x 128 codes and 64 fp16 row scales (fp8_e4m3's slab at the fragment orders' page)
    tiered = {"HKV": 8, "G": 4, "STAGED": True, "CHUNK0": nuq2_decode.DEFAULT_SLOT_CHUNK0, "EMIT_MASS": True,
              "FW": 2080, "F_KS": 8192, "F_VS": 8192, "FP8_PREFETCH": tiered_decode.DEFAULT_FP8_PREFETCH}
    return [
        ("tiered", tiered_decode_kernel, tiered_sig, tiered_decode.DEFAULT_MAX_REGISTERS,
         [*range(12), *range(14, 20)], {
            "pages": {**tiered, "SMEM": False},
            "smem": {**tiered, "SMEM": True}}),
        ("nuq2", nuq2_decode_kernel, nuq2_sig, nuq2_decode.DEFAULT_MAX_REGISTERS, 12, {
            "pages": {**nuq2, "STAGED": False, "RING": False},
            "staged": {**nuq2, "STAGED": True, "RING": False},
            "ring": {**nuq2, "STAGED": True, "RING": True}}),
        ("vq", vq_decode_kernel, vq_sig, vq_decode.DEFAULT_MAX_REGISTERS, 8, {
            "pages": {"HKV": 8, "G": 4, "STAGED": False, "RING": False},
            "staged": {"HKV": 8, "G": 4, "STAGED": True, "RING": False},
            "ring": {"HKV": 8, "G": 4, "STAGED": True, "RING": True}}),
        ("vq_smem", vq_smem_decode_kernel, smem_sig, vq_decode.SHARED_MAX_REGISTERS, 8, {
            "staged": {"HKV": 8, "G": 4, "W": vq_decode.DEFAULT_WARPS, "STAGED": True, "RING": False},
            "ring": {"HKV": 8, "G": 4, "W": vq_decode.DEFAULT_WARPS, "STAGED": True, "RING": True}}),
        ("kivi2", kivi2_decode_kernel, kivi2_sig, kivi2_decode.DEFAULT_MAX_REGISTERS, 6, {
            "pages": {**kivi2, "STAGED": False},
            "staged": {**kivi2, "STAGED": True}}),
    ]


def sass_of(kernel, sig: dict, constexprs: dict, cap: int, aligned, num_warps: int) -> str:
    """The kernel's SASS for sm_90, one instruction a line, addresses and encodings stripped (aligned: the
    16-byte aligned pointer arguments, the first `aligned` or a list of their positions)."""
    aligned = range(aligned) if isinstance(aligned, int) else aligned
    src = GluonASTSource(kernel, signature=sig, constexprs=constexprs,
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=cap))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    lines = [m.group(1).strip() for line in sass.splitlines()
             if (m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line))]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for <kernel>_<build>.sass")
    p.add_argument("--kernels", nargs="*", default=None, help="among tiered nuq2 vq vq_smem kivi2 (default: all)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, kernel, sig, cap, aligned, builds in kernels():
        if args.kernels and name not in args.kernels:
            continue
        for label, constexprs in builds.items():
            sass = sass_of(kernel, sig, constexprs, cap, aligned, constexprs.get("W", 1))
            (args.out / f"{name}_{label}.sass").write_text(sass)
            print(f"{name}_{label}: {sass.count(chr(10))} instructions", flush=True)


if __name__ == "__main__":
    main()
