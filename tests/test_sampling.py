"""SamplingParams validation and the sampler (small CPU tensors, no model)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from moekv.layers.sampler import SamplingRow, sample
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

def row(params: SamplingParams, seed: int = 0, prompt=(), output=(), blocked=()) -> SamplingRow:
    return SamplingRow(params, torch.Generator().manual_seed(seed), list(prompt), list(output), list(blocked))


def flat_logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    """Nearly uniform logits with a unique argmax: an unfiltered draw rarely picks the best token."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(vocab, generator=g) * 0.1


def test_greedy_picks_argmax():
    """temperature 0 returns the argmax of each row, with its raw logprob."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    res = sample(logits.clone(), [row(SamplingParams(temperature=0), seed=i) for i in range(6)])
    assert [r.token_id for r in res] == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits, -1)
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(float(lp[i, r.token_id]))
        assert r.top_logprobs is None


def test_top_k_one_always_picks_argmax():
    """top_k=1 at temperature 1 keeps only the best token, whatever the generator draws."""
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


def _run_seeded(seed: int, companion: str | None, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded request, optionally batched with another request."""
    logits_g = torch.Generator().manual_seed(123)
    me = row(SamplingParams(seed=seed), seed=seed)
    other = row(SamplingParams(seed=99, top_k=5), seed=99) if companion else None
    tokens = []
    for _ in range(steps):
        mine = torch.randn(64, generator=logits_g)
        theirs = torch.randn(64, generator=logits_g)
        if companion == "before":
            res = sample(torch.stack([theirs, mine]), [other, me])[1]
        elif companion == "after":
            res = sample(torch.stack([mine, theirs]), [me, other])[0]
        else:
            res = sample(mine[None].clone(), [me])[0]
        tokens.append(res.token_id)
        me.output_ids.append(res.token_id)
    return tokens


def test_seeded_generator_is_reproducible_and_batch_independent():
    """Same seed, same tokens, whether the request runs alone or next to another one."""
    alone = _run_seeded(7, None)
    assert _run_seeded(7, None) == alone
    assert _run_seeded(7, "before") == alone
    assert _run_seeded(7, "after") == alone
    assert _run_seeded(8, None) != alone  # the seed matters (the test can fail)


def test_blocked_ids_are_never_sampled():
    """Blocked tokens (min_tokens' stop tokens) are never drawn, even when they are the likeliest."""
    x = torch.zeros(8)
    x[[2, 5]] = 5.0  # together ~99% of the mass
    blocked = [2, 5]
    rows = [row(SamplingParams(), seed=i, blocked=blocked) for i in range(300)]
    got = {r.token_id for r in sample(x.expand(300, -1).clone(), rows)}
    assert not got & set(blocked) and len(got) > 3
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


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


P3 = [0.2, 0.3, 0.5]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), P3),
    (dict(temperature=0.5), [p * p / sum(q * q for q in P3) for p in P3]),  # p^(1/T), renormalized
    (dict(top_k=2), [0.0, 0.375, 0.625]),
    (dict(top_p=0.6), [0.0, 0.375, 0.625]),  # smallest set with mass >= 0.6: {0.5, 0.3}
    (dict(min_p=0.5), [0.0, 0.375, 0.625]),  # keeps p >= 0.25
])
def test_sampled_frequencies_match_distribution(kwargs, expected):
    """Over 4000 seeded draws from a known 3-token distribution, frequencies fit (chi-square)."""
    n = 4000
    logits = torch.tensor(P3).log().expand(n, -1).clone()
    gen = torch.Generator().manual_seed(2024)
    rows = [SamplingRow(SamplingParams(**kwargs), gen, [], [], []) for _ in range(n)]
    counts = [0, 0, 0]
    for r in sample(logits, rows):
        counts[r.token_id] += 1
    for c, p in zip(counts, expected):
        if p == 0:
            assert c == 0
    nonzero = sum(p > 0 for p in expected)
    # 99.9% critical values of chi-square with 1 and 2 degrees of freedom
    assert _chi_square(counts, expected) < {2: 10.83, 3: 13.82}[nonzero], counts


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
