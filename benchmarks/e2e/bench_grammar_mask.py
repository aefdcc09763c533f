"""The per-step cost of structured outputs' token mask, and what it does to the engine's decode step.

Part 1 (--mask): B sequences, each with its own grammar matcher at a different point of a JSON schema,
time per step of (a) filling the B bitmask rows on the host and (b) applying them to [B, V] logits on
the device (moekv's apply_bitmask_: copy the packed words, unpack, masked_fill), for xgrammar and,
when installed, llguidance. Matchers advance by a random allowed token between steps (not timed).

Part 2 (--engine): the engine's decode step time (TPOT) at batch B, unconstrained against every
request under a regex constraint, in the engine's default scheduling mode (async on CUDA); with the
regex, the host's time a step in each of the grammar's calls, and the TPOT with xgrammar's batch fill
on one thread instead of its pool.

    PYTHONPATH=. python benchmarks/e2e/bench_grammar_mask.py --mask --batch 1 64 --out mask.json
    PYTHONPATH=. python benchmarks/e2e/bench_grammar_mask.py --engine --batch 64 --device cuda
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

from moekv.config import default_model_path
from moekv.engine.structured_output import GrammarState
from moekv.layers.sampler import PinnedBitmasks, apply_bitmask_
from moekv.models.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "pet", "tags", "address"],
    "additionalProperties": False,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_vocab(tokenizer: Tokenizer, size: int) -> list[str]:
    """A vocabulary of `size` tokens for timing the fill at a real model's vocabulary size: domain-moe's
    4,096 token texts, then distinct concatenations of random pairs of them (seeded), as BPE merges
    would add."""
    base = [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)]
    vocab, seen, rng = list(base), set(base), random.Random(0)
    while len(vocab) < size:
        text = rng.choice(base) + rng.choice(base)
        if text not in seen:
            seen.add(text)
            vocab.append(text)
    return vocab


class XGrammarRows:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos: int, batch: int) -> None:
        import xgrammar as xgr

        if vocab > tokenizer.vocab_size:  # a real model's vocabulary size: the synthetic vocabulary
            info = xgr.TokenizerInfo(synthetic_vocab(tokenizer, vocab), xgr.VocabType.RAW, vocab_size=vocab,
                                     stop_token_ids=[eos])
        else:
            from transformers import PreTrainedTokenizerFast

            info = xgr.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizers_object), vocab_size=vocab,
                stop_token_ids=[eos])
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA),
                                                                                 any_whitespace=False)
        self.compiled, self.xgr, self.batch = compiled, xgr, batch
        self.matchers = [self.new_matcher() for _ in range(batch)]

    def new_matcher(self):
        return GrammarState(self.compiled)

    def fill(self, bitmask: torch.Tensor) -> None:  # as the engine fills: GrammarState.fill_rows
        GrammarState.fill_rows(self.matchers, bitmask, list(range(self.batch)))

    def accept(self, i: int, token: int) -> bool:
        state = self.matchers[i]
        return state.accept_at(state.num_accepted, token) and not state.is_terminated


class LLGuidanceRows:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos: int, batch: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizers_object, eos_token=tokenizer.eos_token)
        self.ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                      defaults={"whitespace_flexible": False})
        self.llg, self.batch = llguidance, batch
        self.matchers = [self.new_matcher() for _ in range(batch)]

    def new_matcher(self):
        return self.llg.LLMatcher(self.ll_tok, self.grammar)

    def fill(self, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(self.matchers):
            self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, i: int, token: int) -> bool:
        m = self.matchers[i]
        return m.consume_token(token) and not m.is_stopped()


def bench_mask(engine_cls, batch: int, steps: int, device: torch.device, tokenizer: Tokenizer, vocab: int,
               eos: int) -> dict:
    rows = engine_cls(tokenizer, vocab, eos, batch)
    rng = random.Random(0)
    logits = torch.randn(batch, vocab, device=device)
    words = (vocab + 31) // 32
    pinned = PinnedBitmasks() if device.type == "cuda" else None  # as the engine's steps take theirs
    fill_ms, apply_ms = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        bitmask = pinned.take(batch, words) if pinned else torch.full((batch, words), -1, dtype=torch.int32)
        rows.fill(bitmask)
        t1 = time.perf_counter()
        masked = apply_bitmask_(logits.clone(), bitmask)
        _sync(device)
        t2 = time.perf_counter()
        if step >= 3:  # warm-up
            fill_ms.append((t1 - t0) * 1e3)
            apply_ms.append((t2 - t1) * 1e3)
        allowed = torch.isfinite(masked).cpu()
        for i in range(batch):  # advance each row by a random allowed token; restart a finished one
            ids = allowed[i].nonzero().flatten().tolist()
            if not ids or not rows.accept(i, rng.choice(ids)):
                rows.matchers[i] = rows.new_matcher()
    fill, apply = statistics.median(fill_ms), statistics.median(apply_ms)
    return {"engine": rows.name, "batch": batch, "vocab": vocab, "device": str(device), "steps": len(fill_ms),
            "fill_ms": fill, "apply_ms": apply, "total_ms": fill + apply, "per_row_us": 1e3 * (fill + apply) / batch}


class HostTimers:
    """Seconds the host spends in the grammar's calls of a step, by part (the functions wrapped in place
    while the engine runs, restored after): model_runner.follow_grammars (the follow-on step's accepts,
    and its wait for the previous step's tokens), the bitmask's fill (GrammarState.fill_rows), its copy and
    masking (sampler.apply_bitmask_, queued on a GPU) and every GrammarState.accept_at (the follow-on's
    included)."""

    def __init__(self) -> None:
        from moekv.engine import model_runner, structured_output
        from moekv.layers import sampler

        self.seconds: dict[str, float] = {}
        self._restore = []
        for name, owner, attr in (("follow_on_accept", model_runner, "follow_grammars"),
                                  ("masking", sampler, "apply_bitmask_"),
                                  ("fill", structured_output.GrammarState, "fill_rows"),
                                  ("accept_at", structured_output.GrammarState, "accept_at")):
            raw = owner.__dict__[attr]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = self._timed(name, fn)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
            self._restore.append((owner, attr, raw))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def restore(self) -> None:
        for owner, attr, raw in self._restore:
            setattr(owner, attr, raw)


def bench_engine(batch: int, device: str, steps: int, dtype: str) -> dict:
    """TPOT without and with a regex on every request; with the regex, the host's seconds a step in each
    grammar part, and once more with xgrammar's batch fill on one thread instead of its pool."""
    from moekv import EngineConfig, SamplingParams, StructuredOutputsParams
    from moekv.engine import structured_output
    from moekv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=default_model_path(), dtype=dtype, device=device, max_num_seqs=batch,
                                    max_model_len=1024))
    result = {"batch": batch, "device": device}
    regex = SamplingParams(max_tokens=steps + 16, temperature=1.0,
                           structured_outputs=StructuredOutputsParams(regex="[a-z ]{4000}"))
    pool = structured_output._batch_filler
    for label, params in (
            ("free", SamplingParams(max_tokens=steps + 16, temperature=1.0, ignore_eos=True)),
            ("regex", regex), ("regex_one_fill_thread", regex)):
        if label == "regex_one_fill_thread":
            one = structured_output._xgrammar().BatchGrammarMatcher(max_threads=1)
            structured_output._batch_filler = lambda: one
        timers = HostTimers() if label != "free" else None
        for i in range(batch):
            engine.add_request(f"{label}-{i}", "Once upon a time", dataclasses.replace(params, seed=i))
        times, timed_parts = [], {}
        try:
            while engine.has_unfinished_requests():
                before = dict(timers.seconds) if timers else {}
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                if engine.num_running == batch:
                    times.append(dt)
                    for part, sec in (timers.seconds.items() if timers else ()):
                        timed_parts.setdefault(part, []).append(sec - before.get(part, 0.0))
        finally:
            if timers:
                timers.restore()
            structured_output._batch_filler = pool
        times = times[8:]  # prefill and warm-up
        result[f"{label}_tpot_ms"] = 1e3 * statistics.median(times)
        result[f"{label}_steps"] = len(times)
        if timed_parts:
            result[f"{label}_host_ms"] = {part: 1e3 * statistics.median(v[8:]) for part, v in timed_parts.items()}
    result["overhead"] = result["regex_tpot_ms"] / result["free_tpot_ms"] - 1
    result["overhead_one_fill_thread"] = result["regex_one_fill_thread_tpot_ms"] / result["free_tpot_ms"] - 1
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", action="store_true", help="time the bitmask fill and apply")
    ap.add_argument("--engine", action="store_true", help="time the engine's decode step with and without a grammar")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (--engine)")
    ap.add_argument("--vocab", type=int, nargs="+", default=None,
                    help="--mask at these vocabulary sizes too (xgrammar only): above domain-moe's 4,096, a synthetic "
                         "vocabulary of its tokens and pairs of them (e.g. 32000 for Mixtral, 151936 for Qwen)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    if args.mask:
        tokenizer = Tokenizer(default_model_path())
        vocab = json.loads((default_model_path() / "config.json").read_text())["vocab_size"]
        engines = [XGrammarRows]
        try:
            import llguidance  # noqa: F401
            engines.append(LLGuidanceRows)
        except ImportError:
            print("llguidance is not installed: xgrammar only")
        runs = [(cls, vocab) for cls in engines] + [(XGrammarRows, v) for v in args.vocab or ()]
        for cls, size in runs:
            for batch in args.batch:
                r = bench_mask(cls, batch, args.steps, torch.device(args.device), tokenizer, size,
                               tokenizer.eos_token_id)
                results.append(r)
                print(json.dumps(r))
    if args.engine:
        for batch in args.batch:
            r = bench_engine(batch, args.device, args.steps, args.dtype)
            results.append(r)
            print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
