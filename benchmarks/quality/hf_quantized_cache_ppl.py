#!/usr/bin/env python3
"""transformers' own quantized KV cache (QuantizedCache, quanto and HQQ backends) as a peer for
moekv's KV formats: decode-tail perplexity on a checkpoint's held-out domains and passkey retrieval,
under the protocol of benchmarks/quality/domain_model_tables.py, plus the bits each setting stores.

Decode-tail (the default): per held-out domain, the first --tail-windows non-overlapping windows of
--window tokens; each window's first window - 1 - tail_tokens tokens are prefilled into the cache, and
the rest are fed one per step (teacher forcing), so each of the last --tail-tokens predictions reads
the quantized cache as generation does. Retrieval (--retrieval): moekv.eval.retrieval's prompts
(same lengths, depths, trials, seed and filler as domain_model_tables.py), answered greedily, the
answer tokens after the first read from the quantized cache. Every setting is compared with
transformers' unquantized DynamicCache on the same windows and prompts, in the same dtype.

Both backends group q_group_size consecutive channels of one token under one scale and one zero
(quanto with axis 0, HQQ with axis 1; their other axis groups across the batch), keep the last
tokens in full precision (at most residual_length - 1), and re-quantize the whole cache from its
dequantized copy whenever that window fills. Needs optimum-quanto and hqq (`pip install -e .[peers]`);
not part of moekv's run time.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/hf_quantized_cache_ppl.py --retrieval --out FILE

(`--retrieval --no-ppl` measures retrieval alone, so the two can run as separate processes.)

With --text FILE it scores the windows of `moekv eval ppl --mode decode` on one file instead (the
protocol of the retired tiny-moe rows).
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

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_paths import repo_path, repo_relative  # noqa: E402

from moekv.eval.perplexity import nll_from_logits, read_text_tokens, text_files, windows  # noqa: E402
from moekv.eval.retrieval import build_cases, score_answers  # noqa: E402

MODEL = REPO / "models" / "domain-moe"
# the axis at which each backend groups q_group_size consecutive channels of one token (per-token
# groups, independent of the batch); the other axis's groups run across sequences of the batch
BACKEND_AXIS = {"quanto": 0, "hqq": 1}


def window_tokens_held(residual_length: int) -> int:
    """The most tokens a QuantizedLayer keeps unquantized: it flushes its window into the quantized
    states when the window plus the new tokens reach residual_length."""
    if residual_length < 1:
        raise ValueError(f"residual_length must be >= 1, got {residual_length}")
    return residual_length - 1


def peer_bits_per_element(nbits: int, group_size: int, context_len: int, window_tokens: int,
                          param_bits: int = 16, window_bits: int = 16) -> float:
    """Bits per cached element (K and V alike) of a QuantizedLayer holding context_len tokens, of which
    window_tokens are unquantized (window_bits each) and the rest are nbits codes with one scale and
    one zero (param_bits each) per group of group_size elements."""
    if nbits < 1 or group_size < 1 or context_len < 1:
        raise ValueError(f"need nbits, group_size, context_len >= 1, got {nbits}, {group_size}, {context_len}")
    if not 0 <= window_tokens <= context_len:
        raise ValueError(f"window_tokens={window_tokens} must lie in [0, context_len={context_len}]")
    quantized = nbits + 2 * param_bits / group_size
    return ((context_len - window_tokens) * quantized + window_tokens * window_bits) / context_len


def stored_bits_per_element(layer) -> float:
    """Bits per cached element that a transformers QuantizedLayer (quanto or HQQ) holds right now: its
    packed codes, scales and zeros, and its unquantized window, K and V, over the elements cached."""
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def quantized_bytes(q) -> int:
        if isinstance(q, tuple):  # HQQ: (packed codes, meta with scale and zero)
            codes, meta = q
            return nbytes(codes) + nbytes(meta["scale"]) + nbytes(meta["zero"])
        return nbytes(q._data._data) + nbytes(q._scale) + nbytes(q._shift)  # quanto: packed codes inside

    total = quantized_bytes(layer._quantized_keys) + quantized_bytes(layer._quantized_values)
    window = 0
    if layer.keys.dim() == 4:
        total += nbytes(layer.keys) + nbytes(layer.values)
        window = layer.keys.shape[-2]
    shape = layer._quantized_values[1]["shape"] if isinstance(layer._quantized_values, tuple) \
        else layer._quantized_values.shape
    batch, heads, quantized_tokens, head_dim = shape
    elements = 2 * batch * heads * (quantized_tokens + window) * head_dim
    return 8 * total / elements


def tail_windows(ids_by_domain: dict[str, list[int]], window: int, per_domain: int) -> list[tuple[str, list[int]]]:
    """(domain, ids) of the first `per_domain` non-overlapping `window`-token windows of each domain,
    as domain_model_tables.decode_tail_ppl takes them."""
    out = []
    for name, ids in ids_by_domain.items():
        for i in range(min(per_domain, len(ids) // window)):
            out.append((name, ids[i * window:(i + 1) * window]))
    return out


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


def perplexity_windows(model, cache_factory, ids: list[int], window: int, stride: int, batch: int) -> tuple[float, int]:
    """`moekv eval ppl --mode decode`'s windows of one text (--text)."""
    plan = windows(len(ids), window, stride)
    groups = defaultdict(list)  # (first_row, length) -> windows
    for begin, end, first in plan:
        groups[(first - 1 - begin, end - begin)].append((begin, end, first))
    total, count = 0.0, 0
    for (first_row, _), group in groups.items():
        for i in range(0, len(group), batch):
            part = group[i:i + batch]
            logits = window_group_logits(model, cache_factory, [ids[b:e] for b, e, _ in part], first_row)
            for j, (begin, end, first) in enumerate(part):
                total += float(nll_from_logits(logits[j], torch.tensor(ids[first:end])))
                count += end - first
    return math.exp(total / count), count


@torch.no_grad()
def prefill_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Prefill `ids` [B, T] once with an unquantized cache -> (last row's logits [B, V] float32, each
    layer's (keys, values)). A QuantizedCache's prefill attends to the same exact states and quantizes
    them all on its first update, so every setting can start from these."""
    from transformers import DynamicCache

    out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float(), [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def cache_from_states(model, cache_factory, states):
    """A fresh cache of the setting (None: DynamicCache) holding the prefilled states."""
    from transformers import DynamicCache

    cache = cache_factory() if cache_factory else DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(states):
        cache.update(keys, values, i)
    return cache


@torch.no_grad()
def teacher_forced_rows(model, cache, ids: torch.Tensor, first_row: int) -> torch.Tensor:
    """Feed ids[:, first_row:-1] one token per step into `cache` (holding tokens [0, first_row)) ->
    logits rows first_row .. len-2, [B, n, V] float32."""
    rows = []
    for t in range(first_row, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        rows.append(out.logits[:, -1].float())
    return torch.stack(rows, dim=1)


def decode_tail(model, factories: dict, prompts: list[tuple[str, list[int]]], scored: int, batch: int) -> dict:
    """Perplexity per domain and in total of the last `scored` tokens of each window, each fed by a
    decode step reading the setting's cache. factories: label -> cache factory (None: unquantized).
    -> {label: {domain: {"ppl", "nll", "tokens"}, "total": {...}}}"""
    window = len(prompts[0][1])
    first = window - 1 - scored  # logits row r predicts token r + 1; rows from `first` on come from decode steps
    sums: dict[str, dict[str, list[float]]] = {label: {} for label in factories}
    for i in range(0, len(prompts), batch):
        part = prompts[i:i + batch]
        ids = torch.tensor([p for _, p in part])
        _, states = prefill_states(model, ids[:, :first])
        for label, factory in factories.items():
            logits = teacher_forced_rows(model, cache_from_states(model, factory, states), ids, first)
            for j, (name, p) in enumerate(part):
                agg = sums[label].setdefault(name, [0.0, 0])
                agg[0] += float(nll_from_logits(logits[j], torch.tensor(p[first + 1:window])))
                agg[1] += scored

    def entry(nll: float, count: int) -> dict:
        return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}

    out = {}
    for label, per in sums.items():
        out[label] = {name: entry(*v) for name, v in per.items()}
        out[label]["total"] = entry(sum(v[0] for v in per.values()), sum(v[1] for v in per.values()))
    return out


@torch.no_grad()
def greedy_answers(model, factories: dict, prompts: list[list[int]], answer_tokens: int,
                   eos: int | None) -> dict[str, list[list[int]]]:
    """Greedy continuations of equal-length prompts, answer_tokens each (cut at eos), per setting: the
    first token comes from the exact prefill, the others from decode steps reading the setting's cache."""
    first_logits, states = prefill_states(model, torch.tensor(prompts))
    out = {}
    for label, factory in factories.items():
        cache = cache_from_states(model, factory, states)
        tokens = [first_logits.argmax(-1)]
        for _ in range(answer_tokens - 1):
            logits = model(input_ids=tokens[-1][:, None], past_key_values=cache, use_cache=True).logits
            tokens.append(logits[:, -1].argmax(-1))
        rows = torch.stack(tokens, dim=1).tolist()
        out[label] = [row[:row.index(eos)] if eos is not None and eos in row else row for row in rows]
    return out


def retrieval(model, factories: dict, tokenizer, filler: Path, lengths, depths, trials: int, batch: int,
              answer_tokens: int = 8) -> dict:
    """Passkey accuracy with moekv.eval.retrieval's prompts, answered by the transformers model with
    each setting's cache. -> {label: result}"""
    def encode(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    filler_ids = encode(filler.read_text(encoding="utf-8", errors="replace"))
    cases = build_cases(encode, filler_ids, lengths, depths, trials, seed=0, answer_tokens=answer_tokens)
    by_length = defaultdict(list)
    for i, case in enumerate(cases):
        by_length[len(case.ids)].append(i)
    answers = {label: [""] * len(cases) for label in factories}
    for idx in by_length.values():
        for k in range(0, len(idx), batch):
            part = idx[k:k + batch]
            rows = greedy_answers(model, factories, [cases[i].ids for i in part], answer_tokens, tokenizer.eos_token_id)
            for label, per in rows.items():
                for i, row in zip(part, per):
                    answers[label][i] = tokenizer.decode(row)
    out = {}
    for label in factories:
        cells, per_prompt = score_answers(cases, answers[label])
        by = {str(n): [r["correct"] for r in per_prompt if r["length"] == n] for n in lengths}
        out[label] = {"lengths": list(lengths), "depths": list(depths), "trials": trials, "seed": 0,
                      "answer_tokens": answer_tokens,
                      "accuracy": sum(r["correct"] for r in per_prompt) / len(per_prompt),
                      "accuracy_by_length": {n: sum(v) / len(v) for n, v in by.items()}, "cells": cells,
                      "filler": repo_path(filler)}
    return out


def settings(model, backends: list[str], nbits: list[int], group: int, residual: int):
    """(label, spec, cache factory) for the unquantized cache and each backend x bits."""
    from transformers import QuantizedCache

    out = [("transformers DynamicCache", {"backend": None}, None)]
    for backend in backends:
        if backend not in BACKEND_AXIS:
            raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKEND_AXIS)}")
        axis = BACKEND_AXIS[backend]
        for n in nbits:
            spec = {"backend": backend, "nbits": n, "q_group_size": group, "residual_length": residual,
                    "axis_key": axis, "axis_value": axis}
            out.append((f"transformers QuantizedCache {backend} int{n}", spec,
                        (lambda spec=spec: QuantizedCache(config=model.config, **spec))))
    return out


def bits_record(spec: dict, contexts: list[int]) -> dict:
    """Bits per element at each context length as a 16-bit deployment stores them (16-bit scales,
    zeros and window; the window counted at the most it holds, as moekv counts its staged page)."""
    if spec["backend"] is None:
        return {str(n): 16.0 for n in contexts}
    held = window_tokens_held(spec["residual_length"])
    return {str(n): peer_bits_per_element(spec["nbits"], spec["q_group_size"], n, min(held, n)) for n in contexts}


def measured_bits(cache) -> float | None:
    """What the run's cache held at its end (the run's dtype for scales, zeros and window), layer 0."""
    layers = getattr(cache, "layers", None)
    if not layers or not hasattr(layers[0], "_quantized_keys"):
        return None
    return stored_bits_per_element(layers[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--backends", nargs="+", default=list(BACKEND_AXIS), help=f"of {', '.join(BACKEND_AXIS)}")
    p.add_argument("--nbits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--q-group-size", type=int, default=32)
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--window", type=int, default=4096, help="decode-tail window")
    p.add_argument("--tail-windows", type=int, default=2, help="decode-tail windows per domain")
    p.add_argument("--tail-tokens", type=int, default=256, help="decode-tail scored tokens per window")
    p.add_argument("--batch", type=int, default=4, help="windows or prompts per forward")
    p.add_argument("--retrieval", action="store_true", help="also passkey retrieval")
    p.add_argument("--no-ppl", action="store_true", help="retrieval only (--retrieval): no perplexity")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--filler", type=Path, default=None, help="default: the model's heldout/prose.txt")
    p.add_argument("--bits-at", type=int, nargs="+", default=[4096, 32768], help="context lengths for the bits")
    p.add_argument("--text", default=None, help="score `eval ppl --mode decode` windows of this file instead")
    p.add_argument("--max-tokens", type=int, default=8192, help="--text: tokens read")
    p.add_argument("--text-window", type=int, default=512, help="--text: window")
    p.add_argument("--stride", type=int, default=256, help="--text: stride")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.no_ppl and not args.retrieval:
        p.error("--no-ppl leaves nothing to measure without --retrieval")

    from transformers import AutoModelForCausalLM

    from moekv.models.tokenizer import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = Tokenizer(args.model)
    record = {"model": args.model.name, "dtype": "float32", "device": "cpu",
              "command": "python benchmarks/quality/hf_quantized_cache_ppl.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "model")),
              "protocol": "text windows, decode mode" if args.text else "decode-tail", "settings": []}
    if args.text:
        ids = read_text_tokens(tokenizer, args.text, args.max_tokens)
    else:
        domains = text_files(args.model / "heldout")
        prompts = tail_windows({name: tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"),
                                                       add_special_tokens=False) for name, path in domains.items()},
                               args.window, args.tail_windows)
    runs = settings(model, args.backends, args.nbits, args.q_group_size, args.residual_length)
    entries = {label: {"label": label, **spec, "bits_per_element_at": bits_record(spec, args.bits_at)}
               for label, spec, _ in runs}
    factories = {}
    for label, _, factory in runs:  # a backend that does not run with the installed versions says why
        try:
            if factory is not None and not args.no_ppl:  # what a cache of one window holds, in float32
                cache = factory()
                model(input_ids=torch.tensor([ids[:args.window] if args.text else prompts[0][1]]),
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
                entries[label]["bits_per_element_held_float32"] = measured_bits(cache)
            factories[label] = factory
        except Exception as e:
            entries[label]["error"] = f"{type(e).__name__}: {e}"
            print(f"{label}: does not run: {e}", flush=True)
    record["settings"] = list(entries.values())

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(repo_relative(record), indent=1))

    if not args.no_ppl:
        start = time.perf_counter()
        if args.text:
            for label, factory in factories.items():
                ppl, tokens = perplexity_windows(model, factory, ids, args.text_window, args.stride, args.batch)
                entries[label]["ppl"] = {"total": {"ppl": ppl, "tokens": tokens}}
                entries[label]["text"] = repo_path(args.text)
        else:
            for label, result in decode_tail(model, factories, prompts, args.tail_tokens, args.batch).items():
                entries[label]["ppl"] = result
        record["seconds_ppl"] = time.perf_counter() - start
        for label in factories:
            print(f"{label}: ppl " + ", ".join(f"{k} {v['ppl']:.3f}" for k, v in entries[label]["ppl"].items())
                  + f"; bits {entries[label]['bits_per_element_at']}", flush=True)
        save()
    if args.retrieval:
        start = time.perf_counter()
        filler = args.filler or args.model / "heldout" / "prose.txt"
        for label, result in retrieval(model, factories, tokenizer, filler, args.lengths, args.depths,
                                       args.trials, args.batch).items():
            entries[label]["retrieval"] = result
            print(f"{label}: retrieval {result['accuracy_by_length']}", flush=True)
        record["seconds_retrieval"] = time.perf_counter() - start
        save()


if __name__ == "__main__":
    main()
