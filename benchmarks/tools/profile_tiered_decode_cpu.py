#!/usr/bin/env python3
"""Where a decode step's time goes on the CPU, per KV format: `--seqs` prompts of `--context` tokens
of models/domain-moe's held-out prose are prefilled (not timed), then `--steps` decode-only steps run
under cProfile; also counted per step: aten ops (torch.profiler, the launches a GPU step would pay)
and host reads of tensors (`.tolist()` / `.item()`: syncs on a GPU). Writes a JSON with the wall time
per step and the top functions.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/tools/profile_tiered_decode_cpu.py --seqs 4 \
        --context 4000 --formats tiered nuq2 fp8_e4m3 --out /tmp/profile.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from moekv import LLM, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "domain-moe"


def parse_format(spec: str) -> tuple[str, dict]:
    name, *opts = spec.split(":")
    return name, {k: int(v) if v.isdigit() else v for k, _, v in (o.partition("=") for o in opts)}


class HostReads:
    """Counts Tensor.tolist / Tensor.item calls while installed (a device-to-host copy each on a GPU)."""

    def __enter__(self):
        self.count = 0
        self.saved = torch.Tensor.tolist, torch.Tensor.item
        tolist, item = self.saved

        def counted(fn):
            def wrapper(t, *a, **k):
                self.count += 1
                return fn(t, *a, **k)
            return wrapper

        torch.Tensor.tolist, torch.Tensor.item = counted(tolist), counted(item)
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item = self.saved


def profile_format(spec: str, model: Path, seqs: int, context: int, steps: int, top: int) -> dict:
    name, options = parse_format(spec)
    llm = LLM(model=str(model), device="cpu", dtype="float32", kv_cache_dtype=name, max_model_len=context + steps + 8,
              max_num_seqs=max(seqs, 8), **options)
    engine = llm.engine
    ids = engine.tokenizer.encode((model / "heldout" / "prose.txt").read_text(), add_special_tokens=False)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        prompt = {"prompt_token_ids": ids[i * context:(i + 1) * context]}
        engine.add_request(str(i), prompt, params, output_kind="final")
    t0 = time.perf_counter()
    while any(not s.output_token_ids for s in engine._seqs.values()):
        engine.step()
    engine.step()  # every sequence decodes from here on
    prefill_s = time.perf_counter() - t0
    per_step = []
    prof = cProfile.Profile()
    with HostReads() as reads:
        for _ in range(steps):
            t = time.perf_counter()
            prof.enable()
            engine.step()
            prof.disable()
            per_step.append(time.perf_counter() - t)
    host_reads = reads.count
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        engine.step()
    ops = sum(1 for e in tp.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    while engine.has_unfinished_requests():
        engine.step()
    return {"format": spec, "seqs": seqs, "context": context, "steps": steps, "prefill_s": prefill_s,
            "ms_per_step": 1000 * sum(per_step) / steps, "ms_per_step_max": 1000 * max(per_step),
            "host_reads_per_step": host_reads / steps, "top_level_aten_ops_per_step": ops,
            "threads": torch.get_num_threads(), "profile": out.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--formats", nargs="+", default=["tiered", "nuq2", "fp8_e4m3"])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--steps", type=int, default=33, help="decode steps profiled (33: one re-rank at interval 32)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    record = {"what": "decode-step profile on the CPU (benchmarks/tools/profile_tiered_decode_cpu.py)",
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "runs": []}
    for spec in args.formats:
        r = profile_format(spec, Path(args.model), args.seqs, args.context, args.steps, args.top)
        record["runs"].append(r)
        print(f"{spec}: {r['ms_per_step']:.1f} ms/step (max {r['ms_per_step_max']:.1f}), "
              f"{r['host_reads_per_step']:.1f} host reads and {r['top_level_aten_ops_per_step']} aten ops a step",
              flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
