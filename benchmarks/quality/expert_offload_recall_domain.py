#!/usr/bin/env python3
"""Expert offload on models/domain-moe (CPU, float32): the engine's own prediction recall and hit
rate while decoding, per predictor file. One prompt per domain (the first 256 tokens of its held-out
text), 256 greedy tokens each, one sequence at a time, 8 of 16 experts per layer resident; every
run's tokens are checked against the all-resident engine's. Decode-only recall: the counts of a run
that stops after the prompt (max_tokens 1: the prefill only) subtracted from the full run's.

    OMP_NUM_THREADS=1 python benchmarks/quality/expert_offload_recall_domain.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from moekv import LLM, SamplingParams  # noqa: E402

MODEL = REPO / "models" / "domain-moe"
RESULTS = REPO / "benchmarks" / "results" / "cpu"
PREDICTORS = {"pre-gating": None, "linear": RESULTS / "domain-moe.experts.safetensors",
              "mlp + previous token": RESULTS / "domain-moe.experts-mlp-prev.safetensors"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS / "expert_offload_recall_domain-moe.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    kw = dict(model=str(MODEL), dtype="float32", device="cpu", max_model_len=1024)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    resident = LLM(**kw)
    prompts = {}
    for d in ("prose", "drama", "code", "math"):
        ids = resident.tokenizer.encode((MODEL / "heldout" / f"{d}.txt").read_text(encoding="utf-8"),
                                        add_special_tokens=False)
        prompts[d] = ids[:args.prompt_tokens]
    want = {d: resident.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids for d, ids in prompts.items()}
    record = {"command": " ".join(["python"] + sys.argv), "slots": args.slots, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "runs": {}}
    def counts(llm, ids, max_tokens):
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True))[0].outputs[0].token_ids
        caches = llm.engine.runner.experts.caches
        return out, {i: (int(c.recall_hits), int(c.recall_pairs), c.hits, c.misses) for i, c in caches.items()}

    for name, path in PREDICTORS.items():
        for d, ids in prompts.items():
            opts = dict(kw, expert_offload=True, expert_cache_slots=args.slots,
                        **({} if path is None else {"expert_predictor": str(path)}))
            _, pre = counts(LLM(**opts), ids, 1)
            got, full = counts(LLM(**opts), ids, args.max_tokens)
            assert got == want[d], (name, d)
            dec = {i: tuple(a - b for a, b in zip(full[i], pre[i])) for i in full}
            row = {"decode_recall": {str(i): h / n for i, (h, n, _, _) in dec.items()},
                   "decode_hit_rate": {str(i): hh / (hh + m) for i, (_, _, hh, m) in dec.items()},
                   "prefill_recall": {str(i): h / n for i, (h, n, _, _) in pre.items()}}
            record["runs"].setdefault(name, {})[d] = row
            print(f"{name:>22} {d:>6} decode recall " + " ".join(f"{v:.3f}" for v in row["decode_recall"].values())
                  + "  hit rate " + " ".join(f"{v:.3f}" for v in row["decode_hit_rate"].values())
                  + "  prefill recall " + " ".join(f"{v:.3f}" for v in row["prefill_recall"].values()), flush=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
