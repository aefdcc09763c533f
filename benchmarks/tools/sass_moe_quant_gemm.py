"""The quantized MoE grouped GEMMs (ops/fused_moe_quant.py: path "gemm" and its swap-AB form "gemm_swap")
built offline for sm_90: registers, stack, shared memory, and per K step of the main loop its instructions,
the MMAs (HMMA: mma.sync; HGMMA: wgmma, with the A operand from registers where its second operand is a
register, `HGMMA.64xNx16 Racc, Ra, gdesc[..]`), the shared-memory traffic (STS / STSM stores, LDS / LDSM
loads), the dequantization's arithmetic (FADD, FMUL, FFMA, LOP3, F2FP) and warp instructions a weight byte
(codes, scales and zero points). At Mixtral-8x22B's expert shape (H=6144, I=16384, top-2; fp8 per channel,
int4 groups of 128 with zero points, mxfp4 groups of 32) each form at the configs the launcher would take for
16, 32 and 64 pairs an expert (fused_moe.default_gemm_config, fused_moe_quant.default_swap_config).
No GPU needed; run without TRITON_INTERPRET:

    PYTHONPATH=. python benchmarks/tools/sass_moe_quant_gemm.py [--methods int4 fp8] [--rows 16 32 64]
        [--config 32x128x64x4x4]   # BLOCK_M x BLOCK_N x BLOCK_K x warps x stages, both forms

An H100 SXM issues at most 132 SMs x 4 warp instructions a clock; at ~1.8 GHz and its ~3.0 TB/s copy
bandwidth a kernel that reads its weights at the floor can spend ~0.32 warp instructions a weight byte
(a GEMM whose m-blocks re-read an expert's tiles spends that per byte read, not per byte stored).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_moe_quant_gemv import CODES, SCALE_K, SCALES, sass_of  # noqa: E402

from moekv.ops import fused_moe_quant as fq  # noqa: E402
from moekv.ops.fused_moe import GemmConfig, default_gemm_config  # noqa: E402
from moekv.ops.quant_tiles import SCALES_PER_TILE, scale_mode  # noqa: E402

CODE_BYTES = {"int4": 0.5, "mxfp4": 0.5, "fp8": 1.0}
GROUP_BYTES = {"int4": 4, "mxfp4": 1, "fp8": 4}  # scale (+ zero point) bytes a group: bf16 + bf16, e8m0, fp32


def build(method: str, kernel: str, H: int, I: int, cfg: GemmConfig, swap: bool, epilogue: bool = False):
    """(SASS, resource usage) of one grouped GEMM, pointers 16-byte aligned and strides multiples of 16 as
    Triton specializes them at run time."""
    gate_up = kernel == "gate_up"
    N, K = (I, H) if gate_up else (H, I)
    act = "x_ptr" if gate_up else "h_ptr"
    sig = {act: "*bf16", "c_ptr": CODES[method], "s_ptr": SCALES[method], "z_ptr": SCALES[method]}
    sig |= {"h_ptr": "*bf16"} if gate_up else {"y_ptr": "*fp32", "weights_ptr": "*fp32"}
    sig |= {"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "num_m_blocks": "i32"}
    sig |= {"stride_xt" if gate_up else "stride_hm": "i32", "stride_ce": "i64", "stride_cn": "i32",
            "stride_se": "i32", "stride_sn": "i32", "stride_hm" if gate_up else "stride_ym": "i32"}
    sig |= {"b13_ptr" if gate_up else "b2_ptr": "*bf16", "stride_be": "i32"}
    SK = SCALE_K.get(method, K)
    consts = dict(N=N, K=K, INT4=method == "int4", MXFP4=method == "mxfp4", HAS_ZEROS=method == "int4", SN=1, SK=SK,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=False,
                  IEEE=False, PER_TILE=scale_mode(SK, K, cfg.block_k) == SCALES_PER_TILE, HAS_BIAS=epilogue,
                  SWAP_AB=swap)
    if gate_up:
        consts |= dict(TOP_K=2, CLAMPED=epilogue, ALPHA=1.702, LIMIT=7.0)
    divisible = [n for n in sig if sig[n].startswith("*") or n.startswith("stride")]
    fn = fq._qgate_up_gemm_kernel if gate_up else fq._qdown_gemm_kernel
    return sass_of(fn, sig, consts, divisible, cfg.num_warps, cfg.num_stages)


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def main_loop(sass: str) -> list[tuple[str, str]]:
    """The (opcode, operands) of the longest backward branch's body: the K loop."""
    best = (0, 0)
    for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+@!?P\d BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", sass):
        last, first = int(m.group(1), 16), int(m.group(2), 16)
        if first < last and last - first > best[1] - best[0]:
            best = (first, last)
    return [(m.group(2), m.group(3)) for m in INSTRUCTION.finditer(sass) if best[0] <= int(m.group(1), 16) <= best[1]]


def summary(sass: str, res: str, weight_bytes_a_step: float, num_warps: int) -> str:
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    shared = re.search(r"SHARED:(\d+)", res).group(1)
    body = main_loop(sass)
    ops = collections.Counter(op.split(".")[0] for op, _ in body)
    mma = ops["HMMA"] + ops["HGMMA"]
    rs = sum(1 for op, args in body if op.startswith("HGMMA") and re.match(r"\s*R\d+, R\d+,", args))
    kind = f"{ops['HGMMA']} HGMMA ({rs} with A from registers)" if ops["HGMMA"] else f"{ops['HMMA']} HMMA"
    dequant = sum(ops[o] for o in ("FADD", "FMUL", "FFMA", "LOP3", "F2FP", "PRMT", "SHF", "I2F", "F2F"))
    return (f"registers {regs} stack {stack} shared {shared}; a K step: {len(body)} instructions, "
            f"{kind if mma else 'no MMA'}, "
            f"STS {ops['STS'] + ops['STSM']} LDS {ops['LDS'] + ops['LDSM']} (LDSM {ops['LDSM']}) LDG {ops['LDG']} "
            f"LDGSTS {ops['LDGSTS']} BAR {ops['BAR']}, unpack and scaling {dequant} "
            f"(FADD {ops['FADD']} FMUL {ops['FMUL']} FFMA {ops['FFMA']} LOP3 {ops['LOP3']} F2FP {ops['F2FP']} "
            f"SHF {ops['SHF']} PRMT {ops['PRMT']}), "
            f"{num_warps * len(body) / weight_bytes_a_step:.3f} warp instructions a weight byte")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="*", default=["int4", "fp8"], choices=["int4", "fp8", "mxfp4"])
    p.add_argument("--rows", type=int, nargs="*", default=[16, 32, 64], help="pairs an expert (8 experts)")
    p.add_argument("--config", nargs="*", default=[],
                   help="BLOCK_MxBLOCK_NxBLOCK_KxWARPSxSTAGES to build in both forms instead of the default tables")
    p.add_argument("--kernels", nargs="*", default=["gate_up", "down"], choices=["gate_up", "down"])
    args = p.parse_args()
    H, I, E = 6144, 16384, 8
    if args.config:
        cases = [(swap, GemmConfig(m, n, k, 8, w, s)) for m, n, k, w, s in
                 (map(int, c.split("x")) for c in args.config) for swap in (False, True)]
    else:
        cases = [(swap, (fq.default_swap_config if swap else default_gemm_config)(rows * E, E))
                 for rows in args.rows for swap in (False, True)]
    seen = set()
    for method in args.methods:
        for swap, cfg in cases:
            if (method, swap, cfg) in seen:
                continue
            seen.add((method, swap, cfg))
            for kernel in args.kernels:
                sass, res = build(method, kernel, H, I, cfg, swap)
                K = H if kernel == "gate_up" else I
                SK = SCALE_K.get(method, K)
                tiles = 2 if kernel == "gate_up" else 1
                step_bytes = tiles * cfg.block_n * cfg.block_k * (CODE_BYTES[method] + GROUP_BYTES[method] / SK)
                name = "gemm_swap" if swap else "gemm     "
                shape = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                print(f"mixtral-8x22b {method:5} {kernel:7} {name} {shape}: "
                      f"{summary(sass, res, step_bytes, cfg.num_warps)}", flush=True)


if __name__ == "__main__":
    main()
