"""Where the engine's scheduler cuts each passkey prompt into prefill chunks, and which needles a cut
splits, for the ways the benchmarks call the engine (no model runs: the engine's own Scheduler and
BlockManager are stepped on the prompts' lengths, each prompt answering its 8 tokens).

The cut depends on what else is in the batch: a prompt admitted with B tokens of the step's budget
left starts with a chunk of B tokens. `domain_passkeys.py` runs one length per call, so at 4k each
prompt is admitted after the one before it has taken 2040 of 2048 tokens, and its first chunk is the
8-29 tokens left: the needle at depth 0 (tokens 0-29) is split. `domain_model_tables.py` runs every
length in one call, so the 4k prompts come after the 1k and 2k ones and their cuts fall elsewhere.
A split needle's later tokens attended to its earlier ones through the page the step quantized,
before the staged rows were read as staged (docs/decisions.md, "Depth-0 passkeys on the CPU").

    PYTHONPATH=. python benchmarks/quality/passkey_chunk_cuts.py --out benchmarks/results/cpu/passkey_chunk_cuts.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from domain_model_tables import MODEL
from tokenizers import Tokenizer

from moekv.engine.block_manager import BlockManager
from moekv.engine.scheduler import Scheduler
from moekv.engine.sequence import Sequence
from moekv.eval.needle import NEEDLE_TEMPLATE
from moekv.eval.perplexity import read_utf8
from moekv.eval.retrieval import DEFAULT_ANSWER_TOKENS, build_cases
from moekv.sampling_params import SamplingParams

DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
# name -> the generate calls, each (lengths, depths, trials), as the benchmark makes them
PATTERNS = {
    "domain_passkeys": [([n], DEPTHS, 8) for n in (1024, 2048, 4096)],
    "domain_model_tables": [([1024, 2048, 4096], DEPTHS, 8)],
    "domain_passkeys_depth0_40": [([4096], [0.0], 40)],  # docs/quality.md, "Sinks and depth-0 needles (CPU)"
}


def prefill_chunks(prompt_lens: list[int], budget: int, max_num_seqs: int, block_size: int,
                   answer_tokens: int = DEFAULT_ANSWER_TOKENS) -> list[list[tuple[int, int]]]:
    """(first position, tokens) of every prefill chunk of each prompt, the engine's Scheduler deciding."""
    sched = Scheduler(BlockManager(sum(prompt_lens) // block_size + 8 * len(prompt_lens), block_size),
                      max_num_seqs, budget)
    seqs = [Sequence(str(i), [0] * n, SamplingParams(max_tokens=answer_tokens), answer_tokens)
            for i, n in enumerate(prompt_lens)]
    for s in seqs:
        sched.add(s)
    chunks: list[list[tuple[int, int]]] = [[] for _ in seqs]
    while sched.has_unfinished():
        out = sched.schedule()
        for item in out.scheduled:
            if item.seq.num_computed_tokens < item.seq.num_prompt_tokens:
                chunks[int(item.seq.request_id)].append((item.seq.num_computed_tokens, item.num_tokens))
        sched.on_step_done(out)
        for item in out.scheduled:
            s = item.seq
            if s.num_computed_tokens == s.num_tokens:  # the step sampled a token
                s.output_token_ids.append(0)
                if len(s.output_token_ids) == answer_tokens:
                    sched.finish(s, "length")
    return chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))

    def encode(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    filler = encode(read_utf8(MODEL / "heldout" / "prose.txt"))
    record = {"budget": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
              "block_size": args.block_size, "patterns": {}}
    for name, calls in PATTERNS.items():
        split, cells = [], {}
        for lengths, depths, trials in calls:
            cases = build_cases(encode, filler, lengths, depths, trials, seed=0)
            chunks = prefill_chunks([len(c.ids) for c in cases], args.max_num_batched_tokens, args.max_num_seqs,
                                    args.block_size)
            for case, cuts in zip(cases, chunks):
                lo = case.needle_position
                hi = lo + len(encode(NEEDLE_TEMPLATE.format(key=case.key)))
                inside = [first for first, _ in cuts if lo < first < hi]
                cell = cells.setdefault(f"{case.length}:{case.depth}", {"prompts": 0, "needle_split": 0})
                cell["prompts"] += 1
                cell["needle_split"] += bool(inside)
                if inside:
                    split.append({"length": case.length, "depth": case.depth, "trial": case.trial,
                                  "needle": [lo, hi], "cut": inside[0],
                                  "cut_inside_page": inside[0] % args.block_size != 0})
        record["patterns"][name] = {"calls": calls, "cells": cells, "split": split}
        print(name, {k: v["needle_split"] for k, v in cells.items() if v["needle_split"]})
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
