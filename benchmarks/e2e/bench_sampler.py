"""The host time of the sampler (layers/sampler.sample_async) for one decode step's [B, V] logits.

For each sampling setting, every row of the batch uses it (seeded rows: seed = row index): the time
from the call until sample_async returns (what the host spends queuing the step's sampling; on the CPU
this includes the work itself), and until the tokens are on the host (PendingSample.results after a
device sync), medians over the steps after a warm-up. Each step's rows sample the next position of
their sequence, as a decode step's would.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/e2e/bench_sampler.py --batch 64 --device cpu
    PYTHONPATH=. python benchmarks/e2e/bench_sampler.py --batch 1 64 --vocab 4096 151936 --device cuda
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moekv.layers.sampler import SamplingRow, sample_async
from moekv.sampling_params import SamplingParams

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "temperature_seeded": dict(temperature=1.0, seed=0),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "repetition_penalty": dict(temperature=1.0, repetition_penalty=1.1),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(setting: str, batch: int, vocab: int, steps: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device)
    kwargs = dict(SETTINGS[setting])
    prompt = list(range(32))
    rows = []
    for i in range(batch):
        params = SamplingParams(**{**kwargs, "seed": i} if "seed" in kwargs else kwargs)
        rows.append(SamplingRow(params, seed=i, position=len(prompt), prompt_ids=prompt, output_ids=[],
                                blocked_ids=[]))
    queue_ms, total_ms = [], []
    for step in range(steps + 3):
        _sync(device)
        t0 = time.perf_counter()
        pending = sample_async(logits, rows)
        t1 = time.perf_counter()
        _sync(device)
        results = pending.results()
        t2 = time.perf_counter()
        for row, r in zip(rows, results):
            row.output_ids.append(r.token_id)
            row.position += 1
        if step >= 3:  # warm-up
            queue_ms.append((t1 - t0) * 1e3)
            total_ms.append((t2 - t0) * 1e3)
    return {"setting": setting, "batch": batch, "vocab": vocab, "device": str(device), "steps": steps,
            "queue_ms": statistics.median(queue_ms), "total_ms": statistics.median(total_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    with torch.inference_mode():
        for vocab in args.vocab:
            for batch in args.batch:
                for setting in args.settings:
                    r = bench(setting, batch, vocab, args.steps, torch.device(args.device))
                    results.append(r)
                    print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
