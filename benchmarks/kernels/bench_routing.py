#!/usr/bin/env python3
"""Fused routing kernels (moekv/ops/fused_routing.py, rms_norm_coarse_gate.py) against their
PyTorch references (moekv/ops/reference.py), one CUDA device, one command:

    python benchmarks/kernels/bench_routing.py --out benchmarks/results/h200/routing.json

For T in {1, 16, 128, 1024, 4096} tokens and E in {8, 64, 128, 256} experts (top-k 2 for E = 8,
else 8; hidden 2048 bf16 where a hidden state is read), rows per op:
- flat: softmax top-k with renormalisation from router logits [T, E] (kernel vs topk_softmax_ref);
- group_limited: DeepSeek-V3 routing (sigmoid, selection bias, G = 4 groups keep 2 for E = 8,
  else G = 8 keep 4, scaling 2.5) from logits (kernel vs fused_routing_ref);
- hierarchical: from the normalised hidden state and coarse scores, C = 4 (E = 8) or 8 clusters,
  at most 2 per token, margin 0.5: the kernel computes only the kept clusters' logits (kernel vs
  cluster_routing_ref; also `flat_gemm_ms`: the flat router's own [T, E] GEMM + fused top-k);
- rms_norm_coarse_gate: RMSNorm + C coarse scores from one read of x (kernel vs rms_norm_ref +
  F.linear).
Timings are triton.testing.do_bench medians (ms) after warm-up; speedup = reference / kernel.
Each row also checks the kernel against the reference on the same inputs (share of tokens with
identical expert ids, max weight difference). The brief's target: flat / group-limited /
hierarchical routing under 10 us per layer at T = 128, E = 64 (printed at the end).

--dry-run runs two tiny shapes on the CPU under TRITON_INTERPRET=1 (wall-clock timings, only to
check that the script works end to end).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moekv.ops.fused_routing import fused_cluster_routing, fused_routing  # noqa: E402
from moekv.ops.reference import cluster_routing_ref, fused_routing_ref, rms_norm_ref, topk_softmax_ref  # noqa: E402
from moekv.ops.rms_norm_coarse_gate import rms_norm_coarse_gate  # noqa: E402

TOKENS = (1, 16, 128, 1024, 4096)
EXPERTS = (8, 64, 128, 256)


def timer(dry_run: bool):
    if not dry_run:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def agreement(out, ref) -> dict:
    same = (out[1] == ref[1]).all(1).float().mean().item()
    return {"ids_match": same, "max_weight_diff": (out[0].float() - ref[0].float()).abs().max().item()}


def bench_shape(T: int, E: int, H: int, device, bench) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(T * 1000 + E)
    k = 2 if E == 8 else 8
    rows = []
    logits = torch.randn(T, E, device=device, generator=g, dtype=torch.float32) * 2

    def row(op, kernel, reference, extra=None, check=True):
        kernel_ms, ref_ms = bench(kernel), bench(reference)
        r = {"op": op, "T": T, "E": E, "k": k, "kernel_ms": kernel_ms, "reference_ms": ref_ms,
             "speedup": ref_ms / kernel_ms, "kernel_us": kernel_ms * 1e3}
        if check:
            r.update(agreement(kernel(), reference()))
        r.update(extra or {})
        rows.append(r)
        print(f"{op:<22} T={T:<5} E={E:<4} kernel {kernel_ms * 1e3:8.2f} us  reference {ref_ms * 1e3:9.2f} us  "
              f"x{ref_ms / kernel_ms:6.1f}  ids match {r.get('ids_match', float('nan')):.4f}", flush=True)

    row("flat", lambda: fused_routing(logits, k, True), lambda: topk_softmax_ref(logits, k, True))
    n_group, topk_group = (4, 2) if E == 8 else (8, 4)
    bias = torch.randn(E, device=device, generator=g) * 0.1
    kw = dict(scoring="sigmoid", bias=bias, n_group=n_group, topk_group=topk_group, scaling_factor=2.5)
    row("group_limited", lambda: fused_routing(logits, k, True, **kw),
        lambda: fused_routing_ref(logits, k, True, **kw), {"n_group": n_group, "topk_group": topk_group})

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    C = 4 if E == 8 else 8
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype)
    gate = (torch.randn(E, H, device=device, generator=g) / math.sqrt(H) * 3).to(dtype)
    experts = torch.randperm(E, device=device, generator=g).view(C, E // C)
    gbc = gate[experts].contiguous()
    coarse_w = gbc.float().mean(1).to(dtype)  # [C, H]
    scores = F.linear(hidden, coarse_w).float()
    args = (hidden, scores, gbc, experts, k, True, 2, 0.5)
    flat_gemm_ms = bench(lambda: fused_routing(F.linear(hidden, gate), k, True))
    row("hierarchical", lambda: fused_cluster_routing(*args), lambda: cluster_routing_ref(*args),
        {"C": C, "H": H, "clusters_per_token": 2, "admit_margin": 0.5, "flat_gemm_ms": flat_gemm_ms})

    norm_w = (torch.rand(H, device=device, generator=g) + 0.5).to(dtype)
    x = (torch.randn(T, H, device=device, generator=g) * 3).to(dtype)

    def ref_norm_gate():
        normed = rms_norm_ref(x, norm_w, 1e-6)
        return normed, F.linear(normed, coarse_w).float()

    kernel = lambda: rms_norm_coarse_gate(x, norm_w, 1e-6, coarse_w)  # noqa: E731
    out, ref = kernel(), ref_norm_gate()
    row("rms_norm_coarse_gate", kernel, ref_norm_gate,
        {"C": C, "H": H, "max_normed_diff": (out[0].float() - ref[0].float()).abs().max().item(),
         "max_score_diff": (out[1] - ref[1]).abs().max().item()}, check=False)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size for the ops that read a hidden state")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--experts", type=int, nargs="*", default=list(EXPERTS))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = p.parse_args()
    if args.dry_run:
        device, tokens, experts, hidden = torch.device("cpu"), [1, 4], [8, 64], 64
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_routing.py needs a CUDA device (or --dry-run on the CPU)")
        device, tokens, experts, hidden = torch.device("cuda"), args.tokens, args.experts, args.hidden
    bench = timer(args.dry_run)
    rows = []
    for E in experts:
        for T in tokens:
            rows += bench_shape(T, E, hidden, device, bench)
    target = {r["op"]: r["kernel_us"] for r in rows if r["T"] == 128 and r["E"] == 64}
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1 dry run)",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "timing": "wall clock, one call (dry run)" if args.dry_run else "triton.testing.do_bench median, ms",
        "hidden_size": hidden,
        "target_T128_E64_us": target,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if target:
        print("T=128, E=64 (target < 10 us per layer): " + ", ".join(f"{k} {v:.2f} us" for k, v in target.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
