"""Fused MoE (moekv/ops/fused_moe.py) vs a per-expert loop, torch._grouped_mm and the reference,
at the Mixtral-8x7B expert shape (H=4096, I=14336, E=8, top-2, bf16), one CUDA device.

    python benchmarks/kernels/bench_moe.py --out benchmarks/results/h200/moe.json

Timings: triton.testing.do_bench medians (L2 flushed before each run); the fused step also through
a CUDA graph (do_bench_cudagraph), as the decode step runs it. bytes = weights of the distinct
experts the step touches + x read + out written; floor_ms = bytes / HBM bandwidth measured in the
same run (device-to-device copy of 1 GiB, read + write). Routing: softmax top-2 of seeded random
logits. max_err: max |out - reference| over max |reference| (both bf16). With --sweep (default)
the fused kernels also run at a small grid of launch shapes (rows `fused_sweep`, config fields).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moekv.ops import fused_moe as fm  # noqa: E402
from moekv.ops.reference import fused_moe_ref, silu_and_mul_ref  # noqa: E402

DEVICE = "cuda"


def measure_hbm_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # free the buffers (rebound, not del: the timed lambda closes over them)
    return 2 * (1 << 30) / ms / 1e6


def per_expert_loop(x, w13, w2, weights, ids):
    """The plain PyTorch way: for each expert, gather its tokens, two matmuls, scatter-add back."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = silu_and_mul_ref(x[tok] @ w13[e].T)
        out.index_add_(0, tok, (h @ w2[e].T) * weights[tok, slot, None].to(x.dtype))
    return out


def grouped_mm_moe(x, w13, w2, weights, ids):
    """torch._grouped_mm over pairs sorted by expert (offs = end row of each expert's group)."""
    E, k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat,
                                                                             torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    h = silu_and_mul_ref(torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs))  # [M, I]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [M, H]
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def gemv_sweep():
    """Launch shapes for the decode GEMV (row sums per K step, the default): 2-4 pipeline stages,
    then down-projection splits, then the fp32-tile accumulator of the earlier default."""
    out = []
    for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8), (2, 3, 4)):
        if bn * bk <= 64 * 32 * warps and bn * bk >= 16 * 32 * warps:
            out.append(fm.GemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
    out += [fm.GemvConfig(block_n=8, block_k=1024, num_splits=s) for s in (1, 2, 4, 8)]
    # products in an fp32 tile reduced once at the end (the default before row sums)
    out += [fm.GemvConfig(block_n=bn, block_k=bk, num_stages=st, row_sums=False)
            for bn, bk, st in ((16, 512, 4), (32, 256, 3))]
    return out


GEMM_SWEEP = [fm.GemmConfig(*c) for c in [
    (16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4), (32, 64, 128, 8, 4, 4), (32, 128, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/<device>/moe.json)")
    p.add_argument("--tokens", default="1,16,64,256,1024")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the launch-shape sweep")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device")
    device_name = torch.cuda.get_device_name()
    slug = "h200" if "H200" in device_name else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    out_path = args.out or Path(__file__).resolve().parent / "results" / slug / "moe.json"
    E, H, I, k = args.experts, args.hidden, args.intermediate, args.top_k
    dtype = torch.bfloat16

    hbm_gbps = measure_hbm_gbps()
    print(f"{device_name}: measured HBM {hbm_gbps:.0f} GB/s (1 GiB copy)", flush=True)
    g = torch.Generator(device=DEVICE).manual_seed(args.seed)
    w13 = torch.empty(E, 2 * I, H, device=DEVICE, dtype=dtype)  # allocated once: E x 3 x H x I x 2 bytes
    w2 = torch.empty(E, H, I, device=DEVICE, dtype=dtype)
    for e in range(E):  # fill per expert: no fp32 copy of the whole stack
        w13[e].copy_(torch.randn(2 * I, H, device=DEVICE, generator=g) * H ** -0.5)
        w2[e].copy_(torch.randn(H, I, device=DEVICE, generator=g) * I ** -0.5)
    expert_bytes = 3 * H * I * w13.element_size()

    grouped_reason = None
    if not hasattr(torch, "_grouped_mm"):
        grouped_reason = f"torch {torch.__version__} has no torch._grouped_mm"

    rows = []

    def bench(impl, T, fn, ref, touched, cudagraph=False, **extra):
        try:
            got = fn()
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # record, keep going (one failing shape must not lose the run)
            rows.append(dict(impl=impl, tokens=T, ms=None, gbps=None, floor_ms=None,
                             error=f"{type(exc).__name__}: {exc}"[:300], **extra))
            print(f"{impl:>12} T={T:5d} failed: {rows[-1]['error']}", flush=True)
            return None
        nbytes = touched * expert_bytes + 2 * T * H * 2
        floor_ms = nbytes / hbm_gbps / 1e6
        row = dict(impl=impl, tokens=T, ms=ms, gbps=nbytes / ms / 1e6, floor_ms=floor_ms, frac_of_floor=floor_ms / ms,
                   bytes=nbytes, experts_touched=touched, max_err=err, **extra)
        if cudagraph:
            try:
                row["ms_cudagraph"] = do_bench_cudagraph(fn, rep=100, return_mode="median")
                row["frac_of_floor_cudagraph"] = floor_ms / row["ms_cudagraph"]
            except Exception as exc:
                row["cudagraph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        graph = f" graph {row['ms_cudagraph']:.4f} ms" if "ms_cudagraph" in row else ""
        print(f"{impl:>12} T={T:5d} {ms:9.4f} ms {row['gbps']:7.0f} GB/s floor {floor_ms:.4f} ms "
              f"({row['frac_of_floor']:.2f}){graph} err {err:.1e} {extra or ''}", flush=True)
        return ms

    for T in [int(t) for t in args.tokens.split(",")]:
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed + T)
        x = torch.randn(T, H, device=DEVICE, generator=gen).to(dtype)
        logits = torch.randn(T, E, device=DEVICE, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(k)
        weights = weights / weights.sum(-1, keepdim=True)
        touched = int(ids.unique().numel())
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        auto = "gemv" if T * k <= fm.GEMV_MAX_PAIRS else "gemm"
        bench("fused", T, lambda: fm.fused_moe(x, w13, w2, weights, ids), ref, touched, cudagraph=True, path=auto)
        if T * k <= 2 * fm.GEMV_MAX_PAIRS:  # near the switch: the other path too
            other = "gemm" if auto == "gemv" else "gemv"
            bench(f"fused_{other}", T, lambda: fm.fused_moe(x, w13, w2, weights, ids, path=other), ref, touched,
                  cudagraph=True, path=other)
        if T * k <= fm.GEMV_MAX_PAIRS:  # the down GEMV with the k slots folded in (no partials, no sum launch)
            for bn in (8, 16, 32):
                cfg = fm.GemvConfig(block_n=bn, block_k=256, fold_slots=True)
                bench("fused_gemv_fold", T, lambda: fm.fused_moe(x, w13, w2, weights, ids, path="gemv", config=cfg),
                      ref, touched, cudagraph=True, path="gemv", cfg_block_n=bn)
        bench("loop", T, lambda: per_expert_loop(x, w13, w2, weights, ids), ref, touched)
        if grouped_reason is None:
            bench("grouped_mm", T, lambda: grouped_mm_moe(x, w13, w2, weights, ids), ref, touched)
            if rows[-1].get("error"):
                grouped_reason = rows[-1]["error"]
        else:
            rows.append(dict(impl="grouped_mm", tokens=T, ms=None, gbps=None, floor_ms=None, error=grouped_reason))
        bench("reference", T, lambda: fused_moe_ref(x, w13, w2, weights, ids), ref, touched)
        if args.sweep:
            configs = [("gemv", c) for c in gemv_sweep()] if T * k <= 2 * fm.GEMV_MAX_PAIRS else []
            configs += ([("gemm", c) for c in GEMM_SWEEP] if T > 1
                        else [("gemm", GEMM_SWEEP[0]), ("gemm", GEMM_SWEEP[1])])
            for path, cfg in configs:
                bench("fused_sweep", T, lambda: fm.fused_moe(x, w13, w2, weights, ids, path=path, config=cfg), ref,
                      touched, path=path, **{f"cfg_{key}": v for key, v in vars(cfg).items()})

    result = dict(device=device_name, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python " + " ".join(sys.argv),
                  hbm_gbps=hbm_gbps, shape=dict(hidden=H, intermediate=I, experts=E, top_k=k, dtype="bfloat16"),
                  grouped_mm_unavailable=grouped_reason, rows=rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    best = {}
    for r in rows:
        if r.get("ms") is not None and r["impl"].startswith("fused"):
            if r["tokens"] not in best or r["ms"] < best[r["tokens"]]["ms"]:
                best[r["tokens"]] = r
    for T, r in best.items():
        print(f"best fused at T={T}: {r['ms']:.4f} ms ({r['frac_of_floor']:.2f} of floor) "
              f"{ {key: v for key, v in r.items() if key.startswith('cfg_') or key == 'path'} }")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
