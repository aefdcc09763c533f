"""Sampler: logits of the sampling positions -> one token per sequence, with its logprobs.

Penalties, temperature, top-k, top-p and min-p apply per row, each in a few launches for the whole
batch. A sampled row draws its token by an exponential race whose noise is a
counter-based hash of (the row's seed, the position of the token it samples, each token id): a
seeded request's tokens depend only on its seed and its own history, never on the batch around it.
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moekv.context import to_device
from moekv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int  # the request's seed (its own, or one the engine drew for it once)
    position: int  # the position in the sequence (prompt and output) of the token this row samples
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


def _shape_rows(logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
    """Penalties and blocked ids applied to logits [S, V], for the whole batch at once: the (row, token)
    pairs each touches are gathered on the host (a row's tokens so far) and copied without a host sync,
    one indexed read and write per kind. A copy of logits unless owned (the caller's to change)."""
    seen, factors = ([], []), []  # repetition: (rows, tokens), the row's penalty
    counted, amounts = ([], []), []  # presence / frequency: (rows, tokens), what comes off the logit
    blocked = ([], [])
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            tokens = set(row.prompt_ids)
            tokens.update(row.output_ids)
            seen[0].extend([i] * len(tokens))
            seen[1].extend(tokens)
            factors.extend([p.repetition_penalty] * len(tokens))
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            for t, n in collections.Counter(row.output_ids).items():
                counted[0].append(i)
                counted[1].append(t)
                amounts.append(p.frequency_penalty * n + p.presence_penalty)
        blocked[0].extend([i] * len(row.blocked_ids))
        blocked[1].extend(row.blocked_ids)
    if not (seen[0] or counted[0] or blocked[0]):
        return logits
    x = logits if owned else logits.clone()
    n_seen, n_counted = len(seen[0]), len(counted[0])
    where = to_device([seen[0] + counted[0] + blocked[0], seen[1] + counted[1] + blocked[1]], torch.long, x.device)
    if n_seen or n_counted:
        by = to_device(factors + amounts, x.dtype, x.device)
    if n_seen:  # a seen token's positive logit divided by the penalty, a negative one multiplied
        r, t, f = where[0, :n_seen], where[1, :n_seen], by[:n_seen]
        vals = x[r, t]
        x[r, t] = torch.where(vals > 0, vals / f, vals * f)
    if n_counted:
        r, t = where[0, n_seen:n_seen + n_counted], where[1, n_seen:n_seen + n_counted]
        x[r, t] -= by[n_seen:]
    if blocked[0]:
        x[where[0, n_seen + n_counted:], where[1, n_seen + n_counted:]] = float("-inf")
    return x


# -- the draw's noise ------------------------------------------------------------------------------
# splitmix64 (Steele, Lea and Flood, OOPSLA 2014): a 64-bit counter advanced by an odd constant, each
# value scrambled by a fixed finalizer; the finalizer alone is a good hash of a counter.
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # the counter's increment (2^64 over the golden ratio, made odd)
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _as_int64(value: int) -> int:
    """A value in [0, 2^64) as the int64 with the same bits."""
    return value - (1 << 64) if value >> 63 else value


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int in [0, 2^64)."""
    z = (z ^ (z >> 30)) * _MUL1 & _M64
    z = (z ^ (z >> 27)) * _MUL2 & _M64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    """The start of one row's noise stream, from the request's seed (any int; taken mod 2^64) and the
    position of the token it samples: distinct (seed, position) pairs give unrelated streams. As an
    int64's value."""
    return _as_int64(mix64(mix64(seed & _M64) ^ (position * _GAMMA & _M64)))


_MIX_STEPS = ((30, _as_int64(_MUL1)), (27, _as_int64(_MUL2)), (31, None))
_CPU_CHUNK = 1 << 16  # elements of a CPU chunk of the noise: its two int64 buffers stay in a core's L2
_CUDA_CHUNK = 1 << 24  # on CUDA: one chunk up to 64 rows of 262,144 tokens (two int64 buffers of 128 MiB)


@functools.lru_cache(maxsize=8)
def _token_counters(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[1, V] int64: (t + 1) * GAMMA mod 2^64 for each token id t."""
    return (torch.arange(1, vocab_size + 1, dtype=torch.long, device=device) * _as_int64(_GAMMA))[None]


def _race_bits_into(keys: torch.Tensor, counters: torch.Tensor, z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """z [R, C] int64 <- the top 40 bits of mix64(keys[r] + counters[r or 0, c]), in [0, 2^40). In place,
    with tmp as scratch: int64 multiplies wrap modulo 2^64 on the CPU and on CUDA, the masks make the
    right shifts logical."""
    torch.add(keys[:, None], counters, out=z)
    for shift, mul in _MIX_STEPS:
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        z ^= tmp
        if mul is not None:
            z *= mul
    z >>= 24
    return z.bitwise_and_((1 << 40) - 1)


def _counters(keys: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    if token_ids is None:
        return _token_counters(vocab_size, keys.device)
    return (token_ids + 1) * _as_int64(_GAMMA)


def race_bits(keys: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """keys [R] int64 (row_key) -> [R, C] int64 in [0, 2^40): token t's bits in row r are the top 40 bits
    of the (t + 1)-th output of splitmix64 started at keys[r], mix64(keys[r] + (t + 1) * GAMMA), for
    t = token_ids[r, c] ([R, C] int64), or for every t < vocab_size (C = V) when token_ids is None."""
    counters = _counters(keys, token_ids, vocab_size)
    z = torch.empty(keys.shape[0], counters.shape[1], dtype=torch.long, device=keys.device)
    return _race_bits_into(keys, counters, z, torch.empty_like(z))


def log_exponential_(w: torch.Tensor) -> torch.Tensor:
    """w float32 holding race bits b in [0, 2^40) -> log E, in place, with E = -log(1 - W) ~ Exp(1) for
    W = (b + 1/2) / 2^40 uniform in (0, 1). log1p keeps E's relative precision where it is small (the
    race's winners: U = 1 - W read in float32 would round E below 2^-24 to a few values); W stops
    short of 1 so that E, and so every token's score, stays finite."""
    return w.mul_(-2.0 ** -40).sub_(2.0 ** -41).clamp_(min=-(1 - 2.0 ** -24)).log1p_().neg_().log_()


def race_log_noise(keys: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[R, C] float32: log E for E ~ Exp(1), one independent E per (row, token), from race_bits' bits
    (and its arguments) by log_exponential_. In chunks of rows: on the CPU chunks that stay in cache
    (twice as fast at V = 32,000 as one pass), on CUDA chunks that bound the scratch memory; the same
    values either way."""
    R = keys.shape[0]
    counters = _counters(keys, token_ids, vocab_size)
    C = counters.shape[1]
    out = torch.empty(R, C, dtype=torch.float32, device=keys.device)
    step = max(1, min(R, (_CUDA_CHUNK if keys.is_cuda else _CPU_CHUNK) // C))
    z = torch.empty(step, C, dtype=torch.long, device=keys.device)
    tmp = torch.empty_like(z)
    for a in range(0, R, step):
        n = min(step, R - a)
        bits = _race_bits_into(keys[a:a + n], counters if counters.shape[0] == 1 else counters[a:a + n], z[:n], tmp[:n])
        out[a:a + n].copy_(bits)
    return log_exponential_(out)


_ID_BITS = 20  # a token id in the low bits of an order key: vocabularies up to 2^20 (1,048,576) tokens
_ID_MASK = (1 << _ID_BITS) - 1


@functools.lru_cache(maxsize=8)
def _id_complements(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[1, V] int64: 2^20 - 1 - t for each token id t."""
    return _ID_MASK - torch.arange(vocab_size, dtype=torch.long, device=device)[None]


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32 -> [R, V] int64 keys, distinct within a row, ordered as the tokens are ranked:
    by value, largest first, then by token id, smallest first. The float's bits, made to compare as
    integers (negative values' magnitude bits flipped), above 20 bits of the id's complement; so any
    sort or top-k, on any device, ranks the tokens the same way, ties included."""
    V = x.shape[-1]
    if V > 1 << _ID_BITS:
        raise ValueError(f"the sampler ranks at most {1 << _ID_BITS} tokens, not {V}")
    b = x.contiguous().view(torch.int32)
    keys = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(torch.long)
    keys <<= _ID_BITS
    return keys.bitwise_or_(_id_complements(V, x.device))


def _sorted_descending(keys: torch.Tensor) -> torch.Tensor:
    """Each row of keys [R, V] int64, largest first. On the CPU numpy sorts (the keys alone, vectorised;
    torch.sort orders indices along, 10x slower at 64 x 4,096)."""
    if keys.device.type != "cpu":
        return torch.sort(keys, dim=-1, descending=True).values
    return torch.from_numpy(np.ascontiguousarray(np.sort(keys.numpy(), axis=-1)[:, ::-1]))


def _ranked_keys(x: torch.Tensor, kmax: int | None) -> torch.Tensor:
    """order_keys of each row of x [R, V], largest first: the kmax largest, or all V when kmax is None.
    In chunks of rows (as race_log_noise: twice as fast on the CPU at 151,936 tokens)."""
    R, V = x.shape
    step = max(1, min(R, (_CPU_CHUNK if x.device.type == "cpu" else _CUDA_CHUNK) // V))
    parts = []
    for a in range(0, R, step):
        keys = order_keys(x[a:a + step])
        parts.append(torch.topk(keys, kmax, dim=-1).values if kmax is not None else _sorted_descending(keys))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _candidates(x: torch.Tensor, kmax: int | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                log_min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens each row of x [R, V] (temperature applied) may draw: (values [R, C], their token ids
    [R, C]), -inf outside the row's top-k, then top-p (over what top-k kept), then min-p, its best token
    always kept; ids None: every token in order (C = V). top_k [R] int64 (V: off), top_p [R] (inf: off),
    log_min_p [R] (-inf: off), each None when no row uses it.
    Top-k and top-p read the tokens' ranking by order_keys (equal values: the smaller token id first):
    top-k keeps the k best, top-p the fewest best whose mass reaches top_p. kmax (every row has a top-k,
    the largest is kmax): the candidates are the kmax best of each row (a partial sort, torch.topk);
    else, with a top-k or a top-p, every token ranked by one sort. The ranking is total, so both give a
    row the same candidates whatever the rest of the batch."""
    if top_k is None and top_p is None:
        values, ids = x, None
    else:
        ids = _ID_MASK - (_ranked_keys(x, kmax) & _ID_MASK)  # [R, C]: the token ids, best first
        values = x.gather(1, ids)
        if top_k is not None:
            rank = torch.arange(ids.shape[1], device=x.device)[None]
            values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
        if top_p is not None:
            probs = torch.softmax(values, dim=-1)
            mass_before = probs.cumsum(-1).sub_(probs)  # probability of the tokens ranked above each one
            values = values.masked_fill(mass_before >= top_p[:, None], float("-inf"))  # (never the best: 0)
    if log_min_p is not None:  # p / p_max < min_p, read on the logits: x - max(x) < log(min_p)
        values = values.masked_fill(values < values.amax(-1, keepdim=True) + log_min_p[:, None], float("-inf"))
    return values, ids


def _draw(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of x [R, V] (every row sampled: temperature > 0) -> [R] int64: temperature, the
    filters (_candidates), then an exponential race, argmax(p / E) = argmax(x / T - log E) over the
    candidates, which picks token t with probability p_t when the E are independent Exp(1): the noise
    of (row_key(seed, position), t) (race_log_noise), the same whichever tokens are candidates. The
    per-row values travel in at most two host-to-device copies."""
    R, V = x.shape
    params = [row.params for row in rows]
    keys = [row_key(row.seed, row.position) for row in rows]
    k_of = [p.top_k if 0 < p.top_k < V else V for p in params]
    uses_k = any(k < V for k in k_of)
    ints = to_device([keys, k_of] if uses_k else [keys], torch.long, x.device)
    floats = {}
    if any(p.temperature != 1.0 for p in params):
        floats["temperature"] = [p.temperature for p in params]
    if any(p.top_p < 1.0 for p in params):
        floats["top_p"] = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
    if any(p.min_p > 0.0 for p in params):
        floats["log_min_p"] = [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params]
    if floats:
        floats = dict(zip(floats, to_device(list(floats.values()), torch.float32, x.device)))
    if "temperature" in floats:
        x = x / floats["temperature"][:, None]
    kmax = max(k_of) if max(k_of) < V else None
    values, ids = _candidates(x, kmax, ints[1] if uses_k else None, floats.get("top_p"), floats.get("log_min_p"))
    score = race_log_noise(ints[0], ids, V)
    best = torch.sub(values, score, out=score).argmax(dim=-1)  # [R]
    return best if ids is None else ids.gather(1, best[:, None])[:, 0]


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
    row, which at batch 64 cost milliseconds a step. The batch is sampled in a fixed number of
    launches whatever its size: greedy rows take one argmax, sampled rows one temperature, filter and
    race over all of them (_draw), after one pass of penalties and blocked ids. Rows with a grammar
    (structured outputs) have their bitmask filled here on the host and applied to the logits first.
    """
    S = logits.shape[0]
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    # (the host's work, while the device runs the step)
    bitmask = grammar_bitmask(rows, logits.shape[-1], pinned=logits.is_cuda)
    x = logits
    if bitmask is not None:  # logprobs stay the model's own; only the choice is constrained
        x = apply_bitmask_(logits.clone(), bitmask)
    x = _shape_rows(x, rows, owned=bitmask is not None)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(drawn) == S:
        tokens = _draw(x, rows)  # [S]
    else:
        tokens = torch.argmax(x, dim=-1)  # [S]
        if drawn:
            idx = to_device(drawn, torch.long, x.device)
            tokens[idx] = _draw(x[idx], [rows[i] for i in drawn])
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]  # [S]
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    top_k = max((rows[i].params.logprobs for i in wanted), default=0)
    parts = [tokens.double(), chosen.double()]  # token ids are exact in float64
    if top_k:
        top_vals, top_ids = torch.topk(raw_logprobs[wanted], top_k, dim=-1)  # [W, k]
        parts += [top_ids.double().flatten(), top_vals.double().flatten()]
    return PendingSample(tokens, to_host_async(torch.cat(parts)), rows, wanted, top_k)
