#!/usr/bin/env python3
"""Where one decode step's time goes: the kernels of a bench_decode step (random-weight model of a
shape, one KV format, one (batch, context) point) under torch.profiler, eager and replayed from a
CUDA graph, as a table of kernel name, launches per step and GPU time per step.

    PYTHONPATH=. python benchmarks/tools/profile_decode_step.py --shape mixtral-8x7b --format bf16 --batch 1 \
        --context 4096
    PYTHONPATH=. python benchmarks/tools/profile_decode_step.py --format nuq2 tiered
        # several formats, one model build
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import bench_decode as bd  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(bd.SHAPES))
    p.add_argument("--format", nargs="+", default=["bf16"], help="one or more KV formats (one model build)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per page (default: the engine's for the format)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    model, cfg = bd.build_random_model(args.shape, device)
    for name in args.format:
        profile_format(model, cfg, name, args, device)


def profile_format(model, cfg, name: str, args, device) -> None:
    """One format's caches installed in the model, its step profiled eagerly and from a CUDA graph."""
    fmt = bd.get_kv_format(name, torch.bfloat16)
    block_size = args.block_size or bd.page_size(name)
    ctx = bd.install_filled_caches(model, cfg, fmt, args.batch, args.context, block_size, device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device=device)

    def step():
        return model.compute_logits(model(ids, ctx))

    with torch.no_grad():
        graph = bd.capture_graph(step)
        for label, fn in (("eager", step), ("graph", graph.replay)):
            print_kernel_table(fn, f"{label} ({name}, batch {args.batch}, context {args.context})", args.steps,
                               args.top)


def print_kernel_table(fn, title: str, steps: int = 5, top: int = 25) -> None:
    """fn (one decode step) run `steps` times under torch.profiler after 3 warm-up runs: its CUDA kernels by
    name with launches a step, GPU time a step and a launch, the costliest first. Called under no_grad."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernel = ev.name[:90]
            per_kernel[kernel][0] += 1
            per_kernel[kernel][1] += (ev.device_time_total if hasattr(ev, "device_time_total")
                                      else ev.cuda_time_total)
    total_us = sum(v[1] for v in per_kernel.values()) / steps
    launches = sum(v[0] for v in per_kernel.values()) / steps
    print(f"\n== {title}: {launches:.0f} kernels per step, {total_us / 1e3:.3f} ms of kernel time per step")
    print(f"{'per step':>9} {'us/step':>10} {'us/launch':>10}  kernel")
    for kernel, (n, us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{n / steps:9.0f} {us / steps:10.1f} {us / n:10.2f}  {kernel}")

if __name__ == "__main__":
    main()
