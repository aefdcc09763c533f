"""Fused MoE with quantized experts (moekv/ops/fused_moe_quant.py: fp8 per-channel, int4 groups of 128
with zero points) beside the bf16 kernel (moekv/ops/fused_moe.py), at the Mixtral-8x7B expert shape
(H=4096, I=14336, E=8, top-2), one CUDA device; and the quantized projection GEMV
(moekv/ops/quant_linear.py) beside the bf16 one (ops/dense_gemv.py) at the qkv shape [6144, 4096].

    python benchmarks/kernels/bench_moe_quant.py --out benchmarks/results/h200/moe_quant.json

Timings: CUDA-graph replays (triton.testing.do_bench_cudagraph, median), as the decode step runs
them. bytes = the touched experts' codes, scales and zero points (all of a projection's) + x read +
out written; floor_ms = bytes / the copy bandwidth measured in the same run (1 GiB device-to-device,
read + write). max_err: max |out - reference| / max |reference|, the reference on the same
dequantized weights (moekv.ops.reference).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moekv.models.quantize import quantize_stacked  # noqa: E402
from moekv.ops import dense_gemv, fused_moe_quant, quant_linear  # noqa: E402
from moekv.ops import fused_moe as fm  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight, quantize  # noqa: E402
from moekv.ops.reference import fused_moe_ref, linear_ref  # noqa: E402

DEVICE = "cuda"
E, H, I, K_TOP = 8, 4096, 14336, 2


def measure_hbm_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # free the buffers (rebound, not del: the timed lambda closes over them)
    return 2 * (1 << 30) / ms / 1e6


def expert_bytes(w, experts: list[int]) -> int:
    if isinstance(w, QuantizedWeight):
        return sum(w[e].nbytes for e in experts)
    return sum(w[e].numel() * w.element_size() for e in experts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 64])
    p.add_argument("--weights", nargs="*", default=["bf16", "fp8", "int4"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    hbm = measure_hbm_gbps()
    print(f"copy bandwidth {hbm:.0f} GB/s", flush=True)
    w13 = (torch.randn(E, 2 * I, H, device=DEVICE) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEVICE) * I ** -0.5).to(torch.bfloat16)
    proj = (torch.randn(6144, H, device=DEVICE) * H ** -0.5).to(torch.bfloat16)
    rows = []
    for weights in args.weights:
        if weights == "bf16":
            q13, q2, qp = w13, w2, proj
            run = fm.fused_moe
            project = dense_gemv.dense_gemv
        else:
            q13, q2 = quantize_stacked(w13, weights), quantize_stacked(w2, weights)
            qp = quantize(proj, weights)
            run = fused_moe_quant.fused_moe_quant
            project = quant_linear.quant_gemv
        for T in args.tokens:
            x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
            logits = torch.randn(T, E, device=DEVICE)
            topw, ids = torch.softmax(logits, -1).topk(K_TOP)
            topw = topw / topw.sum(-1, keepdim=True)
            out = run(x, q13, q2, topw, ids)
            ref = fused_moe_ref(x, q13, q2, topw, ids)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            touched = ids.unique().tolist()
            nbytes = expert_bytes(q13, touched) + expert_bytes(q2, touched) + 2 * x.numel() * 2
            ms = do_bench_cudagraph(lambda: run(x, q13, q2, topw, ids), rep=200)
            floor = nbytes / hbm / 1e6
            rows.append(dict(op="moe", weights=weights, tokens=T, ms=ms, floor_ms=floor, frac_of_floor=floor / ms,
                             bytes=nbytes, max_err=err))
            print(f"moe  {weights:>4} T={T:3d} {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) err {err:.1e}",
                  flush=True)
        x = torch.randn(1, H, device=DEVICE).to(torch.bfloat16)
        out = project(x, qp)
        ref = linear_ref(x, qp)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        nbytes = (qp.nbytes if isinstance(qp, QuantizedWeight) else qp.numel() * 2) + 2 * (H + 6144)
        ms = do_bench_cudagraph(lambda: project(x, qp), rep=200)
        floor = nbytes / hbm / 1e6
        rows.append(dict(op="qkv_gemv", weights=weights, tokens=1, ms=ms, floor_ms=floor, frac_of_floor=floor / ms,
                         bytes=nbytes, max_err=err))
        print(f"qkv  {weights:>4} T=  1 {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) err {err:.1e}", flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
              "copy_bandwidth_gbps": hbm, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
