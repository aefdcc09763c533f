"""The quantized MoE gate/up GEMV (ops/fused_moe_quant.py) built offline for sm_90 at gpt-oss-20b's
expert shape (H = I = 2880, top-4, the epilogues on and off), int4 and mxfp4 codes: registers, stack
and the SASS global loads a K step issues (LDG.E.128 where the codes' rows are known 16-byte aligned).
No GPU needed; run without TRITON_INTERPRET:

    PYTHONPATH=. python benchmarks/tools/sass_moe_quant_gemv.py
"""
from __future__ import annotations

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

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(mxfp4: bool, epilogue: bool) -> tuple[str, str, collections.Counter]:
    scale = "*u8" if mxfp4 else "*bf16"
    sig = {"x_ptr": "*bf16", "c_ptr": "*i32", "s_ptr": scale, "z_ptr": scale, "h_ptr": "*bf16",
           "expert_ids_ptr": "*i64", "num_pairs": "i32", "stride_xt": "i32", "stride_ce": "i64", "stride_cn": "i32",
           "stride_se": "i32", "stride_sn": "i32", "stride_hm": "i32", "b13_ptr": "*bf16", "stride_be": "i32"}
    consts = dict(N=2880, K=2880, TOP_K=4, INT4=not mxfp4, MXFP4=mxfp4, HAS_ZEROS=not mxfp4, SN=1,
                  SK=32 if mxfp4 else 128, SCALE_MODE=2, BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=epilogue, CLAMPED=epilogue,
                  ALPHA=1.702, LIMIT=7.0)
    # pointers 16-byte aligned and the expert stride a multiple of 16, as Triton specializes them at run
    # time; the row stride (360 words) is not, as at run time
    src = ASTSource(fq._qgate_up_gemv_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 11)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    loads = collections.Counter(w for line in sass.splitlines() for w in line.split() if w.startswith("LDG"))
    return re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1), loads


def main() -> None:
    for mxfp4 in (False, True):
        for epilogue in (False, True):
            regs, stack, loads = build(mxfp4, epilogue)
            print(f"{'mxfp4' if mxfp4 else 'int4':5} epilogue={epilogue!s:5} registers {regs} stack {stack} "
                  f"loads {dict(loads)}")


if __name__ == "__main__":
    main()
