"""Passkey retrieval only, as benchmarks/quality/domain_model_tables.py measures it (the same engine
arguments, the model's held-out prose as filler, seed 0), one length at a time with the result written
after each, so a slow device (the CPU: 1.5 to 8 minutes a length and format on one core) shows progress
and a cut run keeps what it finished. The keys and filler offsets are drawn per length, so the prompts
are those of one call over every length.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/domain_passkeys.py --device cpu \
        --formats nuq2:kv_codebook=page nuq2:kv_codebook=page:kv_outlier_sigma=3.0 bf16 --out FILE
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from domain_model_tables import MODEL, parse_format
from result_paths import repo_path, repo_relative

from moekv import LLM
from moekv.eval.retrieval import evaluate_retrieval


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--device", default="cuda")
    p.add_argument("--formats", nargs="+", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=8, help="keys per (length, depth) cell")
    p.add_argument("--wrong-answers", action="store_true",
                   help="keep the prompts answered wrongly (key, needle position, answer) in the result")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    model = Path(args.model)
    heldout = model / "heldout" if (model / "heldout").is_dir() else MODEL / "heldout"
    filler = heldout / "prose.txt"
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"  # as domain_model_tables.py
    record = {"model": model.name, "device": args.device, "dtype": dtype, "filler": repo_path(filler),
              "lengths": args.lengths, "depths": args.depths, "trials": args.trials, "seed": 0, "formats": {}}
    for fmt in args.formats:
        name, options = parse_format(fmt)
        llm = LLM(model=str(model), device=args.device, dtype=dtype, kv_cache_dtype=name,
                  max_model_len=max(args.lengths), max_num_seqs=64, **options)
        by_length = record["formats"][fmt] = {}
        for length in args.lengths:
            start = time.perf_counter()
            result = evaluate_retrieval(llm, filler, lengths=[length], depths=args.depths, trials=args.trials,
                                        seed=0, progress=False).to_dict()
            by_length[str(length)] = {k: v for k, v in result.items() if k != "answers"} | {
                "seconds": time.perf_counter() - start}
            if args.wrong_answers:
                by_length[str(length)]["wrong_answers"] = [a for a in result["answers"] if not a["correct"]]
            print(f"{fmt} {length}: {result['accuracy']} ({time.perf_counter() - start:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(repo_relative(record), indent=1))
        del llm


if __name__ == "__main__":
    main()
