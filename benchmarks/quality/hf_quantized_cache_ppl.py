#!/usr/bin/env python3
"""Perplexity with transformers' own quantized KV cache (QuantizedCache, quanto backend), scored
in the same windows and the same decode mode as `moekv eval ppl`, as a peer for the KV formats.

Each window's context is prefilled into the cache, then the scored tokens are fed one per step
(teacher forcing), so every prediction reads the quantized cache as generation would. Needs
transformers and optimum-quanto (pip install optimum-quanto); not part of moekv's run time.

    python benchmarks/quality/hf_quantized_cache_ppl.py --text FILE --nbits 2 4 --max-tokens 8192
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from moekv.config import default_model_path  # noqa: E402
from moekv.eval.perplexity import nll_from_logits, read_text_tokens, windows  # noqa: E402
from moekv.models.tokenizer import Tokenizer  # noqa: E402


@torch.no_grad()
def window_group_logits(model, cache_factory, chunks: list[list[int]], first_row: int) -> torch.Tensor:
    """chunks of equal length: prefill tokens [0, first_row), then feed one token per step.
    Returns the logits of rows first_row .. len-2 -> [B, n, V] fp32 (row r = after token r)."""
    ids = torch.tensor(chunks)
    cache = cache_factory() if cache_factory else None
    prefill = max(first_row, 1)
    out = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    rows = [out.logits[:, -1].float()] if first_row == 0 else []
    for t in range(prefill, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[:, -1].float())
    return torch.stack(rows, dim=1)


def perplexity_hf(model, cache_factory, ids: list[int], window: int, stride: int, batch: int) -> tuple[float, int]:
    plan = windows(len(ids), window, stride)
    groups = defaultdict(list)  # (first_row, length) -> windows
    for begin, end, first in plan:
        groups[(first - 1 - begin, end - begin)].append((begin, end, first))
    total, count = 0.0, 0
    bar = tqdm(total=len(ids) - 1, desc="hf perplexity", unit="tok")
    for (first_row, _), group in groups.items():
        for i in range(0, len(group), batch):
            part = group[i:i + batch]
            logits = window_group_logits(model, cache_factory, [ids[b:e] for b, e, _ in part], first_row)
            for j, (begin, end, first) in enumerate(part):
                total += float(nll_from_logits(logits[j], torch.tensor(ids[first:end])))
                count += end - first
                bar.update(end - first)
    bar.close()
    return math.exp(total / count), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--text", required=True)
    p.add_argument("--nbits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--q-group-size", type=int, default=32)
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, QuantizedCache

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = read_text_tokens(Tokenizer(args.model), args.text, args.max_tokens)
    results = []
    configs = [("transformers DynamicCache (fp32)", None)] + [
        (f"transformers QuantizedCache quanto int{n} (group {args.q_group_size}, residual {args.residual_length})",
         (lambda n=n: QuantizedCache(backend="quanto", config=model.config, nbits=n, q_group_size=args.q_group_size,
                                     residual_length=args.residual_length)))
        for n in args.nbits]
    for label, factory in configs:
        start = time.perf_counter()
        try:
            ppl, tokens = perplexity_hf(model, factory, ids, args.window, args.stride, args.batch)
        except Exception as e:  # report why a backend does not run with the installed versions
            results.append({"label": label, "error": f"{type(e).__name__}: {e}"})
            print(f"{label}: did not run: {e}", flush=True)
            continue
        results.append({"label": label, "ppl": ppl, "tokens": tokens, "seconds": time.perf_counter() - start,
                        "text": args.text, "window": args.window, "stride": args.stride})
        print(f"{label}: ppl {ppl:.4f} over {tokens} tokens", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
