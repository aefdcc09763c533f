"""Tiered KV's passkey retrieval on models/domain-moe beside bf16, with the bits its decode steps read,
its FP8 share, and which tier held the needle when the answer was decoded (issue 23).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/tiered_retrieval.py --lengths 1024 \
        --out benchmarks/results/cpu/tiered_retrieval_1k.json

Every prompt of `moekv eval retrieval`'s grid (moekv.eval.retrieval.build_cases: same keys, fillers
and depths for every format) goes through the engine, greedy, 8 answer tokens, one engine per
format. tiered runs with kv_rerank_interval=1 by default: every step (prefill chunks included)
re-ranks each sequence's full pages by attention mass, so the first decode step of the answer reads
the tiers that ranking chose (the answer's first token comes from the prefill, whose last chunk reads
the tiers the re-rank after the earlier chunks chose; a one-chunk prompt reads every page in FP8).

Per format and length: accuracy (by depth, and per prompt), and for tiered the decode rows' bits per
element read (full pages in their tier, the staged tail at 16 bits) and FP8 share of the full pages
they read (TieredFormat.decode_* counters). At each prompt's first decode step (its second answer
token) the script records, per layer, the tier of each page the needle's tokens lie in and that
page's rank by mass among the sequence's full pages: whether the FP8 tier held the needle.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moekv import LLM
from moekv.eval.needle import NEEDLE_TEMPLATE, answer_is_correct
from moekv.eval.retrieval import DEFAULT_ANSWER_TOKENS, build_cases
from moekv.kvcache.formats.tiered_policy import TIER_FP8
from moekv.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from domain_model_tables import MODEL, parse_format  # noqa: E402  ('format:kv_option=value' specs)


def needle_pages(fmt, seq, caches, needle_position: int, needle_tokens: int, block_size: int) -> list[dict]:
    """Per layer: for each full page holding needle tokens, its tier and its rank by mass among the
    sequence's full pages (0 = most attention; the mass the step added included)."""
    num_full = seq.num_computed_tokens // block_size
    full = seq.block_table[:num_full]
    last = (needle_position + needle_tokens - 1) // block_size
    idx = [i for i in range(needle_position // block_size, last + 1) if i < num_full]
    out = []
    for cache in caches:
        fmt._fold_mass(cache)  # the kernel's (and the reference path's) pending mass
        st = cache.state
        order = sorted(range(num_full), key=lambda i: -st.mass[full[i]])
        rank = {i: r for r, i in enumerate(order)}
        fp8 = sum(1 for p in full if st.tier[p] == TIER_FP8)
        out.append({"pages": [{"index": i, "fp8": st.tier[full[i]] == TIER_FP8, "rank": rank[i]} for i in idx],
                    "full_pages": num_full, "fp8_pages": fp8})
    return out


def run_format(spec: str, model: Path, filler: Path, length: int, depths, trials: int, seed: int,
               max_num_seqs: int, device: str = "cpu") -> dict:
    name, options = parse_format(spec)
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(model=str(model), device=device, dtype=dtype, kv_cache_dtype=name, max_model_len=length,
              max_num_seqs=max_num_seqs, **options)
    engine = llm.engine
    tok = engine.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    filler_ids = encode(filler.read_text(encoding="utf-8", errors="replace"))
    cases = build_cases(encode, filler_ids, [length], depths, trials, seed, DEFAULT_ANSWER_TOKENS)
    needle_tokens = len(encode(NEEDLE_TEMPLATE.format(key=cases[0].key)))
    fmt = engine.runner.kv_format
    tiered = hasattr(fmt, "decode_bits_read")
    if tiered:
        fmt.reset_read_counters()
        fmt.count_decode_reads = True
    caches = engine.runner.kv_caches if tiered else []
    params = SamplingParams(max_tokens=DEFAULT_ANSWER_TOKENS, temperature=0.0)
    for i, case in enumerate(cases):
        engine.add_request(str(i), {"prompt_token_ids": case.ids}, params, output_kind="final")
    answers: dict[int, str] = {}
    at_first_decode: dict[int, list[dict]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
            if out.finished:
                answers[int(out.request_id)] = out.outputs[0].text
        if tiered:  # after the step that decoded a sequence's second token: the tiers that step read
            for rid, seq in engine._seqs.items():
                i = int(rid)
                if i not in at_first_decode and len(seq.output_token_ids) >= 2:
                    at_first_decode[i] = needle_pages(fmt, seq, caches, cases[i].needle_position, needle_tokens,
                                                      engine.config.cache.block_size)
    seconds = time.perf_counter() - start
    prompts = []
    for i, case in enumerate(cases):
        rec = {"depth": case.depth, "trial": case.trial, "key": case.key, "needle_position": case.needle_position,
               "answer": answers[i], "correct": answer_is_correct(answers[i], case.key)}
        if i in at_first_decode:
            rec["needle_at_first_decode"] = at_first_decode[i]
        prompts.append(rec)
    by_depth = {}
    for r in prompts:
        by_depth.setdefault(str(r["depth"]), []).append(r["correct"])
    result = {"format": spec, "length": length, "prompts_total": len(prompts),
              "correct": sum(r["correct"] for r in prompts),
              "accuracy": sum(r["correct"] for r in prompts) / len(prompts),
              "accuracy_by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()},
              "block_size": engine.config.cache.block_size, "needle_tokens": needle_tokens, "seconds": seconds,
              "threads": torch.get_num_threads()}
    if tiered:
        cfg = engine.model_config
        result |= {"bits_read_decode": fmt.measured_decode_bits_per_element,
                   "fp8_share_decode": fmt.measured_decode_fp8_share,
                   "bits_read_all_reads": fmt.measured_bits_per_element,
                   "bits_stored_full_pages": fmt.bits_per_element(cfg.num_kv_heads, engine.config.cache.block_size,
                                                                  cfg.head_dim),
                   "rerank_interval": fmt.rerank_interval, "tier1_fraction": fmt.tier1_fraction}
        # (prompt, layer) pairs whose needle lies in full pages (not in the staged tail): all of them in FP8?
        flags = [all(p["fp8"] for p in layer["pages"]) for r in prompts if "needle_at_first_decode" in r
                 for layer in r["needle_at_first_decode"] if layer["pages"]]
        result["needle_all_fp8_share"] = sum(flags) / len(flags) if flags else None
    result["prompts"] = prompts
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--formats", nargs="+", default=["bf16", "tiered:kv_rerank_interval=1"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[round(i / 10, 4) for i in range(11)])
    p.add_argument("--trials", type=int, default=10, help="keys per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bf16 weights)")
    p.add_argument("--filler", default=None, help="filler text (default: the model's held-out prose)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = Path(args.model)
    filler = Path(args.filler or model / "heldout" / "prose.txt")
    record = {"what": "tiered vs bf16 passkey retrieval (benchmarks/quality/tiered_retrieval.py)",
              "model": model.name, "device": args.device, "dtype": "float32" if args.device == "cpu" else "bfloat16",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "filler": filler.name,
              "args": {k: v for k, v in vars(args).items() if k not in ("out", "model")}, "runs": []}
    for length in args.lengths:
        for spec in args.formats:
            r = run_format(spec, model, filler, length, args.depths, args.trials, args.seed, args.max_num_seqs,
                           args.device)
            record["runs"].append(r)
            extra = "" if "bits_read_decode" not in r else (
                f"; decode read {r['bits_read_decode']:.3f} bits, FP8 share {r['fp8_share_decode']:.3f}, "
                f"needle all-FP8 in {r['needle_all_fp8_share']:.2f} of (prompt, layer)")
            print(f"{spec} @ {length}: {r['correct']}/{r['prompts_total']}{extra} ({r['seconds']:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
