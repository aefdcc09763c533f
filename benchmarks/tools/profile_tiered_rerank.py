#!/usr/bin/env python3
"""Where tiered's slow steps go, for one sequence of `--context` tokens (Mixtral-8x7B shape, dummy
weights): its prefill (under cProfile, after a short request has compiled the kernels) and the
decode step that re-ranks pages (every `--rerank-interval` steps; replayed from a CUDA graph). The first re-ranking
after the prefill is timed plainly; the next one runs under torch.profiler (device and host
operators) and cProfile (the Python functions), beside an ordinary replayed step.

    PYTHONPATH=. python benchmarks/tools/profile_tiered_rerank.py --out /tmp/tiered
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))

from bench_engine import write_checkpoint_folder  # noqa: E402

from moekv import LLM, SamplingParams  # noqa: E402


def timed_step(engine) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def steps_until_rerank(engine) -> None:
    """Step until the next step re-ranks (every layer counts the same steps)."""
    runner = engine.runner
    while (runner.kv_caches[0].state.steps + 1) % runner.kv_format.rerank_interval:
        engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rerank-interval", type=int, default=32)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    folder = write_checkpoint_folder(Path(tempfile.mkdtemp(prefix="moekv-dummy-")), "mixtral-8x7b")
    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype="tiered",
              max_model_len=args.context + 4 * args.rerank_interval + 64, max_num_seqs=1,
              max_num_batched_tokens=8192, kv_codebook="page", kv_rerank_interval=args.rerank_interval,
              async_scheduling=False)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(3, vocab, (256,), generator=gen).tolist()
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    prompt = torch.randint(3, vocab, (args.context,), generator=gen).tolist()
    engine.add_request(None, {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=4 * args.rerank_interval, temperature=0.0, ignore_eos=True))
    prefill_py = cProfile.Profile()
    prefill_py.enable()
    prefill = timed_step(engine)
    prefill_py.disable()
    lines = [f"prefill of {args.context} tokens: {prefill:.3f} s (under cProfile; kernels compiled before)"]
    steps_until_rerank(engine)
    lines.append(f"first re-ranking step: {1e3 * timed_step(engine):.1f} ms")
    engine.step()
    lines.append(f"an ordinary (replayed) step: {1e3 * timed_step(engine):.2f} ms")
    steps_until_rerank(engine)
    prof_py = cProfile.Profile()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        prof_py.enable()
        seconds = timed_step(engine)
        prof_py.disable()
    plain_seconds = None
    steps_until_rerank(engine)
    plain_seconds = timed_step(engine)
    lines.append(f"second re-ranking step: {1e3 * seconds:.1f} ms profiled; third: {1e3 * plain_seconds:.1f} ms")
    events = prof.key_averages()
    py = io.StringIO()
    pstats.Stats(prof_py, stream=py).sort_stats("cumulative").print_stats(40)
    pre = io.StringIO()
    pstats.Stats(prefill_py, stream=pre).sort_stats("cumulative").print_stats(45)
    text = "\n".join(lines) + ("\n\n-- by device time --\n" + events.table(sort_by="self_cuda_time_total", row_limit=20)
                               + "\n\n-- by host time --\n" + events.table(sort_by="self_cpu_time_total", row_limit=25)
                               + "\n\n-- Python (cProfile, cumulative) --\n" + py.getvalue()
                               + "\n\n-- the prefill step (cProfile, cumulative) --\n" + pre.getvalue())
    (args.out / "tiered_rerank_profile.txt").write_text(text)
    print("\n".join(lines), flush=True)
    print(py.getvalue()[:3000], flush=True)
    print(pre.getvalue()[:6000], flush=True)


if __name__ == "__main__":
    main()
