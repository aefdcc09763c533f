"""Fused MoE with quantized experts (moekv/ops/fused_moe_quant.py: fp8 per-channel, int4 groups of 128
with zero points, mxfp4 as gpt-oss's checkpoints ship it) beside the bf16 kernel (moekv/ops/fused_moe.py),
one CUDA device, at an expert shape (--shape): Mixtral-8x7B's (H=4096, I=14336, E=8, top-2), Mixtral-8x22B's
(H=6144, I=16384, E=8, top-2), or gpt-oss-20b's / 120b's (H=I=2880, E=32 / 128, top-4, with its expert biases
and clamped SwiGLU in the epilogues); and the quantized projection GEMV (moekv/ops/quant_linear.py) beside the bf16 one
(ops/dense_gemv.py) at the shape's qkv projection (not for mxfp4: gpt-oss's attention is bf16).

    python benchmarks/kernels/bench_moe_quant.py --out benchmarks/results/h200/moe_quant.json
    python benchmarks/kernels/bench_moe_quant.py --shape gpt-oss-20b --weights bf16 mxfp4 fp8 int4 \
        --tokens 1 2 4 8 --out benchmarks/results/h100/moe_quant_gpt_oss_20b.json

With mxfp4 the experts are random MXFP4 bytes (codes uniform, scales 2^-8 .. 2^-6: weights of about
0.02), and the other kinds are those weights dequantized to bf16 (and quantized from there), so every
row computes with the same experts. T=8 at top-4 is 32 pairs: the grouped GEMM (GEMV_MAX_PAIRS=16);
--path gemv forces the GEMV there too. --path gemv runs gemm times each path beside the others (rows carry
`path` as asked and `kernel` as taken); the run GEMV and the swap-AB grouped GEMM (gemm_swap) take quantized
weights only. The grouped GEMMs side by side, the same routing for each:

    python benchmarks/kernels/bench_moe_quant.py --shape mixtral-8x22b --tokens 16 64 128 256 \
        --path gemm gemm_swap --out benchmarks/results/h100/moe_quant_swap_8x22b.json

--f16-dots times int4's GEMVs at every T (the pair GEMV, or with --dots-paths the run GEMV too, at each of
--run-pairs) and its projection GEMV with their dots in fp32 and in packed halves (quant_tiles.int4_f16_dots,
run_f16_dots), both forms in the same run (rows with op moe_dots / qkv_dots, `dots` fp32 or f16, `path`, and
`run_pairs` for the run GEMV):

    python benchmarks/kernels/bench_moe_quant.py --weights fp8 int4 --tokens 1 2 4 8 --f16-dots
    python benchmarks/kernels/bench_moe_quant.py --weights int4 --tokens 8 16 --f16-dots --dots-paths runs \
        --run-pairs 2 4

Timings: CUDA-graph replays (triton.testing.do_bench_cudagraph, median), as the decode step runs
them. bytes = the touched experts' codes, scales and zero points (all of a projection's) + x read +
out written; floor_ms = bytes / the copy bandwidth measured in the same run (1 GiB device-to-device,
read + write). max_err: max |out - reference| / max |reference|, the reference on the same
dequantized weights (moekv.ops.reference).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moekv.models.mxfp4 import mxfp4_weight  # noqa: E402
from moekv.models.quantize import quantize_stacked  # noqa: E402
from moekv.ops import dense_gemv, fused_moe_quant, quant_linear  # noqa: E402
from moekv.ops import fused_moe as fm  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight, quantize  # noqa: E402
from moekv.ops.reference import clamped_swiglu_moe_ref, fused_moe_ref, linear_ref  # noqa: E402

DEVICE = "cuda"
# expert shape (E, H, I, top-k, qkv rows, gpt-oss's epilogues)
SHAPES = {"mixtral-8x7b": (8, 4096, 14336, 2, 6144, False),
          "mixtral-8x22b": (8, 6144, 16384, 2, 8192, False),
          "gpt-oss-20b": (32, 2880, 2880, 4, 5120, True),
          "gpt-oss-120b": (128, 2880, 2880, 4, 5120, True)}
SWIGLU = (1.702, 7.0)  # gpt-oss's alpha and limit


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
    p.add_argument("--shape", choices=list(SHAPES), default="mixtral-8x7b")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 64])
    p.add_argument("--weights", nargs="*", default=["bf16", "fp8", "int4"], choices=["bf16", "fp8", "int4", "mxfp4"])
    p.add_argument("--path", nargs="*", choices=["auto", "gemv", "runs", "gemm", "gemm_swap"], default=["auto"],
                   help="the MoE kernel's paths, each timed (auto: fused_moe_quant.default_path; gemv: a program "
                        "per pair, T*k <= GEMV_MAX_PAIRS; runs: a program per run of pairs of one expert, "
                        "T*k <= ALIGN_MAX_PAIRS, quantized weights only; gemm_swap: the grouped GEMM's swap-AB "
                        "form, quantized weights only)")
    p.add_argument("--gemv-tiles", nargs="*", default=[],
                   help="BLOCK_NxBLOCK_K tiles (e.g. 8x1024 16x1024) to time the quantized GEMV with beside its "
                        "default, at one token (rows with op moe_tile)")
    p.add_argument("--proj-tiles", nargs="*", default=[],
                   help="BLOCK_NxBLOCK_K tiles to time the quantized projection GEMV (ops/quant_linear.py) with "
                        "beside its default, at one token (rows with op qkv_tile)")
    p.add_argument("--f16-dots", action="store_true",
                   help="int4: time the GEMVs of --dots-paths at every T and the projection GEMV with fp32 and "
                        "packed-half dots (rows with op moe_dots / qkv_dots)")
    p.add_argument("--dots-paths", nargs="*", choices=["gemv", "runs"], default=["gemv"],
                   help="--f16-dots: the MoE GEMVs timed both ways (gemv: T*k <= GEMV_MAX_PAIRS; runs: T*k <= "
                        "ALIGN_MAX_PAIRS)")
    p.add_argument("--run-pairs", type=int, nargs="*", default=[],
                   help="--f16-dots: P of the run GEMV's rows (default: fused_moe_quant.default_run_pairs)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    E, H, I, K_TOP, QKV, oss = SHAPES[args.shape]
    torch.manual_seed(0)
    hbm = measure_hbm_gbps()
    print(f"copy bandwidth {hbm:.0f} GB/s", flush=True)
    m13 = m2 = None
    if "mxfp4" in args.weights:  # random MXFP4 bytes; the other kinds start from their dequantized weights
        gen = torch.Generator(device=DEVICE).manual_seed(0)

        def random_mxfp4(*shape):
            *lead, N, K = shape
            blocks = torch.randint(0, 256, (*lead, N, K // 32, 16), dtype=torch.uint8, device=DEVICE, generator=gen)
            scales = torch.randint(119, 122, (*lead, N, K // 32), dtype=torch.uint8, device=DEVICE, generator=gen)
            return mxfp4_weight(blocks, scales)

        m13, m2 = random_mxfp4(E, 2 * I, H), random_mxfp4(E, H, I)
        w13, w2 = m13.dequantize(torch.bfloat16), m2.dequantize(torch.bfloat16)
    else:
        w13 = (torch.randn(E, 2 * I, H, device=DEVICE) * H ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device=DEVICE) * I ** -0.5).to(torch.bfloat16)
    proj = (torch.randn(QKV, H, device=DEVICE) * H ** -0.5).to(torch.bfloat16)
    b13 = (torch.randn(E, 2 * I, device=DEVICE) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device=DEVICE) * 0.1).to(torch.bfloat16)
    epilogue = dict(biases=(b13, b2), clamped_swiglu=SWIGLU) if oss else {}
    rows = []
    for weights in args.weights:
        qp = None
        if weights == "bf16":
            q13, q2, qp = w13, w2, proj
            kernel = fm.fused_moe
            project = dense_gemv.dense_gemv
        elif weights == "mxfp4":
            q13, q2 = m13, m2
            kernel = fused_moe_quant.fused_moe_quant
        else:
            q13, q2 = quantize_stacked(w13, weights), quantize_stacked(w2, weights)
            qp = quantize(proj, weights)
            kernel = fused_moe_quant.fused_moe_quant
            project = quant_linear.quant_gemv

        for T, path_arg in [(T, pa) for T in args.tokens for pa in args.path]:
            path = None if path_arg == "auto" else path_arg
            if path == "gemv" and T * K_TOP > fm.GEMV_MAX_PAIRS:
                print(f"moe  {weights:>5} T={T:3d} skipped: --path gemv takes T*k <= {fm.GEMV_MAX_PAIRS}", flush=True)
                continue
            if path == "runs" and (weights == "bf16" or T * K_TOP > fm.ALIGN_MAX_PAIRS):
                continue
            if path == "gemm_swap" and weights == "bf16":
                continue

            def run(x, topw, ids, kernel=kernel, q13=q13, q2=q2, path=path):
                return kernel(x, q13, q2, topw, ids, path=path, **epilogue)

            torch.manual_seed(T)  # the same tokens and routing for every path and weight kind at T
            x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
            logits = torch.randn(T, E, device=DEVICE)
            topw, ids = torch.softmax(logits, -1).topk(K_TOP)
            topw = topw / topw.sum(-1, keepdim=True)
            out = run(x, topw, ids)
            ref = (clamped_swiglu_moe_ref(x, q13, b13, q2, b2, topw, ids, *SWIGLU) if oss
                   else fused_moe_ref(x, q13, q2, topw, ids))
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            touched = ids.unique().tolist()
            nbytes = expert_bytes(q13, touched) + expert_bytes(q2, touched) + 2 * x.numel() * 2
            if oss:  # each touched expert's biases
                nbytes += len(touched) * (2 * I + H) * b13.element_size()
            ms = do_bench_cudagraph(lambda: run(x, topw, ids), rep=200)
            floor = nbytes / hbm / 1e6
            taken = path or (fused_moe_quant.default_path(T * K_TOP, E, q13.method) if weights != "bf16"
                             else fm.default_path(T * K_TOP, E))
            rows.append(dict(op="moe", shape=args.shape, weights=weights, tokens=T, path=path_arg, kernel=taken,
                             ms=ms, floor_ms=floor, frac_of_floor=floor / ms, bytes=nbytes, max_err=err))
            print(f"moe  {weights:>5} T={T:3d} {path_arg:>4} ({taken:4}) {ms:8.4f} ms floor {floor:.4f} ms "
                  f"({floor / ms:.2f}) err {err:.1e}", flush=True)
            dots_forms = []  # (path, P) of the GEMVs timed with fp32 and packed-half dots
            if args.f16_dots and weights == "int4" and path_arg == args.path[0]:
                if "gemv" in args.dots_paths and T * K_TOP <= fm.GEMV_MAX_PAIRS:
                    dots_forms.append(("gemv", 0))
                if "runs" in args.dots_paths and T * K_TOP <= fm.ALIGN_MAX_PAIRS:
                    dots_forms += [("runs", P or fused_moe_quant.default_run_pairs(T * K_TOP, E))
                                   for P in args.run_pairs or [0]]
            for (dots_path, P), f16 in [(form, f16) for form in dots_forms for f16 in (False, True)]:
                cfg = dataclasses.replace(fused_moe_quant.default_quant_gemv(q13), f16_dots=f16, run_pairs=P or None)

                def gemv(cfg=cfg, dots_path=dots_path):
                    return fused_moe_quant.fused_moe_quant(x, q13, q2, topw, ids, path=dots_path, config=cfg,
                                                           **epilogue)

                err = ((gemv().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = do_bench_cudagraph(gemv, rep=200)
                dots = "f16" if f16 else "fp32"
                rows.append(dict(op="moe_dots", shape=args.shape, weights=weights, tokens=T, path=dots_path,
                                 run_pairs=P or None, dots=dots, ms=ms, floor_ms=floor, frac_of_floor=floor / ms,
                                 bytes=nbytes, max_err=err))
                name = f"runs P={P}" if P else "gemv"
                print(f"moe  {weights:>5} T={T:3d} {name} {dots:>4} dots {ms:8.4f} ms floor {floor:.4f} ms "
                      f"({floor / ms:.2f}) err {err:.1e}", flush=True)
            if weights == "bf16" or T != 1 or path_arg != args.path[0]:
                continue
            for tile in args.gemv_tiles:
                block_n, block_k = map(int, tile.split("x"))
                cfg = fused_moe_quant.QuantGemvConfig(block_n=block_n, block_k=block_k)
                ms = do_bench_cudagraph(lambda cfg=cfg: fused_moe_quant.fused_moe_quant(
                    x, q13, q2, topw, ids, path="gemv", config=cfg, **epilogue), rep=200)
                rows.append(dict(op="moe_tile", shape=args.shape, weights=weights, tokens=T, tile=tile, ms=ms,
                                 floor_ms=floor, frac_of_floor=floor / ms, bytes=nbytes))
                print(f"moe  {weights:>5} T={T:3d} {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) tile {tile}",
                      flush=True)
        if qp is None:
            continue
        x = torch.randn(1, H, device=DEVICE).to(torch.bfloat16)
        out = project(x, qp)
        ref = linear_ref(x, qp)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        nbytes = (qp.nbytes if isinstance(qp, QuantizedWeight) else qp.numel() * 2) + 2 * (H + QKV)
        ms = do_bench_cudagraph(lambda: project(x, qp), rep=200)
        floor = nbytes / hbm / 1e6
        rows.append(dict(op="qkv_gemv", shape=args.shape, weights=weights, tokens=1, ms=ms, floor_ms=floor,
                         frac_of_floor=floor / ms, bytes=nbytes, max_err=err))
        print(f"qkv  {weights:>5} T=  1 {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) err {err:.1e}", flush=True)
        for f16 in (False, True) if args.f16_dots and weights == "int4" else ():
            shape = dataclasses.replace(quant_linear.SHAPE_OF_METHOD["int4"], f16_dots=f16)
            err = ((quant_linear.quant_gemv(x, qp, shape=shape).float() - ref.float()).abs().max()
                   / ref.float().abs().max()).item()
            ms = do_bench_cudagraph(lambda shape=shape: quant_linear.quant_gemv(x, qp, shape=shape), rep=200)
            dots = "f16" if f16 else "fp32"
            rows.append(dict(op="qkv_dots", shape=args.shape, weights=weights, tokens=1, dots=dots, ms=ms,
                             floor_ms=floor, frac_of_floor=floor / ms, bytes=nbytes, max_err=err))
            print(f"qkv  {weights:>5} T=  1 {dots:>4} dots {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) "
                  f"err {err:.1e}", flush=True)
        for tile in args.proj_tiles if weights != "bf16" else ():
            block_n, block_k = map(int, tile.split("x"))
            shape = quant_linear.QuantGemvShape(block_n=block_n, block_k=block_k)
            ms = do_bench_cudagraph(lambda shape=shape: quant_linear.quant_gemv(x, qp, shape=shape), rep=200)
            rows.append(dict(op="qkv_tile", shape=args.shape, weights=weights, tokens=1, tile=tile, ms=ms,
                             floor_ms=floor, frac_of_floor=floor / ms, bytes=nbytes))
            print(f"qkv  {weights:>5} T=  1 {ms:8.4f} ms floor {floor:.4f} ms ({floor / ms:.2f}) tile {tile}",
                  flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
              "copy_bandwidth_gbps": hbm, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
