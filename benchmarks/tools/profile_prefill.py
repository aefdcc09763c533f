#!/usr/bin/env python3
"""Where a prefill step's time goes, per KV format: torch.profiler over one engine step that
prefills `--batch` prompts of `--context` tokens (Mixtral-8x7B shape, dummy weights), after a
warm-up step of the same shape. Prints the step's wall time and the top operators by device time
and by host time; writes the tables under --out.

    PYTHONPATH=. python benchmarks/tools/profile_prefill.py --formats bf16 nuq2 --out /tmp/prefill
"""
from __future__ import annotations

import argparse
import gc
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


def prefill_once(engine, batch: int, context: int, vocab: int, seed: int) -> float:
    """Seconds for the step that prefills `batch` new prompts (the budget holds them all)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [engine.add_request(None, {"prompt_token_ids": torch.randint(3, vocab, (context,), generator=gen).tolist()},
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)) for _ in range(batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="*", default=["bf16", "nuq2"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    folder = write_checkpoint_folder(Path(tempfile.mkdtemp(prefix="moekv-dummy-")), "mixtral-8x7b")
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = args.batch * args.context
    for fmt in args.formats:
        llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype=fmt,
                  max_model_len=args.context + 64, max_num_seqs=args.batch, max_num_batched_tokens=tokens,
                  kv_codebook="page" if fmt in ("nuq2", "tiered") else "auto")
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        warm = prefill_once(engine, args.batch, args.context, vocab, seed=0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            seconds = prefill_once(engine, args.batch, args.context, vocab, seed=1)
        plain = prefill_once(engine, args.batch, args.context, vocab, seed=2)
        head = (f"{fmt}: one step prefilling {args.batch} x {args.context} tokens: {plain:.3f} s "
                f"({tokens / plain:.0f} tok/s; warm-up {warm:.3f} s, profiled {seconds:.3f} s)")
        events = prof.key_averages()
        by_device = events.table(sort_by="self_cuda_time_total", row_limit=25)
        by_host = events.table(sort_by="self_cpu_time_total", row_limit=25)
        text = f"{head}\n\n-- by device time --\n{by_device}\n\n-- by host time --\n{by_host}\n"
        (args.out / f"prefill_profile_{fmt}.txt").write_text(text)
        print(head, flush=True)
        print(by_device[:6000], flush=True)
        del llm, engine, prof, events
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
