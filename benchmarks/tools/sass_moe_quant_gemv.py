"""The quantized MoE decode GEMVs (ops/fused_moe_quant.py) built offline for sm_90: registers, stack, the
SASS global loads (LDG.E.128 where the codes' rows are known 16-byte aligned) and, per K step of the
loop, its instructions, shuffles and barriers, and warp instructions a weight byte (codes, scales and
zero points). At Mixtral-8x7B's expert shape (H=4096, I=14336, top-2; fp8 per channel, int4 groups of
128 with zero points: what `quantization=` makes) the gate/up and down GEMVs at their default tiles;
at gpt-oss-20b's (H = I = 2880, top-4) the gate/up GEMV with int4 and mxfp4 codes, the epilogues on
and off. No GPU needed; run without TRITON_INTERPRET:

    PYTHONPATH=. python benchmarks/tools/sass_moe_quant_gemv.py [--tiles 8x1024 16x1024] [--run-pairs 2 4] [--f16-dots]

--f16-dots builds int4's pair and run GEMVs with their dots in packed halves (quant_tiles.int4_f16_dots,
run_f16_dots) beside the fp32 ones, and the int4 projection GEMV (ops/quant_linear.py, Mixtral's qkv: 6144 x 4096)
both ways.

The run GEMV (path "runs", P pairs of one expert a program) is built beside the pair GEMV at the Mixtral
rows: a K step's instructions cover P pairs, so divide by P to compare with the pair GEMV's.

An H100 SXM issues at most 132 SMs x 4 warp instructions a clock; at ~1.8 GHz and its ~3.0 TB/s copy
bandwidth a GEMV that reads at its floor can spend ~0.32 warp instructions a weight byte.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekv.ops import fused_moe_quant as fq
from moekv.ops.quant_tiles import run_chunks, scale_mode

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
CODES = {"int4": "*i32", "mxfp4": "*i32", "fp8": "*fp8e4nv"}
SCALES = {"int4": "*bf16", "mxfp4": "*u8", "fp8": "*fp32"}
SCALE_K = {"int4": 128, "mxfp4": 32}  # fp8: one scale a row (SK = K)


def build(method: str, kernel: str, H: int, I: int, top_k: int, block_n: int, block_k: int, epilogue: bool = False,
          aligned_rows: bool = True, run_pairs: int = 0, f16_dots: bool = False):
    """(SASS, resource usage) of one GEMV (run_pairs P > 0: the run GEMV, P pairs of one expert a program;
    f16_dots: int4's dots in packed halves, quant_tiles.int4_f16_dots / run_f16_dots).
    Pointers are 16-byte aligned and strides multiples of 16 as Triton specializes them at run time, except
    the codes' row stride where aligned_rows is False (gpt-oss's 360 words)."""
    gate_up = kernel == "gate_up"
    N, K = (I, H) if gate_up else (H, I)
    act = "x_ptr" if gate_up else "h_ptr"
    sig = {act: "*bf16", "c_ptr": CODES[method], "s_ptr": SCALES[method], "z_ptr": SCALES[method]}
    routing = ({"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "num_runs": "i32"}
               if run_pairs else {"expert_ids_ptr": "*i64", "num_pairs": "i32"})
    if gate_up:
        sig |= {"h_ptr": "*bf16"} | routing | {"stride_xt": "i32"}
    else:
        sig |= {"y_ptr": "*fp32", "weights_ptr": "*fp32"} | routing | {"stride_hm": "i32"}
    sig |= {"stride_ce": "i64", "stride_cn": "i32", "stride_se": "i32", "stride_sn": "i32"}
    sig |= {"stride_hm": "i32"} if gate_up else {"stride_ys": "i32", "stride_ym": "i32"}
    sig |= {"b13_ptr" if gate_up else "b2_ptr": "*bf16", "stride_be": "i32"}
    SK = SCALE_K.get(method, K)
    consts = dict(N=N, K=K, INT4=method == "int4", MXFP4=method == "mxfp4", HAS_ZEROS=method == "int4", SN=1, SK=SK,
                  SCALE_MODE=scale_mode(SK, K, block_k), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=epilogue)
    consts |= dict(TOP_K=top_k, CLAMPED=epilogue, ALPHA=1.702, LIMIT=7.0) if gate_up else dict(K_PER_SPLIT=K)
    if run_pairs:
        consts |= dict(P=run_pairs, CHUNKS=run_chunks(SK, K, block_k, f16_dots))
    if f16_dots:
        consts |= dict(F16_DOTS=True)
    names = list(sig)
    divisible = [n for n in names if sig[n].startswith("*") or n.startswith("stride") and n != "num_pairs"]
    if not aligned_rows:
        divisible.remove("stride_cn")
    if run_pairs:
        fn = fq._qgate_up_runs_kernel if gate_up else fq._qdown_runs_kernel
    else:
        fn = fq._qgate_up_gemv_kernel if gate_up else fq._qdown_gemv_kernel
    return sass_of(fn, sig, consts, divisible)


def build_projection(N: int, K: int, block_n: int, block_k: int, f16_dots: bool):
    """(SASS, resource usage) of the int4 projection GEMV (ops/quant_linear.py), groups of 128 with zero points."""
    from moekv.ops import quant_linear as ql

    sig = {"x_ptr": "*bf16", "c_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
           "num_tokens": "i32", "stride_xt": "i32", "stride_cn": "i32", "stride_sn": "i32", "stride_ot": "i32"}
    consts = dict(N=N, K=K, HAS_BIAS=False, INT4=True, MXFP4=False, HAS_ZEROS=True, SN=1, SK=128,
                  SCALE_MODE=scale_mode(128, K, block_k), BLOCK_N=block_n, BLOCK_K=block_k, F16_DOTS=f16_dots)
    divisible = [n for n in sig if sig[n].startswith("*") or n.startswith("stride")]
    return sass_of(ql._quant_gemv_kernel, sig, consts, divisible)


def sass_of(fn, sig: dict, consts: dict, divisible: list, num_warps: int = 4, num_stages: int = 4):
    """(SASS, resource usage) of a Triton kernel built for sm_90: sig maps its arguments to Triton types,
    consts its constexprs; the arguments in divisible are specialized as multiples of 16 (attrs are keyed by
    the argument's position in the kernel's own list, constexprs included)."""
    src = ASTSource(fn,
                    signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, res


def summary(sass: str, res: str, weight_bytes_a_step: float) -> str:
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    loads = collections.Counter(w for line in sass.splitlines() for w in line.split() if w.startswith("LDG"))
    text = f"registers {regs} stack {stack} loads {dict(loads)}"
    back = re.search(r"/\*([0-9a-f]{4})\*/\s+@!?P\d BRA 0x([0-9a-f]+) ;", sass)  # the K loop's backward branch
    if back:
        first, last = int(back.group(2), 16), int(back.group(1), 16)
        body = [m for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(?:@!?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
                if first <= int(m.group(1), 16) <= last]
        ops = collections.Counter(m.group(2).split(".")[0] for m in body)
        text += (f"; a K step: {len(body)} instructions ({ops['SHFL']} SHFL, {ops['BAR']} BAR, {ops['LOP3']} LOP3, "
                 f"{ops['HFMA2']} HFMA2, {ops['HADD2']} HADD2, {ops['FFMA']} FFMA, {ops['FADD']} FADD), "
                 f"{4 * len(body) / weight_bytes_a_step:.3f} warp instructions a weight byte")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", nargs="*", default=None,
                   help="BLOCK_NxBLOCK_K tiles for the Mixtral rows (default: each method's default GEMV config)")
    p.add_argument("--run-pairs", type=int, nargs="*", default=[2, 4],
                   help="P of the run GEMV (path 'runs') to build beside the pair GEMV at the Mixtral rows")
    p.add_argument("--f16-dots", action="store_true",
                   help="build int4's pair and run GEMVs with their dots in packed halves too (F16_DOTS) beside "
                        "the fp32 dots")
    p.add_argument("--methods", nargs="*", default=["fp8", "int4"], help="methods of the Mixtral rows")
    p.add_argument("--no-gpt-oss", action="store_true", help="skip the gpt-oss-20b rows")
    args = p.parse_args()
    H, I = 4096, 14336
    for method in args.methods:
        defaults = fq.DEFAULT_PACKED_GEMV if method == "int4" else fq.DEFAULT_QUANT_GEMV
        tiles = ([tuple(map(int, t.split("x"))) for t in args.tiles] if args.tiles
                 else [(defaults.block_n, defaults.block_k)])
        for block_n, block_k in tiles:
            both = args.f16_dots and method == "int4"
            for P, f16 in [(P, dots) for P in [0] + args.run_pairs for dots in (False, True)[:1 + both]]:
                for kernel in ("gate_up", "down"):
                    sass, res = build(method, kernel, H, I, 2, block_n, block_k, run_pairs=P, f16_dots=f16)
                    code_bytes = block_n * block_k * (0.5 if method == "int4" else 1.0)
                    group_bytes = block_n * block_k // 128 * 4 if method == "int4" else 0  # bf16 scale + zero a group
                    step_bytes = (2 if kernel == "gate_up" else 1) * (code_bytes + group_bytes)
                    name = (f"runs P={P}" if P else "pair GEMV") + (" f16 dots" if f16 else "")
                    print(f"mixtral-8x7b {method:5} {kernel:7} {block_n}x{block_k} {name}: "
                          f"{summary(sass, res, step_bytes)}", flush=True)
    if args.f16_dots:
        for block_n in (8, 16):
            for f16 in (False, True):
                sass, res = build_projection(6144, 4096, block_n, 1024, f16)
                step_bytes = block_n * 1024 * (0.5 + 4 / 128)
                print(f"mixtral-8x7b int4  qkv proj {block_n}x1024 {'f16 dots' if f16 else 'fp32 dots'}: "
                      f"{summary(sass, res, step_bytes)}", flush=True)
    for method in () if args.no_gpt_oss else ("int4", "mxfp4"):
        for epilogue, f16 in [(False, False), (True, False)] + [(True, True)] * (args.f16_dots and method == "int4"):
            cfg = fq.DEFAULT_PACKED_GEMV
            sass, res = build(method, "gate_up", 2880, 2880, 4, cfg.block_n, cfg.block_k, epilogue, aligned_rows=False,
                              f16_dots=f16)
            step_bytes = 2 * cfg.block_n * cfg.block_k * (0.5 + (4 / 128 if method == "int4" else 1 / 32))
            print(f"gpt-oss-20b  {method:5} gate_up {cfg.block_n}x{cfg.block_k} epilogue={epilogue!s:5}"
                  f"{' f16 dots' if f16 else ''}: {summary(sass, res, step_bytes)}", flush=True)


if __name__ == "__main__":
    main()
