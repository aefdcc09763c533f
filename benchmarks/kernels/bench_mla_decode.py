"""The absorbed MLA decode kernel (moekv/ops/decode/mla.py) against the latent cache's byte floor.

For each (batch, context, heads) shape and latent format (bf16, fp8_e4m3, int4 G=32): the kernel's median time
(triton.testing.do_bench), the bytes one decode step must read (every sequence's entries once, the
queries, the output), and the floor = bytes / the copy bandwidth measured in the same run. Launch
shapes (block_h) and launch configs of the table (moekv/ops/configs/mla_decode_<device>.json; `v1` is the
launch before the table) are swept and each reported; the default launch is marked.

    PYTHONPATH=. python benchmarks/kernels/bench_mla_decode.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import triton
import triton.testing

from moekv.kvcache.formats.latent import LatentFormat, LatentFP8Format
from moekv.kvcache.formats.latent_lowbit import LatentInt4Format
from moekv.ops.decode.mla import mla_decode, tuning

RANK, ROPE, PAGE = 512, 64, 64


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def case(fmt, batch: int, context: int, heads: int, bandwidth: float, block_hs: list[int | None],
         configs: list[str | None]) -> list[dict]:
    device = torch.device("cuda")
    pages_per = -(-context // PAGE)
    cache = fmt.allocate(batch * pages_per, 1, PAGE, RANK + ROPE, device, batch, torch.bfloat16)
    for name, t in cache.tensors.items():  # random entries of per-token magnitudes
        if t.dtype == torch.float8_e4m3fn:
            t.copy_((torch.randn(t.shape, device=device) * 100).clamp(-448, 448).to(t.dtype))
        elif name in ("latent_scales", "latent_scale"):
            t.copy_(torch.rand(t.shape, device=device) * 0.01)
        elif t.dtype == torch.uint8:  # int4 codes
            t.random_(0, 256)
        else:
            t.normal_()
    tables = torch.randperm(batch * pages_per, device=device, dtype=torch.int64).view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, RANK + ROPE, device=device, dtype=torch.bfloat16) / 8
    tensors = fmt.kernel_tensors(cache)
    scale = 192 ** -0.5
    cache_bytes = batch * context * fmt.token_bytes(RANK + ROPE)
    io_bytes = q.numel() * 2 + batch * heads * RANK * 2
    floor_us = (cache_bytes + io_bytes) / bandwidth * 1e6
    rows = []
    int4 = "zeros" in tensors
    for block_h in block_hs:
        for config in configs:
            named = tuning()["configs"][config] if config is not None else None
            if named is not None and ((int4 and named.swap) or (named.fp8_mma and fmt.name != "fp8_e4m3")):
                continue  # the int4 kernel has no transposed form; fp8 MMAs read the fp8 latent only
            fn = lambda: mla_decode(q, tensors, tables, lens, scale, RANK, block_h=block_h, max_len=context,  # noqa: E731
                                    config=config)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a config that does not launch is a row too
                print(f"{fmt.name} {batch}x{context}x{heads} {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            us = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
            rows.append({"format": fmt.name, "batch": batch, "context": context, "heads": heads,
                         "block_h": block_h or "default", "config": config or "default", "us": round(us, 1),
                         "floor_us": round(floor_us, 1), "of_floor": round(floor_us / us, 3),
                         "cache_bytes_per_token": fmt.token_bytes(RANK + ROPE)})
            print(json.dumps(rows[-1]), flush=True)
    del cache
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["64x32768x128", "64x32768x16", "1x4096x128", "1x4096x16"],
                    help="batch x context x heads")
    ap.add_argument("--block-h", nargs="+", default=["default", "16", "32", "64"])
    ap.add_argument("--configs", nargs="+", default=["default"],
                    help="launch configs by name (the table's: moekv/ops/configs/mla_decode_<device>.json) or default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bandwidth = copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    block_hs = [None if b == "default" else int(b) for b in args.block_h]
    configs = [None if c == "default" else c for c in args.configs]
    rows = []
    for shape in args.shapes:
        batch, context, heads = (int(x) for x in shape.split("x"))
        for fmt in (LatentFormat(torch.bfloat16, RANK), LatentFP8Format(RANK), LatentInt4Format(RANK, 32)):
            rows += case(fmt, batch, context, heads, bandwidth, block_hs, configs)
    best = {}
    for r in rows:
        key = (r["batch"], r["context"], r["heads"], r["format"])
        best[key] = min(best.get(key, float("inf")), r["us"])
    for (b, c, h, name), us in best.items():
        if name in ("fp8_e4m3", "int4"):
                print(f"{b}x{c}x{h}: {name} / bf16 speed-up {best[(b, c, h, 'bf16')] / us:.2f}x (best of each)",
                  flush=True)
    same = ("format", "batch", "context", "heads", "block_h")
    for r in rows:
        if r["config"] == "v1":
            default = [d for d in rows if d["config"] == "default" and all(d[k] == r[k] for k in same)]
            if default:
                us = default[0]["us"]
                print(f"{r['batch']}x{r['context']}x{r['heads']} {r['format']} block_h {r['block_h']}: the table's "
                      f"launch {us} us against v1's {r['us']} us ({r['us'] / us:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                       "command": "benchmarks/kernels/bench_mla_decode.py", "copy_bandwidth_gbs": bandwidth / 1e9,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
