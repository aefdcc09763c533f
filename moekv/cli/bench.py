"""`moekv bench serve`: load a running OpenAI-compatible server (moekv's or vLLM's) with random
prompts and report throughput and TTFT / TPOT / ITL / end-to-end latency."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from moekv.server.bench import format_report, run_benchmark

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf: send every request at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be >= 1")
    try:
        import httpx
    except ImportError:
        raise ValueError("moekv bench serve needs httpx: pip install httpx") from None
    try:
        record = asyncio.run(run_benchmark(
            args.url, args.model, args.num_prompts, args.input_len, args.output_len, args.request_rate,
            args.max_concurrency, args.seed, progress=not args.no_progress,
            api_key=args.api_key or os.environ.get("MOEKV_API_KEY") or os.environ.get("OPENAI_API_KEY")))
    except httpx.HTTPError as e:  # server down or answering errors before the run began
        raise ValueError(f"cannot benchmark {args.url}: {type(e).__name__}: {e}") from None
    print(format_report(record), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(record))
    return 0 if record["completed"] == args.num_prompts else 1


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with `bench serve`) on the `moekv` sub-command parsers."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="load generator against a running server (like `vllm bench serve`)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None,
                   help="bearer key of a keyed server (default: $MOEKV_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests sent in all")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.set_defaults(func=cmd_bench_serve)
    return p
