"""Sampler: logits of the sampling positions -> one token per sequence, with its logprobs.

Penalties, temperature, top-k, top-p and min-p apply per row; a row with a seed draws from its
own torch.Generator, so its samples do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    blocked_ids: list[int]  # stop tokens not allowed yet (min_tokens)


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


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """logits [S, V] fp32, one row per sampling sequence."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    results = []
    for i, row in enumerate(rows):
        p = row.params
        x = logits[i].clone()
        if p.has_penalties:
            x = _apply_penalties(x, row)
        if row.blocked_ids:
            x[torch.tensor(row.blocked_ids, device=x.device)] = float("-inf")
        if p.greedy:
            token = int(torch.argmax(x))
        else:
            x = _filter(x / p.temperature, p)
            probs = torch.softmax(x, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=row.generator))
        top = top_logprobs_of(raw_logprobs[i], p.logprobs, token) if p.logprobs is not None else None
        results.append(SampleResult(token, float(raw_logprobs[i, token]), top))
    return results
