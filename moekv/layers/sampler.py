"""Sampler: logits of the sampling positions -> one token per sequence, with its logprobs.

Penalties, temperature, top-k, top-p and min-p apply per row; a row with a seed draws from its
own torch.Generator, so its samples do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moekv.context import to_device
from moekv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    blocked_ids: list[int]  # stop tokens not allowed yet (min_tokens)
    grammar: Any = None  # structured outputs: the sequence's GrammarState (engine/structured_output.py)


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # of the chosen token under the model's raw distribution
    top_logprobs: dict[int, float] | None


def top_logprobs_of(logprobs: torch.Tensor, num: int, chosen: int | None) -> dict[int, float]:
    """The num most likely tokens of one row (and the chosen one) -> {token_id: logprob}."""
    result: dict[int, float] = {}
    if num > 0:
        values, ids = torch.topk(logprobs, num)
        result = dict(zip(ids.tolist(), values.tolist()))
    if chosen is not None and chosen not in result:
        result[chosen] = float(logprobs[chosen])
    return result


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        ids, counts = torch.tensor(row.output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Mask with -inf every token outside top-k / top-p / min-p (always keeping the best one)."""
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop = mass_before >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class PinnedBitmasks:
    """Page-locked host buffers for the bitmask a CUDA step copies without a host sync, kept from step to
    step: pinning a fresh tensor every step (cudaHostAlloc) cost more than the fill and the masking
    together. Two buffers, used in turn, so a step never writes the one an earlier step's copy may still
    be reading (the host waits for step n's token before filling step n + 1's rows, and step n's copy
    is queued before its sampling, so one would do; two keep that an invariant of this class alone)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def take(self, rows: int, words: int) -> torch.Tensor:
        """A pinned int32 [rows, words] view, every bit set."""
        if not self._buffers or self._buffers[0].numel() < rows * words:
            self._buffers = [torch.empty(max(rows * words, 64 * words), dtype=torch.int32, pin_memory=True)
                             for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:rows * words].view(rows, words).fill_(-1)


_PINNED = PinnedBitmasks()


def grammar_bitmask(rows: list[SamplingRow], vocab_size: int, pinned: bool = False) -> torch.Tensor | None:
    """[S, ceil(V/32)] int32 on the host: bit t of word w of row i says whether token 32w + t keeps row
    i inside its grammar (every bit set for a row without one); None when no row has a grammar.
    pinned: in page-locked memory kept between steps (for a copy to the GPU without a host sync)."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return None
    words = (vocab_size + 31) // 32
    bitmask = _PINNED.take(len(rows), words) if pinned else torch.full((len(rows), words), -1, dtype=torch.int32)
    grammars = [rows[i].grammar for i in constrained]
    type(grammars[0]).fill_rows(grammars, bitmask, constrained)
    return bitmask


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with -inf where bitmask (host, [S, ceil(V/32)] int32) clears the token's bit, in
    place. On the GPU the bitmask travels packed (V/8 bytes a row) and is unpacked there by plain
    torch ops (no kernel to build); on the CPU xgrammar's own kernel applies it (twice as fast as
    the unpacking, measured in benchmarks/e2e/bench_grammar_mask.py)."""
    if not logits.is_cuda:
        import xgrammar  # present: a bitmask exists only where a grammar was compiled

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
        return logits
    if not bitmask.is_pinned():
        bitmask = bitmask.pin_memory()
    words = bitmask.to(logits.device, non_blocking=True)
    return logits.masked_fill_(~unpack_bitmask(words, logits.shape[-1]), float("-inf"))


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, ceil(V/32)] int32 -> [S, V] bool (True: allowed), on words' device."""
    bit = torch.arange(32, dtype=torch.int32, device=words.device)  # (made there: a host copy would wait for the step)
    return ((words[:, :, None] >> bit) & 1).bool().flatten(1)[:, :vocab_size]


def to_host_async(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy of x that is valid once the work queued so far has run (a CUDA tensor goes to
    pinned memory without a host sync: wait on an event recorded after this call)."""
    return x.to("cpu", non_blocking=True) if x.is_cuda else x


class PendingSample:
    """A step's sampled tokens, still on the device: `tokens` [S] int64 may feed the next step
    before the host has seen them (the engine's one-step lookahead); `results()` reads the one
    transfer once the caller has waited for the step (PendingStep.wait)."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor, rows: list[SamplingRow], wanted: list[int],
                 top_k: int) -> None:
        self.tokens = tokens
        self._host = host  # token ids, their logprobs, then the top logprobs of the rows in `wanted`
        self._rows, self._wanted, self._top_k = rows, wanted, top_k

    def results(self) -> list[SampleResult]:
        rows, wanted, top_k = self._rows, self._wanted, self._top_k
        S = len(rows)
        host = self._host.tolist()
        token_ids, logprobs = [int(t) for t in host[:S]], host[S:2 * S]
        tops: dict[int, dict[int, float]] = {}
        if top_k:
            n = len(wanted) * top_k
            ids, vals = host[2 * S:2 * S + n], host[2 * S + n:]
            for j, i in enumerate(wanted):
                num = rows[i].params.logprobs
                tops[i] = {int(t): v for t, v in zip(ids[j * top_k:j * top_k + num], vals[j * top_k:j * top_k + num])}
        results = []
        for i, row in enumerate(rows):
            top = None
            if row.params.logprobs is not None:
                top = tops.get(i, {})
                top.setdefault(token_ids[i], logprobs[i])  # the chosen token is always reported
            results.append(SampleResult(token_ids[i], logprobs[i], top))
        return results


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """sample_async, then wait for it: logits [S, V] fp32, one row per sampling sequence."""
    pending = sample_async(logits, rows)
    if logits.is_cuda:
        torch.cuda.current_stream(logits.device).synchronize()
    return pending.results()


def sample_async(logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
    """Queue the sampling of logits [S, V] fp32 (one row per sampling sequence) without a host sync.

    Every chosen token stays on the device; its logprob and, for the rows that ask, their top
    logprobs go to the host in one transfer, queued here: one host sync per step, not two per
    row, which at batch 64 cost milliseconds a step. Plain greedy rows (no penalty, nothing
    blocked) take one batched argmax; the others are shaped row by row, still without a sync.
    Rows with a grammar (structured outputs) have their bitmask filled here on the host and applied
    to the logits first.
    """
    S = logits.shape[0]
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    # (the host's work, while the device runs the step)
    bitmask = grammar_bitmask(rows, logits.shape[-1], pinned=logits.is_cuda)
    if bitmask is not None:  # logprobs stay the model's own; only the choice is constrained
        logits = apply_bitmask_(logits.clone(), bitmask)
    plain = [i for i, row in enumerate(rows)
             if row.params.greedy and not row.params.has_penalties and not row.blocked_ids]
    if len(plain) == S:
        tokens = torch.argmax(logits, dim=-1)  # [S]
    else:
        tokens = torch.empty(S, dtype=torch.long, device=logits.device)
        if plain:
            idx = to_device(plain, torch.long, logits.device)
            tokens[idx] = torch.argmax(logits[idx], dim=-1)
        plain_set = set(plain)
        for i, row in enumerate(rows):
            if i in plain_set:
                continue
            p = row.params
            x = logits[i].clone()
            if p.has_penalties:
                x = _apply_penalties(x, row)
            if row.blocked_ids:
                x[to_device(row.blocked_ids, torch.long, x.device)] = float("-inf")
            if p.greedy:
                tokens[i] = torch.argmax(x)
            else:
                x = _filter(x / p.temperature, p)
                tokens[i] = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=row.generator)[0]
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]  # [S]
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    top_k = max((rows[i].params.logprobs for i in wanted), default=0)
    parts = [tokens.double(), chosen.double()]  # token ids are exact in float64
    if top_k:
        top_vals, top_ids = torch.topk(raw_logprobs[wanted], top_k, dim=-1)  # [W, k]
        parts += [top_ids.double().flatten(), top_vals.double().flatten()]
    return PendingSample(tokens, to_host_async(torch.cat(parts)), rows, wanted, top_k)
