#!/usr/bin/env python3
"""Time to first token with and without prefix caching: a shared system prompt + short user turns.

Every request is the same system prompt (`--system-tokens` random token ids) followed by its own
user turn (`--user-tokens`), greedy, `--output-len` tokens. The first request finds nothing cached
(`cold`); the next `--requests - 1` arrive one after another, each once the one before has finished
(`warm`: with prefix caching on, the system prompt's full pages are already in the cache). TTFT is
the request's first token time minus its arrival time (RequestMetrics), measured through
`LLMEngine.step()`, so it counts scheduling, the prefill and the first sample. Both modes run the
same requests on engines built the same way, after a warm-up request whose prompt shares nothing
with them. Each mode runs `--repeats` times on a fresh engine; the file keeps every run and the
median of the warm TTFTs of each.

    PYTHONPATH=. python benchmarks/e2e/bench_prefix_ttft.py --system-tokens 2048 --repeats 3 \\
        --out benchmarks/results/cpu/prefix_ttft_domain-moe.json            # CPU, the shipped model
    PYTHONPATH=. python benchmarks/e2e/bench_prefix_ttft.py --device cuda --shape mixtral-8x7b \\
        --system-tokens 2048 --out benchmarks/results/h200/prefix_ttft.json  # random weights of the shape

`--shape` writes a checkpoint folder of that shape (config.json and a word-level tokenizer, as
bench_engine.py) and loads random weights (load_format="dummy").
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.config import default_model_path  # noqa: E402


def run_mode(engine_kwargs: dict, enable: bool, system: list[int], turns: list[list[int]], warmup: list[int],
             output_len: int) -> dict:
    llm = LLM(enable_prefix_caching=enable, **engine_kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": warmup}, params)  # first-call costs, outside the timed requests
    ttfts, hits = [], []
    for i, turn in enumerate(turns):
        before = engine.stats().prefix_cache_hits
        engine.add_request(f"r{i}", {"prompt_token_ids": system + turn}, params, output_kind="final")
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    first = out
        m = first.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        hits.append(engine.stats().prefix_cache_hits - before)
    return {"enable_prefix_caching": enable, "cold_ttft_s": ttfts[0], "warm_ttft_s": ttfts[1:],
            "warm_ttft_median_s": statistics.median(ttfts[1:]), "cached_tokens": hits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--shape", default=None, help="random weights of this shape (bench_decode.py's SHAPES)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON result file (default: print only)")
    args = p.parse_args()
    if args.requests < 2:
        p.error("--requests must be >= 2 (one cold request, then warm ones)")

    model, extra = args.model, {}
    if args.shape is not None:
        sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
        from bench_engine import write_checkpoint_folder

        model = str(write_checkpoint_folder(Path(tempfile.mkdtemp()) / args.shape, args.shape))
        extra["load_format"] = "dummy"
    max_len = args.system_tokens + args.user_tokens + args.output_len
    engine_kwargs = dict(model=model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         block_size=args.block_size, max_model_len=max_len + 1, max_num_seqs=4, **extra)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 (ids 0-2: special tokens)
    system = draw(args.system_tokens)
    turns = [draw(args.user_tokens) for _ in range(args.requests)]
    warmup = draw(args.system_tokens + args.user_tokens)

    runs = []
    for _ in range(args.repeats):
        for enable in (False, True):
            row = run_mode(engine_kwargs, enable, system, turns, warmup, args.output_len)
            runs.append(row)
            print(f"prefix_caching={'on ' if enable else 'off'} cold {row['cold_ttft_s'] * 1e3:8.1f} ms   "
                  f"warm median {row['warm_ttft_median_s'] * 1e3:8.1f} ms   cached tokens {row['cached_tokens']}",
                  flush=True)
    summary = {}
    for enable in (False, True):
        rows = [r for r in runs if r["enable_prefix_caching"] == enable]
        summary["on" if enable else "off"] = {
            "cold_ttft_ms": 1e3 * statistics.median(r["cold_ttft_s"] for r in rows),
            "warm_ttft_ms": 1e3 * statistics.median(r["warm_ttft_median_s"] for r in rows)}
    summary["warm_speedup"] = summary["off"]["warm_ttft_ms"] / summary["on"]["warm_ttft_ms"]
    print(json.dumps(summary, indent=1))
    if args.out:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
        result = {"device": device, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                  "command": "python " + " ".join(sys.argv), "threads": torch.get_num_threads(),
                  "engine": {k: str(v) for k, v in engine_kwargs.items()},
                  "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
                  "output_len": args.output_len, "requests": args.requests, "summary": summary, "runs": runs}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"[{time.perf_counter() - started:.0f} s]", file=sys.stderr)
