#!/usr/bin/env python3
"""Where tiered's time goes at batch > 1 (Mixtral-8x7B shape, dummy weights): the whole prefill of
`--batch` prompts of about `--context` tokens (chunked, mixed with the first decodes), then
`--steps` decode steps, about a quarter of which fill a page at batch 16 and run eagerly. Each
phase runs under cProfile; its wall time, the times of the slowest steps and the top functions
(cumulative) are written to --out as soon as the phase ends, so a run cut short keeps them.

    PYTHONPATH=. python benchmarks/tools/profile_tiered_batch.py --batch 16 --out /tmp/tiered_batch
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

from bench_engine import compile_kernels, prompt_lengths, write_checkpoint_folder  # noqa: E402

from moekv import LLM, SamplingParams  # noqa: E402


def profiled(fn, lines: list[str], title: str, out: Path, top: int = 45) -> None:
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    lines.append(f"{title}: {time.perf_counter() - start:.3f} s (under cProfile)")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    lines.append(text.getvalue())
    out.write_text("\n".join(lines))
    print(lines[-2], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    folder = write_checkpoint_folder(Path(tempfile.mkdtemp(prefix="moekv-dummy-")), "mixtral-8x7b")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"tiered_batch{args.batch}_profile.txt"
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype="tiered",
              max_model_len=args.context + args.steps + 512, max_num_seqs=args.batch, max_num_batched_tokens=8192,
              kv_codebook="page", async_scheduling=False)
    engine = llm.engine
    block_size = engine.runner.block_size
    cfg = {"vocab_size": engine.model_config.vocab_size}
    compile_kernels(llm, cfg, block_size)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 512, temperature=0.0, ignore_eos=True)
    for n in prompt_lengths(args.batch, args.context, block_size):
        prompt = torch.randint(3, cfg["vocab_size"], (n,), generator=gen).tolist()
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    lines = [f"tiered, batch {args.batch}, prompts of about {args.context} tokens, pages of {block_size}"]

    def prefill():
        while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
            engine.step()

    profiled(prefill, lines, "prefill (every step until all prompts are in)", out)
    step_ms = []

    def decode():
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            step_ms.append(1e3 * (time.perf_counter() - start))

    profiled(decode, lines, f"{args.steps} decode steps", out)
    lines.append("decode steps, ms: " + " ".join(f"{ms:.1f}" for ms in step_ms))
    out.write_text("\n".join(lines))
    print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
