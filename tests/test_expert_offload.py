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

MODEL = default_model_path()
# one expert of the shipped model in float32: w1, w3 and w2, each intermediate 176 x hidden 256
EXPERT_BYTES = 3 * 176 * 256 * 4
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
        LLM(model=MODEL, dtype="float32", max_model_len=64, expert_offload=True, gpu_expert_budget_gb=1e-6)


@pytest.fixture(scope="module")
def resident():
    llm = LLM(model=MODEL, dtype="float32", max_model_len=256)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)], llm.score(PROMPTS)


@pytest.mark.parametrize("prefetch", [True, False])
def test_offload_gives_the_all_resident_tokens_and_logits(resident, prefetch):
    tokens, logits = resident
    llm = LLM(model=MODEL, dtype="float32", max_model_len=256, expert_offload=True, expert_cache_slots=4,
              expert_prefetch=prefetch)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == tokens
    for a, b in zip(llm.score(PROMPTS), logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops in the same order on the CPU
    s = llm.engine.runner.experts.stats()
    assert s["slots_per_layer"] == 4 and s["misses"] > 0 and s["evictions"] > 0
    assert s["bytes_demand"] == s["copies_demand"] * EXPERT_BYTES
    assert s["hits"] + s["misses"] > 0 and s["tokens"] > 0
    if prefetch:
        assert 0.3 < s["prediction_recall"] <= 1.0 and s["copies_prefetch"] > 0
        assert s["prefetch_hits"] + s["prefetch_unused"] <= s["copies_prefetch"]
    else:
        assert s["prediction_recall"] is None and s["copies_prefetch"] == 0


def test_offload_with_hierarchical_routing_and_a_fitted_predictor():
    """The routers (which copy router rows at install) and a predictor file work with offload: the
    tokens of the resident engine with the same routing."""
    root = MODEL.parent.parent / "benchmarks" / "results" / "cpu"
    kw = dict(model=MODEL, dtype="float32", max_model_len=128, routing="hierarchical",
              cluster_map=root / "domain-moe.clusters4.safetensors")
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(PROMPTS, sp)]
    llm = LLM(**kw, expert_offload=True, expert_cache_slots=3, expert_predictor=root / "domain-moe.experts.safetensors")
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
    budget = 4 * 4 * EXPERT_BYTES / 2**30  # 4 of 16 experts in each of the 4 MoE layers
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    misses = {}
    for prefetch in (True, False):
        llm = LLM(model=MODEL, dtype="float32", max_model_len=256, expert_offload=True, gpu_expert_budget_gb=budget,
                  expert_prefetch=prefetch)
        llm.generate(PROMPTS, sp)
        s = llm.engine.runner.experts.stats()
        assert s["slots_per_layer"] == 4
        misses[prefetch] = s["misses"]
    assert misses[True] < misses[False]


def test_offload_runs_eagerly_and_says_why(caplog):
    from moekv.engine.model_runner import ModelRunner  # noqa: F401  (the runner logs on the 'moekv' logger)

    with caplog.at_level(logging.INFO, logger="moekv"):
        llm = LLM(model=MODEL, dtype="float32", max_model_len=64, expert_offload=True)
    assert llm.engine.runner.graphs is None
    assert any("expert offload: 8 of 16 experts" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_copy_stream_matches_resident():
    """On CUDA: experts pinned on the host, copies on a side stream ordered by events; the tokens
    are those of the all-resident engine (bf16, same kernels on slot ids), with and without prefetch."""
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)]
    for prefetch in (True, False):
        llm = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, expert_offload=True,
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


# -- lookahead and the sync-free prediction read -------------------------------------------------
class FakeEvent:
    """A prediction's copy event that the test completes by hand: query() says whether it is done,
    synchronize() is the host waiting for it."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waits, self.queries = done, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


class TablePredictor:
    """Scores naming fixed experts per target layer (the residual ignored), so the test knows what
    each prediction asks for; records which layers were predicted."""

    def __init__(self, table: dict, num_experts: int, top_k: int = 2) -> None:
        self.table, self.num_experts, self.top_k, self.calls = table, num_experts, top_k, []

    def scores(self, layer_idx, residual):
        self.calls.append(layer_idx)
        s = torch.zeros(residual.shape[0], self.num_experts)
        for rank, e in enumerate(self.table[layer_idx]):
            s[:, e] = 10.0 - rank
        return s


def three_layer_offload(lookahead, sync_free, E=6, S=3):
    from moekv.experts.offload import ExpertOffload

    caches, weights = {}, {}
    for i in range(3):
        cache, w13, w2 = small_cache(E=E, S=S, seed=10 + i)
        cache.layer_idx = i
        cache.fill(list(range(S)))
        caches[i], weights[i] = cache, (w13, w2)
    table = {0: [3, 4], 1: [4, 5], 2: [3, 5]}
    offload = ExpertOffload(caches, TablePredictor(table, E), lookahead=lookahead, sync_free=sync_free)
    return offload, caches, weights, table


def moe_step(cache, weights, experts, seed=0):
    """One MoE computation of one token routed to `experts`, checked bitwise against the reference."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 8, generator=gen)
    ids = torch.tensor([experts])
    w = torch.softmax(torch.randn(1, len(experts), generator=gen), -1)
    assert torch.equal(cache(x, w, ids), fused_moe_ref(x, *weights, w, ids))


@pytest.mark.parametrize("done_by", ["moe", "hook"])
def test_sync_free_lookahead_2_bookkeeping(done_by):
    """Lookahead 2, sync-free, the copy events simulated: layer 0 is predicted at its own hook and
    dropped (not done there: late); layer t >= 1 is predicted at hook t - 1 and acted on after MoE
    t - 1 if its event is done by then ('moe'), else waited for at hook t ('hook'); either way the
    predicted experts are resident before MoE t, which then hits."""
    offload, caches, weights, table = three_layer_offload(lookahead=2, sync_free=True)
    assert offload.targets_at == {0: [0, 1], 1: [2]}
    events = []

    def new_event():
        events.append(FakeEvent())
        return events[-1]

    offload._cpu_event = new_event
    x = torch.randn(1, 8)
    offload(0, x, None)
    assert offload.predictor.calls == [0, 1] and len(events) == 2
    assert offload.predictions == {"made": 2, "acted": 0, "late": 1, "waited": 0}
    assert list(offload.pending) == [1] and offload.pending[1].made_at == 0
    assert caches[1].copies["prefetch"] == 0 and caches[1].resident() == [0, 1, 2]
    if done_by == "moe":
        events[1].done = True
    moe_step(caches[0], weights[0], [3, 4])  # not prefetched (late): two misses
    assert (caches[0].hits, caches[0].misses, caches[0].copies["prefetch"]) == (0, 2, 0)
    if done_by == "moe":  # acted on by the poll after MoE 0
        assert not offload.pending and set(table[1]) <= set(caches[1].resident())
        assert caches[1].incoming == set(table[1]) - {0, 1, 2}
    else:
        assert list(offload.pending) == [1] and caches[1].copies["prefetch"] == 0
    offload(1, x, None)  # predicts layer 2; layer 1's prediction is resolved now at the latest
    assert offload.predictor.calls == [0, 1, 2]
    assert events[1].waits == (1 if done_by == "hook" else 0)
    assert set(table[1]) <= set(caches[1].resident()) and list(offload.pending) == [2]
    if done_by == "moe":
        events[2].done = True
    moe_step(caches[1], weights[1], [4, 5])
    assert (caches[1].hits, caches[1].misses, caches[1].prefetch_hits) == (2, 0, 2) and not caches[1].incoming
    offload(2, x, None)
    assert not offload.pending and set(table[2]) <= set(caches[2].resident())
    moe_step(caches[2], weights[2], [3, 5])
    assert (caches[2].hits, caches[2].misses) == (2, 0)
    waited = 2 if done_by == "hook" else 0
    assert offload.predictions == {"made": 3, "acted": 2, "late": 1, "waited": waited}
    s = offload.stats()
    assert (s["predictions_late"], s["predictions_waited"], s["evicted_incoming"]) == (1, waited, 0)
    assert (s["lookahead"], s["sync_free"]) == (2, True)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_sync_free_with_events_done_at_once_is_the_sync_path(lookahead):
    """With every copy event done when first asked, the sync-free path prefetches what the
    host-sync path does, step by step: the same residents, copies and hits."""
    runs = {}
    for sync_free in (False, True):
        offload, caches, weights, _ = three_layer_offload(lookahead, sync_free)
        offload._cpu_event = lambda: FakeEvent(done=True)
        trace = []
        for step, routed in enumerate(([3, 4], [4, 5], [0, 5])):
            for i in range(3):
                offload(i, torch.randn(1, 8), None)
                trace.append(list(caches[i].resident()))
                moe_step(caches[i], weights[i], routed, seed=step)
        runs[sync_free] = (trace, {k: v for k, v in offload.stats().items() if k not in ("layers", "sync_free")})
        assert offload.predictions["late"] == offload.predictions["waited"] == 0
    assert runs[True] == runs[False]


def test_sync_free_lookahead_1_not_done_is_on_demand():
    """Lookahead 1, sync-free, events never done at the hook: every prediction is late (nothing is
    waited for or prefetched) and the misses are those of on-demand offload."""
    offload, caches, weights, _ = three_layer_offload(lookahead=1, sync_free=True)
    offload._cpu_event = FakeEvent
    plain, plain_caches, _, _ = three_layer_offload(lookahead=1, sync_free=False)
    plain.predictor = None  # on demand
    for step, routed in enumerate(([3, 4], [4, 5])):
        for i in range(3):
            for off, cs in ((offload, caches), (plain, plain_caches)):
                off(i, torch.randn(1, 8), None)
                moe_step(cs[i], weights[i], routed, seed=step)
    assert offload.predictions == {"made": 6, "acted": 0, "late": 6, "waited": 0}
    for i in range(3):
        assert caches[i].copies["prefetch"] == 0
        assert (caches[i].hits, caches[i].misses) == (plain_caches[i].hits, plain_caches[i].misses)


def test_incoming_prefetch_is_evicted_last():
    """An expert prefetched for the next computation and not used yet (its copy may be in flight)
    is evicted by a miss only when every other slot holds an expert the computation needs."""
    cache, _, _ = small_cache(E=8, S=3)
    cache.fill([0, 1, 2])
    cache.prefetch([3])  # evicts 0
    assert cache.incoming == {3} and cache.resident() == [1, 2, 3]
    cache.ensure([4, 5])  # two misses: 1 and 2 go, the incoming 3 (least protected by LRU order alone) stays
    assert cache.resident() == [3, 4, 5] and cache.evicted_incoming == 0
    cache.ensure([4, 5, 6])  # 4 and 5 hit; 6 needs a slot and only the incoming 3 is not needed: evicted
    assert cache.resident() == [4, 5, 6] and cache.evicted_incoming == 1 and not cache.incoming
    assert cache.prefetch_unused == 1
    cache.prefetch([7])
    cache.ensure([7])  # used: no longer incoming
    assert not cache.incoming and cache.prefetch_hits == 1
    cache.prefetch([0])
    cache.finish()  # the computation is over: the unused prefetch is no longer incoming
    assert not cache.incoming and 0 in cache.fresh


@pytest.mark.parametrize("lookahead,sync_free,events", [(2, False, "none"), (1, True, "late"), (2, True, "late"),
                                                        (2, True, "none")])
def test_offload_lookahead_and_sync_free_give_the_all_resident_tokens(resident, monkeypatch, lookahead, sync_free,
                                                                      events):
    """The engine with 4 of 16 experts resident, prediction lookahead 1 or 2, with or without the
    sync-free read; 'late': each copy event reports done from its second query on (so a prediction
    made at a hook is not ready at that hook's poll). Tokens and logits are the all-resident ones."""
    from moekv.experts.offload import ExpertOffload

    class SecondQuery(FakeEvent):
        def query(self) -> bool:
            self.queries += 1
            return self.queries > 1

    if events == "late":
        monkeypatch.setattr(ExpertOffload, "_cpu_event", lambda self: SecondQuery())
    tokens, logits = resident
    llm = LLM(model=MODEL, dtype="float32", max_model_len=256, expert_offload=True, expert_cache_slots=4,
              expert_prefetch_lookahead=lookahead, expert_prefetch_async=sync_free)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == tokens
    for a, b in zip(llm.score(PROMPTS), logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    off = llm.engine.runner.experts
    s = off.stats()
    assert (s["lookahead"], s["sync_free"]) == (lookahead, sync_free)
    assert s["predictions_made"] == s["predictions_acted"] + s["predictions_late"] and s["predictions_waited"] == 0
    assert s["misses"] > 0 and s["prediction_recall"] is not None
    n_layers = len(off.caches)
    assert s["predictions_made"] % n_layers == 0  # every forward pass predicts every MoE layer once
    if events == "none":
        assert s["predictions_late"] == 0 and s["copies_prefetch"] > 0
    elif lookahead == 1:  # predicted at the layer's own hook: never ready there
        assert s["predictions_acted"] == 0 and s["copies_prefetch"] == 0
    else:  # only the first layer (predicted at its own hook) is late; the rest are read after the MoE before
        assert s["predictions_late"] == s["predictions_made"] // n_layers and s["copies_prefetch"] > 0


def test_config_validates_lookahead_and_async():
    with pytest.raises(ValueError, match="expert_prefetch_lookahead"):
        EngineConfig(expert_offload=True, expert_prefetch_lookahead=0)
    with pytest.raises(ValueError, match="expert_prefetch_async"):
        EngineConfig(expert_offload=True, expert_prefetch_async="yes")
    with pytest.raises(ValueError, match="only apply with expert_offload"):
        EngineConfig(expert_prefetch_lookahead=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sync_free_lookahead_matches_resident():
    """On CUDA: lookahead 1 and 2, with the sync-free read (pinned buffer, event on the read
    stream) and without; the tokens are those of the all-resident engine."""
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)]
    for lookahead, sync_free in ((2, True), (1, True), (2, False)):
        llm = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, expert_offload=True,
                  expert_cache_slots=4, expert_prefetch_lookahead=lookahead, expert_prefetch_async=sync_free)
        off = llm.engine.runner.experts
        assert (off.read_stream is not None) == sync_free
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == want, (lookahead, sync_free)
        s = off.stats()
        assert s["predictions_made"] == s["predictions_acted"] + s["predictions_late"]
        if lookahead == 2:
            assert s["predictions_acted"] > 0 and s["copies_prefetch"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sync_free_hook_never_syncs():
    """The sync-free hook (prediction, device -> pinned copy on the read stream, event, poll and the
    prefetch copies it starts) runs under torch's sync debug mode set to 'error': no host sync.
    The host buffer then holds what the device computed."""
    llm = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, expert_offload=True,
              expert_cache_slots=4, expert_prefetch_lookahead=2, expert_prefetch_async=True)
    off = llm.engine.runner.experts
    H = llm.engine.runner.model.config.hidden_size
    x = torch.randn(3, H, device="cuda", dtype=torch.bfloat16)
    off(1, x, None)  # warm-up: allocates the pinned buffer
    torch.cuda.synchronize()
    off.poll()
    target = off.targets_at[1][0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        off(1, x, None)
        pending = off.pending.get(target)
        off.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if pending is not None:  # not done at the hook's poll: done now
        assert isinstance(pending.event, torch.cuda.Event) and pending.host.is_pinned()
        off.poll()
    assert target not in off.pending
    want = off._predict(target, x).cpu()
    assert torch.equal(off._buffers[target], want)
