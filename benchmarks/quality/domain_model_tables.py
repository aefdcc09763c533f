"""Every KV format on the shipped 4k model (models/domain-moe): passkey retrieval by context length and
depth, and held-out perplexity per domain, with the bits per element each format stores and reads.

    PYTHONPATH=. python benchmarks/quality/domain_model_tables.py --device cuda --out RESULT.json

One engine per format; results are written after each format, so a cut run keeps what it finished.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from moekv import LLM
from moekv.eval.perplexity import perplexity_domains, text_files
from moekv.eval.retrieval import evaluate_retrieval

MODEL = Path(__file__).resolve().parents[2] / "models" / "domain-moe"
FORMATS = ("bf16", "fp8_e4m3", "int4", "kivi2", "nuq2", "vq", "tiered")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--device", default="cuda")
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=8, help="keys per (length, depth) cell")
    p.add_argument("--filler", default=None, help="filler text (default: the model's held-out prose)")
    p.add_argument("--ppl-max-tokens", type=int, default=32768, help="scored tokens per domain")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    model = Path(args.model)
    filler = args.filler or model / "heldout" / "prose.txt"
    domains = text_files(model / "heldout")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    record = {"model": str(model.name), "device": args.device, "dtype": dtype, "filler": str(filler),
              "command": "python benchmarks/quality/domain_model_tables.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "model")),
              "formats": {}}
    for fmt in args.formats:
        start = time.perf_counter()
        llm = LLM(model=str(model), device=args.device, dtype=dtype, kv_cache_dtype=fmt,
                  max_model_len=max(args.lengths), max_num_seqs=64)
        retrieval = evaluate_retrieval(llm, filler, lengths=args.lengths, depths=args.depths, trials=args.trials,
                                       seed=0, progress=False).to_dict()
        per_domain, total = perplexity_domains(llm, domains, max_tokens=args.ppl_max_tokens, mode="prefill",
                                               progress=False)
        record["formats"][fmt] = {
            "retrieval": {k: retrieval[k] for k in retrieval if k != "answers"},
            "ppl": {name: r.to_dict() for name, r in per_domain.items()} | {"total": total.to_dict()},
            "seconds": time.perf_counter() - start,
        }
        acc = retrieval.get("accuracy")
        print(f"{fmt}: retrieval {acc} by length {retrieval.get('accuracy_by_length')}; ppl "
              + ", ".join(f"{n} {r.ppl:.3f}" for n, r in per_domain.items())
              + f"; {total.bits_per_element:.2f} bits ({time.perf_counter() - start:.0f} s)", flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
        del llm


if __name__ == "__main__":
    main()
