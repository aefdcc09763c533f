"""nuq2 page quantization: the fused kernel (moekv/ops/nuq2_quantize.py) against the torch
reference (`NUQ2Format.quantize` + `PageLayout.pack`), eager and replayed from a CUDA graph (a
decode step that fills pages runs it inside the step's graph; prefill runs it eagerly), on bf16
pages of the Mixtral shape (8 KV heads, P = 64, D = 128), one CUDA device.

    PYTHONPATH=. python benchmarks/kernels/bench_nuq2_quantize.py --out benchmarks/results/h200/nuq2_quantize.json

pages: full pages quantized in one call, for all layers (a batch-64 decode step fills one or two
pages a step: 32-64 pages over 32 layers; a prefill chunk of 2 x 4096 tokens fills 128 a layer).
bytes = the bf16 pages read + the slabs written; floor_ms = bytes / the HBM copy bandwidth
measured in the same run. Agreement with the reference on the same pages: the share of equal
codes and the largest centroid difference in fp16 ulps (rows `agreement`). Rows kernel_w<n>: the
kernel at n warps a program (`--num-warps`), beside its default launch (row `kernel`).
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

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import measure_hbm_gbps  # noqa: E402  (a 1 GiB copy, the floor's bandwidth)

from moekv.kvcache.formats.nuq2 import KMEANS_ITERS, NUQ2Format, unpack_codes  # noqa: E402
from moekv.ops.nuq2_quantize import nuq2_quantize_packed  # noqa: E402

DEVICE = "cuda"


def key_like(n, H, P, D, gen):
    """bf16 keys with outlier channels and spikes, as real keys have (the outlier slots fill)."""
    x = torch.randn(n, H, P, D, generator=gen, device=DEVICE)
    x[..., 3] += 6.0
    x[..., D // 2] *= 5.0
    spikes = torch.rand(n, H, P, D, generator=gen, device=DEVICE) < 0.004
    return torch.where(spikes, x + 12.0, x).to(torch.bfloat16)


def agreement(fmt_kernel, fmt_torch, x, kind):
    P, D = x.shape[2], x.shape[3]
    layout = fmt_kernel.layout(kind, P, D)
    g = layout.unpack(fmt_kernel.quantize_packed(x, kind))
    w = layout.unpack(fmt_torch.quantize_packed(x, kind))
    codes = (unpack_codes(g["codes"]) == unpack_codes(w["codes"])).float().mean().item()
    ulps = (g["centroids"].view(torch.int16).int() - w["centroids"].view(torch.int16).int()).abs().max().item()
    return codes, ulps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, nargs="*", default=[32, 64, 256, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-warps", type=int, nargs="*", default=[4, 8, 16],
                   help="launch shapes of the kernel timed besides its default (rows kernel_w<n>)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_nuq2_quantize needs a CUDA device")
    gbps = measure_hbm_gbps()
    print(f"HBM copy bandwidth: {gbps:.0f} GB/s", flush=True)
    kernel, reference = NUQ2Format(quantize_kernel=True), NUQ2Format(quantize_kernel=False)
    H, P, D = args.heads, args.block_size, args.head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for n in args.pages:
        for kind in ("key", "value"):
            x = key_like(n, H, P, D, gen) if kind == "key" else (torch.randn(n, H, P, D, generator=gen, device=DEVICE)
                                                                 .to(torch.bfloat16))
            slab = kernel.layout(kind, P, D).slab_bytes
            nbytes = x.numel() * x.element_size() + n * H * slab
            floor_ms = nbytes / gbps / 1e6
            codes, ulps = agreement(kernel, reference, x, kind)
            rows.append(dict(impl="agreement", kind=kind, pages=n, codes_equal=codes, centroid_max_ulps=ulps,
                             floor_ms=floor_ms))
            print(json.dumps(rows[-1]), flush=True)
            timings = {
                "kernel": lambda: do_bench_cudagraph(lambda: kernel.quantize_packed(x, kind), rep=100),
                "torch_graph": lambda: do_bench_cudagraph(lambda: reference.quantize_packed(x, kind), rep=100),
                "torch_eager": lambda: do_bench(lambda: reference.quantize_packed(x, kind), rep=100,
                                                return_mode="median"),
            }
            layout, slots = kernel.layout(kind, P, D), kernel.outlier_slots(kind, P, D)
            for w in args.num_warps:
                timings[f"kernel_w{w}"] = (lambda w: lambda: do_bench_cudagraph(
                    lambda: nuq2_quantize_packed(x, kind, layout, slots, kernel.tau, KMEANS_ITERS, num_warps=w),
                    rep=100))(w)
            for impl, timed in timings.items():
                try:
                    ms = timed()
                    row = dict(impl=impl, kind=kind, pages=n, heads=H, block_size=P, head_dim=D, ms=ms,
                               bytes=nbytes, gbps=nbytes / ms / 1e6, floor_ms=floor_ms)
                except Exception as exc:  # e.g. out of memory at the largest batch: report, go on
                    row = dict(impl=impl, kind=kind, pages=n, ms=None, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
            x = None  # free the input (rebound, not del: the timed lambdas close over x)
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv),
                  hbm_copy_gbps=gbps, rows=rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    warps = [f"kernel_w{w}" for w in args.num_warps]
    print(f"\n{'kind':6} {'pages':>6} {'kernel ms':>10} {'torch graph':>12} {'torch eager':>12} {'floor ms':>9} "
          + " ".join(f"{w:>11}" for w in warps))
    for n in args.pages:
        for kind in ("key", "value"):
            ms = {r["impl"]: r.get("ms") for r in rows if r["pages"] == n and r["kind"] == kind}
            floor = next(r["floor_ms"] for r in rows if r["pages"] == n and r["kind"] == kind)
            fmt = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
            print(f"{kind:6} {n:>6} {fmt(ms.get('kernel')):>10} {fmt(ms.get('torch_graph')):>12} "
                  f"{fmt(ms.get('torch_eager')):>12} {floor:>9.4f} " + " ".join(f"{fmt(ms.get(w)):>11}" for w in warps))


if __name__ == "__main__":
    main()
