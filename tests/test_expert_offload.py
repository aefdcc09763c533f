"""Expert offload (moekv/experts/offload.py): the cache's bookkeeping by hand, its compute against
fused_moe_ref, and the engine with a budget that forces offload against the all-resident engine."""
from __future__ import annotations

import logging

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import EngineConfig, default_model_path
from moekv.experts.offload import ExpertCache, slots_for_budget
from moekv.ops.reference import fused_moe_ref

TINY = default_model_path()
PROMPTS = ["It was a dark and stormy night", "The sea was calm and the ship", "Elizabeth said to her sister that"]


def small_cache(E=6, S=3, H=8, I=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen)
    w2 = torch.randn(E, H, I, generator=gen)
    return ExpertCache(0, w13, w2, S, torch.device("cpu")), w13, w2


def test_cache_bookkeeping_by_hand():
    cache, w13, w2 = small_cache()
    eb = (w13[0].numel() + w2[0].numel()) * 4
    assert cache.expert_bytes == eb
    cache.fill([0, 1, 2])
    assert cache.resident() == [0, 1, 2] and cache.bytes["initial"] == 3 * eb and cache.evictions == 0
    cache.ensure([1])  # hit; LRU order now 0, 2, 1
    assert (cache.hits, cache.misses) == (1, 0)
    cache.ensure([3])  # miss: evicts 0, the least recently used
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 1)
    assert cache.resident() == [2, 1, 3] and cache.slot_of[0] == -1 and cache.bytes["demand"] == eb
    cache.prefetch([4, 1])  # 4 evicts 2 (1 is predicted too), then 1 becomes the most recent
    assert cache.resident() == [3, 4, 1] and cache.bytes["prefetch"] == eb and cache.evictions == 2
    cache.ensure([4])  # a hit thanks to the prefetch
    assert (cache.hits, cache.prefetch_hits) == (2, 1)
    assert cache.resident() == [3, 1, 4]
    cache.prefetch([5])  # evicts 3
    assert cache.resident() == [1, 4, 5]
    cache.ensure([0, 1])  # 0 misses and evicts 4 (1 is protected), then 1 hits
    assert cache.resident() == [5, 0, 1]
    assert (cache.hits, cache.misses, cache.evictions, cache.prefetch_unused) == (3, 2, 4, 0)
    cache.finish()  # the computation that used 0 and 1 is over: 5 (prefetched for it, unused) is not incoming now
    cache.ensure([2, 3])  # two misses: evict 5 (prefetched, never used), then 0
    assert cache.prefetch_unused == 1 and cache.resident() == [1, 2, 3]
    # the slots hold the experts the map says
    for e in cache.resident():
        assert torch.equal(cache.w13[cache.slot_of[e]], w13[e]) and torch.equal(cache.w2[cache.slot_of[e]], w2[e])
    s = cache.stats()
    assert s["copies_demand"] == cache.misses and s["bytes_demand"] == cache.misses * eb
    assert s["evictions"] == s["copies_demand"] + s["copies_prefetch"]  # every slot was full from the start


@pytest.mark.parametrize("slots", [2, 3, 6])
def test_cache_compute_is_fused_moe_ref(slots):
    """Bitwise the reference on all experts, also when a step needs more experts than slots (rounds)."""
    cache, w13, w2 = small_cache(S=slots, seed=slots)
    cache.fill(list(range(slots)))
    gen = torch.Generator().manual_seed(7)
    for T in (1, 5, 40):
        x = torch.randn(T, 8, generator=gen)
        ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(T)])
        w = torch.softmax(torch.randn(T, 2, generator=gen), -1)
        assert torch.equal(cache(x, w, ids), fused_moe_ref(x, w13, w2, w, ids))
    assert cache.misses > 0 or slots == 6


def test_slots_for_budget():
    eb = 1 << 20
    assert slots_for_budget(4 * 4 * eb / 2**30, eb, 4, 16) == 4
    assert slots_for_budget(100.0, eb, 4, 16) == 16
    with pytest.raises(ValueError, match="holds no expert"):
        slots_for_budget(0.001, eb, 4096, 16)


def test_config_validates_offload_fields(tmp_path):
    with pytest.raises(ValueError, match="only apply with expert_offload"):
        EngineConfig(gpu_expert_budget_gb=1.0)
    with pytest.raises(ValueError, match="expert_cache_slots"):
        EngineConfig(expert_offload=True, expert_cache_slots=0)
    with pytest.raises(ValueError, match="gpu_expert_budget_gb"):
        EngineConfig(expert_offload=True, gpu_expert_budget_gb=-1)
    with pytest.raises(ValueError, match="expert_predictor"):
        EngineConfig(expert_predictor=tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="holds no expert"):
        LLM(model=TINY, dtype="float32", max_model_len=64, expert_offload=True, gpu_expert_budget_gb=1e-6)


@pytest.fixture(scope="module")
def resident():
    llm = LLM(model=TINY, dtype="float32", max_model_len=256)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)], llm.score(PROMPTS)


@pytest.mark.parametrize("prefetch", [True, False])
def test_offload_gives_the_all_resident_tokens_and_logits(resident, prefetch):
    tokens, logits = resident
    llm = LLM(model=TINY, dtype="float32", max_model_len=256, expert_offload=True, expert_cache_slots=4,
              expert_prefetch=prefetch)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == tokens
    for a, b in zip(llm.score(PROMPTS), logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops in the same order on the CPU
    s = llm.engine.runner.experts.stats()
    assert s["slots_per_layer"] == 4 and s["misses"] > 0 and s["evictions"] > 0
    assert s["bytes_demand"] == s["copies_demand"] * 3 * 192 * 256 * 4
    assert s["hits"] + s["misses"] > 0 and s["tokens"] > 0
    if prefetch:
        assert 0.3 < s["prediction_recall"] <= 1.0 and s["copies_prefetch"] > 0
        assert s["prefetch_hits"] + s["prefetch_unused"] <= s["copies_prefetch"]
    else:
        assert s["prediction_recall"] is None and s["copies_prefetch"] == 0


def test_offload_with_hierarchical_routing_and_a_fitted_predictor():
    """The routers (which copy router rows at install) and a predictor file work with offload: the
    tokens of the resident engine with the same routing."""
    root = TINY.parent.parent / "benchmarks" / "results" / "cpu"
    kw = dict(model=TINY, dtype="float32", max_model_len=128, routing="hierarchical",
              cluster_map=root / "tiny-moe.clusters4.safetensors")
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(PROMPTS, sp)]
    llm = LLM(**kw, expert_offload=True, expert_cache_slots=3, expert_predictor=root / "tiny-moe.experts.safetensors")
    offload = llm.engine.runner.experts
    for i, cache in offload.caches.items():  # the file's most frequent experts are loaded first
        freq = offload.predictor.frequency(i)
        assert sorted(cache.resident()) == sorted(freq.topk(3).indices.tolist())
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == want
    s = offload.stats()
    assert s["prediction_recall"] > 0.3 and s["copies_prefetch"] > 0


def test_prediction_cuts_demand_copies_and_budget_sets_slots():
    """The same requests at the same budget (given in GiB): prefetching the predicted experts
    leaves fewer misses than copying on demand only."""
    eb = 3 * 192 * 256 * 4
    budget = 4 * 4 * eb / 2**30  # 4 of 16 experts in each of the 4 MoE layers
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    misses = {}
    for prefetch in (True, False):
        llm = LLM(model=TINY, dtype="float32", max_model_len=256, expert_offload=True, gpu_expert_budget_gb=budget,
                  expert_prefetch=prefetch)
        llm.generate(PROMPTS, sp)
        s = llm.engine.runner.experts.stats()
        assert s["slots_per_layer"] == 4
        misses[prefetch] = s["misses"]
    assert misses[True] < misses[False]


def test_offload_runs_eagerly_and_says_why(caplog):
    from moekv.engine.model_runner import ModelRunner  # noqa: F401  (the runner logs on the 'moekv' logger)

    with caplog.at_level(logging.INFO, logger="moekv"):
        llm = LLM(model=TINY, dtype="float32", max_model_len=64, expert_offload=True)
    assert llm.engine.runner.graphs is None
    assert any("expert offload: 8 of 16 experts" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_copy_stream_matches_resident():
    """On CUDA: experts pinned on the host, copies on a side stream ordered by events; the tokens
    are those of the all-resident engine (bf16, same kernels on slot ids), with and without prefetch."""
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = LLM(model=TINY, dtype="bfloat16", device="cuda", max_model_len=256, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)]
    for prefetch in (True, False):
        llm = LLM(model=TINY, dtype="bfloat16", device="cuda", max_model_len=256, expert_offload=True,
                  expert_cache_slots=4, expert_prefetch=prefetch)
        assert llm.engine.runner.graphs is None
        cache = next(iter(llm.engine.runner.experts.caches.values()))
        assert cache.host_w13.is_pinned() and cache.w13.is_cuda and cache.copy_stream is not None
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == want
        assert llm.engine.runner.experts.stats()["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cache_orders_copies_with_events():
    """A cache on CUDA: prefetch records a ready event per copied slot; the MoE's lookup makes the
    compute stream wait for it (and clears it); results match fused_moe_ref on the host weights,
    also with rounds (more experts than slots)."""
    gen = torch.Generator().manual_seed(0)
    E, S, H, I = 8, 3, 64, 32
    w13 = torch.randn(E, 2 * I, H, generator=gen).pin_memory()
    w2 = torch.randn(E, H, I, generator=gen).pin_memory()
    dev = torch.device("cuda")
    cache = ExpertCache(0, w13, w2, S, dev, torch.cuda.Stream(dev))
    cache.fill([0, 1, 2])
    cache.prefetch([5, 6])
    assert all(cache.slot_ready[cache.slot_of[e]] is not None for e in (5, 6))
    cache.ensure([5])
    assert cache.slot_ready[cache.slot_of[5]] is None and cache.slot_ready[cache.slot_of[6]] is not None
    for T in (1, 4, 64):
        x = torch.randn(T, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
        w = torch.softmax(torch.randn(T, 2, generator=gen), -1)
        got = cache(x.to(dev), w.to(dev), ids.to(dev)).cpu()
        torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), rtol=2e-3, atol=2e-3)
