"""SamplingParams validation and the sampler (small CPU tensors, no model)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from moekv.layers import sampler
from moekv.layers.sampler import (
    SamplingRow,
    log_exponential_,
    order_keys,
    race_bits,
    race_log_noise,
    row_key,
    sample,
)
from moekv.sampling_params import SamplingParams, SamplingParamsError

NAN, INF = float("nan"), float("inf")


# -- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature=INF), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=NAN), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=3.0), "max_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=False), "prompt_logprobs"),
    (dict(seed=True), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=NAN), "repetition_penalty"),
    (dict(repetition_penalty=INF), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=NAN), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
])
def test_out_of_range_values_raise_naming_the_field(kwargs, field):
    """Each bad value raises a ValueError (SamplingParamsError) whose message names the offending
    field, and which carries the field's name and value for callers that report it their own way."""
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field}=")) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SamplingParamsError) and info.value.field == field
    assert info.value.message_for("api_name").startswith(f"api_name={info.value.value!r} is out of range")


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0), dict(temperature=2.5), dict(top_p=1.0), dict(top_p=0.01),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(min_p=0.0), dict(min_p=1.0),
    dict(max_tokens=None, min_tokens=50), dict(max_tokens=1), dict(max_tokens=5, min_tokens=5),
    dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=0), dict(seed=0), dict(seed=-3),
    dict(stop="x"), dict(stop=["a", "bc"]), dict(stop_token_ids=[0, 2]),
    dict(repetition_penalty=0.5), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
])
def test_valid_values_are_accepted(kwargs):
    """Defaults and in-range boundary values construct (and re-validate) without error."""
    SamplingParams(**kwargs).validate()


def test_defaults():
    """The defaults sample at temperature 1 without filters or penalties, 16 tokens."""
    p = SamplingParams()
    assert p.max_tokens == 16 and not p.greedy and not p.has_penalties
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert SamplingParams(stop="end").stop_strings == ["end"]


def test_validate_catches_later_mutation():
    """validate() re-checks a params object that was changed after construction."""
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p="):
        p.validate()


# -- sampler ---------------------------------------------------------------------------------------

def row(params: SamplingParams, seed: int = 0, position: int = 0, prompt=(), output=(), blocked=()) -> SamplingRow:
    return SamplingRow(params, seed, position, list(prompt), list(output), list(blocked))


def flat_logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    """Nearly uniform logits with a unique argmax: an unfiltered draw rarely picks the best token."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(vocab, generator=g) * 0.1


def test_greedy_picks_argmax():
    """temperature 0 returns the argmax of each row, with its raw logprob, also beside sampled rows."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    res = sample(logits.clone(), [row(SamplingParams(temperature=0), seed=i) for i in range(6)])
    assert [r.token_id for r in res] == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits, -1)
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(float(lp[i, r.token_id]))
        assert r.top_logprobs is None
    mixed = [row(SamplingParams(temperature=0 if i % 2 else 1.0), seed=i) for i in range(6)]
    res = sample(logits.clone(), mixed)
    assert [r.token_id for r in res][1::2] == logits.argmax(-1).tolist()[1::2]


def test_top_k_one_always_picks_argmax():
    """top_k=1 at temperature 1 keeps only the best token, whatever the noise draws."""
    x = flat_logits()
    rows = [row(SamplingParams(top_k=1), seed=i) for i in range(200)]
    res = sample(x.expand(200, -1).clone(), rows)
    assert {r.token_id for r in res} == {int(x.argmax())}
    # Without the filter the same draws do spread over the vocabulary (the test can fail).
    unfiltered = sample(x.expand(200, -1).clone(), [row(SamplingParams(), seed=i) for i in range(200)])
    assert len({r.token_id for r in unfiltered}) > 20


def test_small_top_p_keeps_only_the_best_token():
    """A top_p smaller than the best token's probability leaves only that token."""
    x = flat_logits()
    res = sample(x.expand(200, -1).clone(), [row(SamplingParams(top_p=0.01), seed=i) for i in range(200)])
    assert {r.token_id for r in res} == {int(x.argmax())}


def test_blocked_ids_are_never_sampled():
    """Blocked tokens (min_tokens' stop tokens) are never drawn, even when they are the likeliest."""
    x = torch.zeros(8)
    x[[2, 5]] = 5.0  # together ~99% of the mass
    blocked = [2, 5]
    rows = [row(SamplingParams(), seed=i, blocked=blocked if i % 3 else ()) for i in range(300)]
    got = [r.token_id for r in sample(x.expand(300, -1).clone(), rows)]
    assert not {t for i, t in enumerate(got) if i % 3} & set(blocked) and len(set(got)) > 3
    assert sum(t in blocked for t in got[::3]) > 80  # the rows without blocked ids keep them (~99 of 100)
    greedy = sample(x[None].clone(), [row(SamplingParams(temperature=0), blocked=blocked)])[0]
    assert greedy.token_id not in blocked


def test_repetition_penalty_lowers_seen_tokens():
    """repetition_penalty > 1 divides a seen positive logit and multiplies a seen negative one."""
    greedy = dict(temperature=0)
    pos = torch.tensor([[2.0, 1.5, 0.0]])
    assert sample(pos.clone(), [row(SamplingParams(**greedy))])[0].token_id == 0
    res = sample(pos.clone(), [row(SamplingParams(repetition_penalty=2.0, **greedy), prompt=[0])])[0]
    assert res.token_id == 1  # 2.0 / 2 = 1.0 < 1.5
    assert res.logprob == pytest.approx(float(torch.log_softmax(pos[0], -1)[1]))  # raw distribution
    # seen in the output counts too; unseen tokens are untouched
    assert sample(pos.clone(), [row(SamplingParams(repetition_penalty=2.0, **greedy), output=[0])])[0].token_id == 1
    assert sample(pos.clone(), [row(SamplingParams(repetition_penalty=2.0, **greedy), prompt=[2])])[0].token_id == 0
    neg = torch.tensor([[-1.0, -1.2, -5.0]])
    assert sample(neg.clone(), [row(SamplingParams(repetition_penalty=1.5, **greedy), prompt=[0])])[0].token_id == 1


def test_penalties_and_blocked_ids_of_a_batch_match_a_per_row_reference():
    """The batch's penalties and blocked ids (one gather and write per kind) give each row what applying
    its own rules alone gives: repetition over prompt and output, presence and frequency over the output
    (counted), blocked ids at -inf, rows without any left untouched."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 20, generator=g, dtype=torch.float64) * 2
    specs = [
        (dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.25), [1, 2, 3], [3, 3, 7, 19], [0]),
        (dict(), [1, 2], [4], [5, 6]),
        (dict(repetition_penalty=0.8), [9], [9, 10], []),
        (dict(frequency_penalty=-1.0), [], [2, 2, 2], []),
        (dict(), [1], [1], []),
        (dict(presence_penalty=2.0), [4], [], [11]),  # no output yet: presence takes nothing off
    ]
    rows = [row(SamplingParams(temperature=0, **kw), prompt=pr, output=out, blocked=bl) for kw, pr, out, bl in specs]
    want = logits.clone()
    for i, (kw, pr, out, bl) in enumerate(specs):
        rp = kw.get("repetition_penalty", 1.0)
        for t in set(pr) | set(out):
            want[i, t] = want[i, t] / rp if want[i, t] > 0 else want[i, t] * rp
        for t in set(out):
            want[i, t] -= kw.get("frequency_penalty", 0.0) * out.count(t) + kw.get("presence_penalty", 0.0)
        want[i, bl] = float("-inf")
    x = logits.float()
    got = sampler._shape_rows(x, rows, owned=False)
    assert torch.equal(x, logits.float())  # not owned: the caller's logits stay as they were
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)].double(), want[~torch.isinf(want)], atol=1e-5)
    assert [r.token_id for r in sample(x.clone(), rows)] == want.argmax(-1).tolist()


def test_top_logprobs_returns_requested_number_plus_chosen():
    """logprobs=N returns the N best raw logprobs, plus the chosen token when it is not among them."""
    x = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0])
    lp = torch.log_softmax(x, -1)
    # greedy with the two best tokens blocked chooses token 2, outside the top 2
    res = sample(x[None].clone(), [row(SamplingParams(temperature=0, logprobs=2), blocked=[0, 1])])[0]
    assert res.token_id == 2
    assert set(res.top_logprobs) == {0, 1, 2}
    for tok, value in res.top_logprobs.items():
        assert value == pytest.approx(float(lp[tok]))
    assert res.logprob == pytest.approx(float(lp[2]))
    # the chosen token already in the top N: exactly N entries
    res = sample(x[None].clone(), [row(SamplingParams(temperature=0, logprobs=3))])[0]
    assert res.token_id == 0 and set(res.top_logprobs) == {0, 1, 2}
    # logprobs=0: only the chosen token
    res = sample(x[None].clone(), [row(SamplingParams(temperature=0, logprobs=0))])[0]
    assert res.top_logprobs == {0: pytest.approx(float(lp[0]))}
    assert math.isclose(sum(math.exp(v) for v in lp.tolist()), 1.0, rel_tol=1e-5)


def chi2_999(df: int) -> float:
    """The 99.9% point of the chi-square distribution with df degrees of freedom (bisection on its
    survival function, the regularized upper incomplete gamma function)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        sf = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(mid / 2)))
        lo, hi = (mid, hi) if sf > 1e-3 else (lo, mid)
    return lo


def test_chi2_999_matches_tables():
    assert [round(chi2_999(df), 2) for df in (1, 2, 10, 255)] == [10.83, 13.82, 29.59, 330.52]


# -- the race's noise: splitmix64, written out again on Python ints (the oracle) ---------------------

M64 = (1 << 64) - 1


def splitmix64_outputs(state: int, n: int) -> list[int]:
    """The first n outputs of splitmix64 started at state (Steele, Lea and Flood 2014)."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


def test_splitmix64_oracle_matches_published_outputs():
    """The oracle itself: splitmix64 seeded with 1234567 starts with the published reference values
    (Rosetta Code, 'Pseudo-random numbers/Splitmix64')."""
    assert splitmix64_outputs(1234567, 2) == [6457827717110365317, 3203168211198807973]


@pytest.mark.parametrize("seed, position", [(0, 0), (7, 130), (-3, 5), (2**64 + 7, 130), (2**70 - 1, 99999)])
def test_race_bits_are_splitmix64_of_the_row_key(seed, position, monkeypatch):
    """Token t's 40 bits are the top bits of splitmix64's (t + 1)-th output from the row's key, computed
    exactly in int64 tensor ops (wrapping multiplies, logical shifts), dense or at gathered token ids,
    in one pass or in CPU chunks; a seed counts modulo 2^64."""
    V = 300
    key = row_key(seed, position)
    assert key == row_key(seed % 2**64, position)
    want = [z >> 24 for z in splitmix64_outputs(key & M64, V)]
    keys = torch.tensor([key, key])
    assert race_bits(keys, None, V)[0].tolist() == want
    ids = torch.tensor([[5, 299, 0, 17], [1, 2, 3, 4]])
    assert race_bits(keys, ids, V).tolist() == [[want[t] for t in r] for r in ids.tolist()]
    one_pass = race_log_noise(keys, None, V)
    monkeypatch.setattr(sampler, "_CPU_CHUNK", 7)  # chunks of one row
    assert torch.equal(race_log_noise(keys, None, V), one_pass)
    w = (torch.tensor(want, dtype=torch.float64) + 0.5) / 2**40
    assert torch.allclose(one_pass[0].double(), torch.log(-torch.log1p(-w)), atol=1e-6, rtol=1e-6)


def test_log_exponential_is_finite_and_precise_at_the_extremes():
    """The extreme bits give finite log E (a token's score never becomes +-inf or NaN), and small E
    (the likely winners) keep their relative precision down to the smallest."""
    bits = torch.tensor([0, 1, 2**16, 2**39, 2**40 - 2**15, 2**40 - 1], dtype=torch.float64)
    got = log_exponential_(bits.float()).double()
    want = torch.log(-torch.log1p(-(bits + 0.5) / 2**40))
    assert torch.isfinite(got).all()
    assert torch.allclose(got[:4], want[:4], atol=1e-6, rtol=1e-6)
    # W within 2^-25 of 1 rounds to 1 in float32 and stops at 1 - 2^-24: E = 16.6 (log 2.81) for these
    assert torch.allclose(got[4:], torch.full((2,), math.log(16.635532), dtype=torch.float64), atol=1e-4)
    assert (want[4:] > got[4:]).all()
    x = torch.tensor([[float("-inf"), 0.0, float("-inf")]])
    assert torch.isneginf(x - log_exponential_(torch.tensor([[2.0**40 - 1] * 3]))).tolist() == [[True, False, True]]


def test_row_keys_separate_seeds_and_positions():
    """Distinct (seed, position) pairs give distinct keys (nearby seeds and positions included)."""
    keys = {row_key(s, p) for s in range(-50, 50) for p in range(200)}
    assert len(keys) == 100 * 200


def _chi2_uniform(values: torch.Tensor, bins: int) -> float:
    counts = torch.bincount(values.flatten(), minlength=bins).double()
    expected = values.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def test_race_noise_is_uniform_and_independent_across_tokens_positions_and_seeds():
    """The 40-bit values, cut to their top 4 bits, are uniform over 16 bins, and pairs of them (neighbouring
    tokens, neighbouring positions of one seed, neighbouring seeds at one position) are uniform over
    the 256 cells (chi-square at the 0.1% level). A hash of a plain counter fails this (checked below)."""
    V = 512
    seeds, positions = range(40), range(100, 140)
    keys = torch.tensor([[row_key(s, p) for p in positions] for s in seeds])  # [S, P]
    bits = race_bits(keys.flatten(), None, V).view(len(seeds), len(positions), V) >> 36  # [S, P, V] in [0, 16)
    assert _chi2_uniform(bits, 16) < chi2_999(15)
    for a, b in ((bits[:, :, :-1], bits[:, :, 1:]), (bits[:, :-1], bits[:, 1:]), (bits[:-1], bits[1:])):
        assert _chi2_uniform(16 * a + b, 256) < chi2_999(255)
    # the test can fail: the top bits of (key + (t + 1) * GAMMA) without the finalizer are far from uniform pairs
    raw = ((keys.flatten()[:, None] + (torch.arange(1, V + 1) * sampler._as_int64(sampler._GAMMA))) >> 60) & 15
    assert _chi2_uniform(16 * raw[:, :-1] + raw[:, 1:], 256) > chi2_999(255)


# -- distributions: frequencies over many draws against the exact filtered softmax (float64) ------------

LOGITS = torch.tensor([2.1, 1.7, 1.2, 1.0, 0.65, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0], dtype=torch.float64)


def exact_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                       min_p: float = 0.0) -> torch.Tensor:
    """The target distribution in float64, filter by filter as SamplingParams documents them: softmax at
    the temperature; top-k keeps the k most likely; top-p the smallest most-likely set whose mass (after
    top-k) reaches top_p; min-p the tokens at least min_p times as likely as the best."""
    p = torch.softmax(logits.double() / temperature, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = torch.argsort(p, descending=True)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        mass = 0.0
        for t in order.tolist():
            if mass >= top_p:
                keep[t] = False
            mass += float(q[t])
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


CASES = [
    dict(),
    dict(temperature=0.5),
    dict(temperature=1.8),
    dict(top_k=3),
    dict(top_k=6, temperature=0.7),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=1.3),
    dict(min_p=0.1),
    dict(min_p=0.3, temperature=0.8),
    dict(top_k=7, top_p=0.8),
    dict(top_k=8, top_p=0.85, min_p=0.05, temperature=0.9),
    dict(top_p=0.75, min_p=0.2, temperature=1.2),
]
DRAWS = 6000


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def _assert_fits(counts: torch.Tensor, expected: torch.Tensor, label) -> None:
    """No draw outside the support; chi-square below its 99.9% point (the draws are seeded: the
    verdict is fixed, and a wrong sampler fails it, see test_a_wrong_race_fails_the_distribution_test)."""
    support = expected > 0
    assert counts[~support].sum() == 0, (label, counts.tolist())
    n = counts.sum()
    stat = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    assert stat < chi2_999(int(support.sum()) - 1), (label, stat, counts.tolist())


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain")
def test_sampled_frequencies_match_the_exact_distribution(kwargs):
    """6,000 rows of the same logits, each its own seed, in one batch: the frequencies fit the exact
    filtered softmax."""
    V = LOGITS.numel()
    rows = [row(SamplingParams(**kwargs), seed=i, position=3) for i in range(DRAWS)]
    res = sample(LOGITS.float().expand(DRAWS, -1).clone(), rows)
    _assert_fits(_counts([r.token_id for r in res], V), exact_distribution(LOGITS, **kwargs), kwargs)


def test_mixed_batch_frequencies_match_each_rows_distribution():
    """Every setting of CASES (and greedy rows) interleaved in one batch, each row over its own positions
    of one seed: each setting's frequencies fit its own distribution (per-row parameters; the sort's
    path, since not every row has a top-k)."""
    V, n = LOGITS.numel(), len(CASES) + 1
    settings = [SamplingParams(**kw) for kw in CASES] + [SamplingParams(temperature=0)]
    rows = [row(settings[i % n], seed=11, position=i) for i in range(DRAWS * n // 2)]
    res = sample(LOGITS.float().expand(len(rows), -1).clone(), rows)
    tokens = [r.token_id for r in res]
    for j, kwargs in enumerate(CASES):
        _assert_fits(_counts(tokens[j::n], V), exact_distribution(LOGITS, **kwargs), kwargs)
    assert set(tokens[len(CASES)::n]) == {int(LOGITS.argmax())}


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.6), dict(presence_penalty=0.8, frequency_penalty=0.5)])
def test_penalised_rows_match_the_penalised_distribution(kwargs):
    """Rows with penalties (shaped row by row, then drawn with the batch) fit the softmax of the penalised
    logits, beside plain rows of the same batch that fit the unpenalised one."""
    V, seen = LOGITS.numel(), [0, 0, 2, 5]
    shaped = LOGITS.clone()
    if "repetition_penalty" in kwargs:
        r = kwargs["repetition_penalty"]
        for t in set(seen) | {9}:  # the prompt's tokens count too
            shaped[t] = shaped[t] / r if shaped[t] > 0 else shaped[t] * r
    else:
        for t in set(seen):
            shaped[t] -= kwargs["frequency_penalty"] * seen.count(t) + kwargs["presence_penalty"]
    rows = [row(SamplingParams(**kwargs) if i % 2 else SamplingParams(), seed=i, prompt=[9], output=seen)
            for i in range(2 * DRAWS)]
    tokens = [r.token_id for r in sample(LOGITS.float().expand(len(rows), -1).clone(), rows)]
    _assert_fits(_counts(tokens[1::2], V), exact_distribution(shaped), kwargs)
    _assert_fits(_counts(tokens[0::2], V), exact_distribution(LOGITS), "plain")


def test_large_vocabulary_frequencies(monkeypatch):
    """A 3,000-token vocabulary, temperature 0.8 with top-p 0.9 (the sort's path) and with top-k 100 (the
    partial sort's): frequencies fit in bins of the exact distribution holding about 1% of its mass each,
    computed in chunks of the noise."""
    monkeypatch.setattr(sampler, "_CPU_CHUNK", 3 * 3000)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3000, generator=g, dtype=torch.float64) * 2
    for kwargs in (dict(temperature=0.8, top_p=0.9), dict(temperature=0.8, top_k=100)):
        rows = [row(SamplingParams(**kwargs), seed=7, position=p) for p in range(DRAWS)]
        tokens = [r.token_id for r in sample(logits.float().expand(DRAWS, -1).clone(), rows)]
        expected = exact_distribution(logits, **kwargs)
        order = torch.argsort(expected, descending=True)
        bins = torch.clamp((expected[order].cumsum(0) * 100).long(), max=99)  # bin of each token by rank
        bin_of = torch.empty(3000, dtype=torch.long)
        bin_of[order] = bins
        bin_of[expected == 0] = 100  # outside the support: a bin that must stay empty
        counts = torch.bincount(bin_of[tokens], minlength=101).double()
        want = torch.bincount(bin_of, weights=expected, minlength=101)
        _assert_fits(counts, want, kwargs)


def test_a_wrong_race_fails_the_distribution_test(monkeypatch):
    """The distribution test catches a wrong draw: argmax(x - E) (Gumbel-max without the log), or
    top-p keeping one token fewer."""
    def wrong_noise(keys, ids, vocab):  # E, not log E
        return -torch.log1p(-(race_bits(keys, ids, vocab).double() + 0.5) / 2**40).float()

    with monkeypatch.context() as m:
        m.setattr(sampler, "race_log_noise", wrong_noise)
        with pytest.raises(AssertionError):
            test_sampled_frequencies_match_the_exact_distribution(dict())
    with pytest.raises(AssertionError):
        _assert_fits(_counts([r.token_id for r in sample(
            LOGITS.float().expand(DRAWS, -1).clone(), [row(SamplingParams(top_p=0.6), seed=i) for i in range(DRAWS)])],
            LOGITS.numel()), exact_distribution(LOGITS, top_p=0.5), "top_p 0.6 against 0.5")


# -- ties: one ranking on every path -----------------------------------------------------------------

def test_order_keys_rank_by_value_then_token_id():
    """Sorting the keys ranks tokens by value (largest first), equal values by token id (smallest
    first), across signs, infinities and bf16-rounded values full of ties."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 300, generator=g) * 4).to(torch.bfloat16).float()
    x[0, :10] = float("-inf")
    x[1, 5:9] = float("inf")
    x[2, ::3] = 1.5
    keys = order_keys(x)
    for r in range(4):
        want = sorted(range(300), key=lambda t: (-float(x[r, t]), t))
        assert torch.argsort(keys[r], descending=True).tolist() == want
        assert len(set(keys[r].tolist())) == 300


def test_tied_values_at_the_top_k_cut_fall_by_token_id():
    """top_k=3 over logits [1, 3, 2, 3, 2, 2, 0] keeps tokens 1, 3 (the two 3s) and 2 (the first 2), on
    the partial sort's path (every row has a top-k) and on the sort's (beside a row without one)."""
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0])
    want = exact_distribution(torch.tensor([-99.0, 3.0, 2.0, 3.0, -99.0, -99.0, -99.0], dtype=torch.float64))
    rows = [row(SamplingParams(top_k=3), seed=i) for i in range(3000)]
    partial = [r.token_id for r in sample(x.expand(3000, -1).clone(), rows)]
    _assert_fits(_counts(partial, 7), want, "partial sort")
    both = sample(x.expand(3001, -1).clone(), rows + [row(SamplingParams(), seed=5)])
    assert [r.token_id for r in both[:3000]] == partial


def test_seeded_tokens_with_tied_logits_do_not_depend_on_the_path():
    """bf16-rounded logits (ties everywhere, as a bf16 LM head gives): a seeded row with top-k and top-p
    draws the same tokens alone (candidates: its 20 best), beside a row with a larger top-k (its 60
    best) and beside rows that make the batch sort every token."""
    g = torch.Generator().manual_seed(9)
    me = SamplingParams(top_k=20, top_p=0.9, temperature=0.8, seed=4)
    companions = {"alone": [], "larger top-k": [SamplingParams(top_k=60)], "top-p only": [SamplingParams(top_p=0.5)],
                  "no filter": [SamplingParams(temperature=1.2)], "greedy": [SamplingParams(temperature=0)]}
    tokens = {name: [] for name in companions}
    for step in range(60):
        logits = (torch.randn(512, generator=g) * 3).to(torch.bfloat16).float()
        for name, others in companions.items():
            rows = [row(p, seed=77, position=step) for p in others] + [row(me, seed=4, position=step)]
            tokens[name].append(sample(logits.expand(len(rows), -1).clone(), rows)[-1].token_id)
    assert all(t == tokens["alone"] for t in tokens.values()), tokens


# -- reproducibility -------------------------------------------------------------------------------

def _run_seeded(seed: int, companions: str | None, steps: int = 20, **kwargs) -> list[int]:
    """Sample `steps` tokens for one seeded request (at positions 30, 31, ...), alone or in a batch:
    'before' / 'after' another request (with a top-k: the batch takes the sort's path), 'greedy' beside
    a greedy row, 'crowd' at row 5 of 9 with assorted settings."""
    logits_g, others_g = torch.Generator().manual_seed(123), torch.Generator().manual_seed(321)
    me = row(SamplingParams(seed=seed, **kwargs), seed=seed, position=30)
    others = [row(SamplingParams(seed=99, top_k=5), seed=99, position=7)]
    if companions == "greedy":
        others = [row(SamplingParams(temperature=0), position=4)]
    if companions == "crowd":
        others = [row(SamplingParams(temperature=0.3 * (i + 1), top_p=0.9, min_p=0.01 * i), seed=1000 + i,
                      position=i) for i in range(8)]
    tokens = []
    for _ in range(steps):
        mine = torch.randn(64, generator=logits_g)
        theirs = torch.randn(len(others), 64, generator=others_g)
        if companions in ("before", "greedy"):
            res = sample(torch.cat([theirs, mine[None]]), others + [me])[-1]
        elif companions == "after":
            res = sample(torch.cat([mine[None], theirs]), [me] + others)[0]
        elif companions == "crowd":
            res = sample(torch.cat([theirs[:5], mine[None], theirs[5:]]), others[:5] + [me] + others[5:])[5]
        else:
            res = sample(mine[None].clone(), [me])[0]
        tokens.append(res.token_id)
        me.output_ids.append(res.token_id)
        me.position += 1
        for o in others:
            o.position += 1
    return tokens


@pytest.mark.parametrize("kwargs", [dict(), dict(top_p=0.9, temperature=0.7), dict(top_k=20, min_p=0.02)])
def test_seeded_tokens_are_reproducible_and_batch_independent(kwargs):
    """Same seed, same tokens, whether the request runs alone or next to others, at any row; another
    seed gives others (the test can fail)."""
    alone = _run_seeded(7, None, **kwargs)
    assert _run_seeded(7, None, **kwargs) == alone
    for companions in ("before", "after", "greedy", "crowd"):
        assert _run_seeded(7, companions, **kwargs) == alone, companions
    assert _run_seeded(8, None, **kwargs) != alone


def test_row_order_does_not_change_any_rows_token():
    """A batch of 16 seeded rows with assorted settings, shuffled: each row draws the same token."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 200, generator=g)
    settings = [dict(), dict(top_k=10), dict(top_p=0.8), dict(min_p=0.05, temperature=1.5)]
    rows = [row(SamplingParams(**settings[i % 4]), seed=i * 17, position=40 + i) for i in range(16)]
    want = [r.token_id for r in sample(logits.clone(), rows)]
    perm = torch.randperm(16, generator=g).tolist()
    got = [r.token_id for r in sample(logits[perm].clone(), [rows[i] for i in perm])]
    assert got == [want[i] for i in perm]
    # the position matters: one step later the same rows draw differently (the test can fail)
    for r in rows:
        r.position += 1
    assert [r.token_id for r in sample(logits.clone(), rows)] != want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_cpus_tokens():
    """The noise is integer-exact on both devices; the tokens agree but for near-ties of the float
    scores (about one draw in a million): at most one of 8,000 differs."""
    g = torch.Generator().manual_seed(0)
    V, S, steps = 4096, 64, 25
    settings = [dict(), dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_p=0.95), dict(min_p=0.05),
                dict(temperature=1.3, top_k=200)]
    keys = torch.tensor([row_key(i, 77) for i in range(S)])
    assert torch.equal(race_bits(keys.cuda(), None, V).cpu(), race_bits(keys, None, V))
    differ = total = 0
    for kwargs in settings:
        for step in range(steps):
            logits = torch.randn(S, V, generator=g) * 3
            rows = [row(SamplingParams(**kwargs), seed=i, position=step) for i in range(S)]
            cpu = [r.token_id for r in sample(logits.clone(), rows)]
            cuda = [r.token_id for r in sample(logits.cuda(), rows)]
            differ += sum(a != b for a, b in zip(cpu, cuda))
            total += S
    print(f"CPU and CUDA tokens differ in {differ} of {total} draws")
    assert differ <= 1
