#!/usr/bin/env python3
"""Expert prediction and expert offload on the tiny model (CPU: recall, cache hits and bytes, no timings).

1. Prediction recall per MoE layer on WikiText-2 test (16k tokens, prefill windows of 512):
   pre-gating and the fitted predictor (benchmarks/results/cpu/tiny-moe.experts.safetensors, made
   by `moekv calibrate-experts` on 64k tokens of the four training books), top-k and top-2k.
2. Offload at batch 1: greedy decoding of 64 tokens from 8 prompts cut from WikiText-2 test (64
   tokens each), with S of 16 experts per MoE layer resident, for S = 4 and 8: prefetch off (every
   miss copied on demand), pre-gating prefetch, fitted prefetch (top-k and top-2k per token). Per
   run: hit rate, misses and host->device bytes per generated token, prefetched experts never used.
   The tokens of every run are checked against the all-resident engine.

    OMP_NUM_THREADS=1 python benchmarks/quality/expert_prediction.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from result_paths import repo_path  # noqa: E402

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.config import default_model_path  # noqa: E402
from moekv.eval.perplexity import read_text_tokens  # noqa: E402
from moekv.tools.experts import evaluate_expert_prediction  # noqa: E402

TEXT = REPO.parent / "shared" / "data" / "text" / "wikitext2_test.txt"
PREDICTOR = REPO / "benchmarks" / "results" / "cpu" / "tiny-moe.experts.safetensors"
OUT = REPO / "benchmarks" / "results" / "cpu" / "expert_prediction_tiny-moe.json"


def offload_runs(prompts, max_tokens: int, slots_list, reference) -> list[dict]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    for slots in slots_list:
        for label, kw in (("on demand (no prefetch)", dict(expert_prefetch=False)),
                          ("pre-gating prefetch, top-k", dict()),
                          ("fitted prefetch, top-k", dict(expert_predictor=PREDICTOR)),
                          ("fitted prefetch, top-2k", dict(expert_predictor=PREDICTOR, expert_prefetch_per_token=4))):
            llm = LLM(model=default_model_path(), dtype="float32", max_model_len=512, max_num_seqs=1,
                      expert_offload=True, expert_cache_slots=slots, **kw)
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            s = llm.engine.runner.experts.stats()
            generated = sum(len(t) for t in tokens)
            rec = {"slots": slots, "run": label, "tokens_match_resident": tokens == reference,
                   "hit_rate": s["hit_rate"], "prediction_recall": s["prediction_recall"],
                   "misses_per_generated_token": s["misses"] / generated,
                   "bytes_per_token": s["bytes_per_token"],
                   "demand_bytes_per_generated_token": s["bytes_demand"] / generated,
                   "prefetch_bytes_per_generated_token": s["bytes_prefetch"] / generated,
                   "prefetch_hits": s["prefetch_hits"], "prefetch_unused": s["prefetch_unused"],
                   "per_layer_hit_rate": {str(i): c["hit_rate"] for i, c in s["layers"].items()},
                   "stats": {k: v for k, v in s.items() if k != "layers"}}
            runs.append(rec)
            r = rec["prediction_recall"]
            print(f"S={slots:>2} {label:<28} hit rate {rec['hit_rate']:.3f}  misses/token "
                  f"{rec['misses_per_generated_token']:.2f}  bytes/token {rec['bytes_per_token']:,.0f}  "
                  f"recall {'-' if r is None else f'{r:.3f}'}  same tokens {rec['tokens_match_resident']}", flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=16384, help="recall: tokens of WikiText-2 test")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generate", type=int, default=64)
    ap.add_argument("--slots", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    llm = LLM(model=default_model_path(), dtype="float32", max_model_len=512, max_num_batched_tokens=4096)
    recall = evaluate_expert_prediction(llm, TEXT, PREDICTOR, max_tokens=args.max_tokens, progress=False)
    print(json.dumps(recall["mean"]))
    ids = read_text_tokens(llm.tokenizer, TEXT, None)
    step = len(ids) // args.prompts
    prompts = [{"prompt_token_ids": ids[i * step:i * step + 64]} for i in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.generate, temperature=0.0, ignore_eos=True)
    ref = LLM(model=default_model_path(), dtype="float32", max_model_len=512, max_num_seqs=1)
    reference = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    runs = offload_runs(prompts, args.generate, args.slots, reference)
    record = {
        "device": f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in [repo_path(sys.argv[0]), *sys.argv[1:]]),
        "predictor": repo_path(PREDICTOR),
        "recall": recall, "offload": {"prompts": args.prompts, "prompt_tokens": 64, "generated_per_prompt":
                                      args.generate, "batch": 1, "runs": runs},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
