"""tiered: pages start in FP8, the cold ones move to nuq2 at re-ranking, nothing leaks."""
from __future__ import annotations

import pytest

from moekv import LLM, SamplingParams
from moekv.kvcache.formats.tiered import TIER_FP8, TIER_LOW, TIER_NONE

PROMPT = {"prompt_token_ids": [(7 * i) % 300 + 2 for i in range(150)]}


@pytest.fixture(scope="module")
def llm(mixtral_ckpt):
    return LLM(mixtral_ckpt, dtype="float32", kv_cache_dtype="tiered", max_model_len=256, block_size=32,
               kv_rerank_interval=4, kv_tier1_fraction=0.15)


def test_pages_move_down_and_all_return(llm):
    engine = llm.engine
    engine.add_request("t", PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.add_request("u", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    seen_low = False
    while engine.has_unfinished_requests():
        engine.step()
        for cache in engine.runner.kv_caches:
            st = cache.state
            fp8_used = [p for p, t in enumerate(st.tier) if t == TIER_FP8]
            # every FP8 page owns exactly one FP8 slot, and slots are never shared or also free
            slots = [st.fp8_slot[p] for p in fp8_used]
            assert len(set(slots)) == len(slots) and not set(slots) & set(st.free_fp8)
            assert len(slots) + len(st.free_fp8) == st.scratch_fp8  # the pool (its last slot is scratch)
            seen_low |= TIER_LOW in st.tier
            for seq in engine.scheduler.running:  # sink and newest full page stay in FP8
                full = seq.block_table[:seq.num_computed_tokens // 32]
                if len(full) > 2 and st.steps % 4 == 0:
                    assert st.tier[full[0]] == TIER_FP8 and st.tier[full[-1]] == TIER_FP8
    assert seen_low, "no page was ever demoted to nuq2"
    engine.runner.release_pages(engine.block_manager.drain_freed())
    for cache in engine.runner.kv_caches:
        assert set(cache.state.tier) == {TIER_NONE}
        assert len(cache.state.free_fp8) == cache.state.scratch_fp8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tiered_generation_tracks_fp8(mixtral_ckpt, llm):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fp8 = LLM(mixtral_ckpt, dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=256, block_size=32)
    a = fp8.generate([PROMPT], sp)[0].outputs[0].token_ids
    b = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    assert a[:4] == b[:4]


def test_bits_between_the_two_tiers(llm):
    fmt = llm.engine.runner.kv_format
    bits = fmt.bits_per_element(2, 32, 16)
    assert fmt.lo.bits_per_element(2, 32, 16) < bits < fmt.hi.bits_per_element(2, 32, 16)


# -- CUDA-graph hooks (the host-side bookkeeping a replay skips) ------------------------------------
def _host_state(cache) -> dict:
    """A copy of a layer's host-side page state: every TieredState field but the device tensors."""
    import copy
    import dataclasses

    import torch

    return {f.name: copy.deepcopy(getattr(cache.state, f.name)) for f in dataclasses.fields(cache.state)
            if not isinstance(getattr(cache.state, f.name), torch.Tensor)}


def _decode_ctx(context_len: int, graph_step: bool = False, block_size: int = 16):
    """One sequence's decode step (pages 0-4, staging slot 0), filling no page."""
    import torch

    from moekv.context import Context

    assert context_len % block_size
    return Context(positions=torch.tensor([context_len - 1]), slot_mapping=torch.tensor([0]),
                   block_tables=torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32),
                   context_lens=torch.tensor([context_len], dtype=torch.int32),
                   query_start_loc=torch.tensor([0, 1], dtype=torch.int32), logits_indices=torch.tensor([0]),
                   seq_slots=torch.tensor([0]), max_query_len=1, fills_no_page=True, graph_step=graph_step)


def _tiered_layers(rerank_interval: int, num_layers: int = 2):
    import torch

    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page", rerank_interval=rerank_interval)
    caches = [fmt.allocate(8, 1, 16, 16, torch.device("cpu"), 2, torch.float32) for _ in range(num_layers)]
    for layer, cache in enumerate(caches):
        cache.layer = layer
    reranks = []
    rerank = fmt._rerank

    def recording(cache, host):
        reranks.append((cache.layer, cache.state.steps))
        rerank(cache, host)

    fmt._rerank = recording
    return fmt, caches, reranks


@pytest.mark.parametrize("rerank_interval", [1, 4, 5])
def test_graph_replays_keep_the_eager_rerank_schedule(rerank_interval):
    """The runner calls prepare_graph_step before every replay (re-ranking steps too) and
    after_graph_replay after it; the layers must count steps and re-rank exactly as all-eager steps
    do. A replay that fails after its step was prepared runs eagerly: that step is not counted or
    re-ranked twice."""
    import torch

    k = torch.zeros(1, 1, 16)
    eager_fmt, eager_caches, eager_reranks = _tiered_layers(rerank_interval)
    fmt, caches, reranks = _tiered_layers(rerank_interval)
    failed_at = {3, 7}  # the replays of these steps fail (steps 4 and 8: re-ranking steps at 4)
    for step in range(23):
        ctx_len = 17 + step % 10  # decode steps of one sequence, never filling page 1
        for cache in eager_caches:
            eager_fmt.write(cache, k, k, _decode_ctx(ctx_len))
        assert fmt.prepare_graph_step(caches, _decode_ctx(ctx_len).host_lists(), [], [])
        if step in failed_at:  # the runner's fallback: the same step, eagerly
            for cache in caches:
                fmt.write(cache, k, k, _decode_ctx(ctx_len))
        else:  # a replay: the graph step's device work (write counts nothing), then the hook
            for cache in caches:
                fmt.write(cache, k, k, _decode_ctx(ctx_len, graph_step=True))
            fmt.after_graph_replay(caches)
        assert [c.state.steps for c in caches] == [c.state.steps for c in eager_caches] == [step + 1] * 2
        assert not any(c.state.counted_ahead for c in caches)
    assert reranks == eager_reranks
    assert [s for layer, s in eager_reranks if layer == 0] == list(range(rerank_interval, 24, rerank_interval))


def test_after_graph_replay_flags_the_mass_of_every_layer():
    fmt, caches, _ = _tiered_layers(32, num_layers=3)
    caches[1].state.steps = 7
    for c in caches:
        c.state.counted_ahead = True
    fmt.after_graph_replay(caches)
    assert [c.state.steps for c in caches] == [0, 7, 0]  # counted before the replay, not here
    assert all(c.state.mass_pending and not c.state.counted_ahead for c in caches)


def test_graph_steps_leave_the_host_state_alone():
    """Warm-up and capture run the step with ctx.graph_step (here at a step that would re-rank):
    the staging gets the token, and nothing else changes: no step counted, no re-ranking, no tier,
    slot or mass touched."""
    import torch

    fmt, caches, reranks = _tiered_layers(4, num_layers=1)
    cache = caches[0]
    cache.state.steps = 3
    cache.state.mass = [float(i) for i in range(8)]
    before = _host_state(cache)
    k = torch.randn(1, 1, 16)
    fmt.write(cache, k, 2 * k, _decode_ctx(21, graph_step=True))
    assert _host_state(cache) == before
    assert not reranks
    staged = lambda x: x[0].to(cache["k_staging"].dtype)  # noqa: E731
    assert torch.equal(cache["k_staging"][0, :, 20 % 16], staged(k))
    assert torch.equal(cache["v_staging"][0, :, 20 % 16], staged(2 * k))
    fmt.write(cache, k, k, _decode_ctx(21))  # the same step eagerly: counted, and it re-ranks
    assert cache.state.steps == 4 and reranks == [(0, 4)]


def test_demoting_pages_in_one_batch_matches_one_at_a_time():
    """A re-ranking demotes its pages in one batch; each page's nuq2 slab, tier and freed FP8 slot
    must be what demoting it alone gives."""
    import torch

    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page")
    H, P, D = 2, 16, 32
    caches = [fmt.allocate(8, H, P, D, torch.device("cpu"), 2, torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    pages = [{"k": torch.randn(H, P, D, generator=g), "v": torch.randn(H, P, D, generator=g)} for _ in range(5)]
    for cache in caches:
        fmt._store_pages(cache, [(page, kv, []) for page, kv in enumerate(pages)])
    fmt._demote(caches[0], [3, 0, 4])
    for page in (3, 0, 4):
        fmt._demote(caches[1], [page])
    for name in ("k_low", "v_low", "k_fp8", "v_fp8"):
        assert torch.equal(caches[0][name], caches[1][name]), name
    for key in ("tier", "fp8_slot"):
        assert getattr(caches[0].state, key) == getattr(caches[1].state, key)
    assert sorted(caches[0].state.free_fp8) == sorted(caches[1].state.free_fp8)
    assert [caches[0].state.tier[p] for p in range(5)] == [TIER_LOW, TIER_FP8, TIER_FP8, TIER_LOW, TIER_LOW]
    assert caches[0]["k_low"][[0, 3, 4]].abs().sum() > 0


def test_storing_pages_in_one_batch_chooses_what_one_at_a_time_chooses():
    """A prefill fills many pages in one write; their tiers are chosen page by page as storing them
    one at a time would, and quantized in bulk. With an FP8 pool too small for them (3 slots, 6 pages
    of one sequence, then 2 of another): the same tiers, slots and free list; FP8 slabs alike; pages
    demoted by a later page of their own batch go to nuq2 from their own values (one at a time they
    went through FP8 first), and pages of an earlier batch demoted now are re-encoded from FP8,
    read before this batch's pages take over their slots."""
    import torch

    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page")
    H, P, D = 2, 16, 32
    caches = [fmt.allocate(8, H, P, D, torch.device("cpu"), 1, torch.float32) for _ in range(2)]
    assert len(caches[0].state.free_fp8) == 3
    g = torch.Generator().manual_seed(5)
    kv = lambda: {"k": torch.randn(H, P, D, generator=g), "v": torch.randn(H, P, D, generator=g)}  # noqa: E731
    seq_a = [(page, kv(), list(range(page + 1))) for page in range(6)]
    seq_b = [(6 + i, kv(), [6, 6 + i][:i + 1]) for i in range(2)]
    for batch in (seq_a, seq_b):
        fmt._store_pages(caches[0], batch)
        for item in batch:
            fmt._store_pages(caches[1], [item])
        for cache in caches:  # attention's mass on the first batch's pages: the second demotes by it
            cache.state.mass[0], cache.state.mass[4], cache.state.mass[5] = 5.0, 1.0, 0.5
    batched, single = caches
    for key in ("tier", "fp8_slot", "free_fp8"):
        assert getattr(batched.state, key) == getattr(single.state, key), key
    tiers = batched.state.tier
    # one at a time: pages 1, 2, 3 made room for 3, 4, 5; then the coldest, 5 and 4, for 6 and 7
    assert [p for p, t in enumerate(tiers) if t == TIER_FP8] == [0, 6, 7]
    for name in ("k_fp8", "v_fp8"):
        assert torch.equal(batched[name], single[name]), name
    data = {page: kv for page, kv, _ in seq_a + seq_b}
    for name, kind in (("k_low", "key"), ("v_low", "value")):
        layout = fmt.hi.layout(kind, P, D)
        for page in (4, 5):  # stored by the first batch, demoted by the second: re-encoded from FP8
            fp8 = fmt.hi.dequantize(layout.unpack(fmt.hi.quantize_packed(data[page][name[0]][None], kind)), kind)
            assert torch.equal(batched[name][page], fmt.lo.quantize_packed(fp8, kind)[0]), (name, page)
            assert torch.equal(batched[name][page], single[name][page]), (name, page)
        for page in (1, 2, 3):  # demoted inside their own batch: straight from their values
            direct = fmt.lo.quantize_packed(data[page][name[0]][None], kind)[0]
            assert torch.equal(batched[name][page], direct), (name, page)
            assert not torch.equal(single[name][page], direct)  # (one at a time: FP8, then nuq2)


def test_a_decode_step_that_fills_pages_stores_what_the_general_path_stores():
    """Decode steps whose tokens complete pages stage with one indexed copy and store the full
    staging pages; the general (prefill) path, which stages sequence by sequence, must leave the
    same staging, slabs and page state. Run as a step with host lists and as one without (the
    tables read back from the device)."""
    import torch

    from moekv.context import Context, HostLists
    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page", rerank_interval=10 ** 6)
    H, P, D, B = 2, 16, 32, 4
    lens = [2 * P, P + 3, 3 * P, P]  # sequences 0, 2 and 3 complete a page with this step's token
    tables = [[4 * b + i for i in range(4)] for b in range(B)]
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(B, H, D, generator=g), torch.randn(B, H, D, generator=g)
    results = []
    for max_query_len, host in ((1, True), (1, False), (None, True)):  # (None: the general path)
        cache = fmt.allocate(16, H, P, D, torch.device("cpu"), B, torch.float32)
        torch.manual_seed(0)
        cache["k_staging"].copy_(torch.randn(cache["k_staging"].shape))  # earlier tokens of each page
        cache["v_staging"].copy_(torch.randn(cache["v_staging"].shape))
        ctx = Context(positions=torch.tensor([n - 1 for n in lens]), slot_mapping=torch.zeros(B, dtype=torch.long),
                      block_tables=torch.tensor(tables, dtype=torch.int32),
                      context_lens=torch.tensor(lens, dtype=torch.int32),
                      query_start_loc=torch.arange(B + 1, dtype=torch.int32), logits_indices=torch.arange(B),
                      seq_slots=torch.arange(B), max_query_len=max_query_len, fills_no_page=False,
                      host=HostLists(lens, list(range(B + 1)), list(range(B)), tables) if host else None)
        fmt.write(cache, k, v, ctx)
        results.append(cache)
    want = results[-1]
    assert [want.state.tier[t[n // P - 1]] for t, n in zip(tables, lens) if n % P == 0] == [TIER_FP8] * 3
    for got in results[:-1]:
        for name in ("k_staging", "v_staging", "k_fp8", "v_fp8", "k_low", "v_low"):
            assert torch.equal(got[name], want[name]), name
        for key in ("tier", "fp8_slot", "free_fp8"):
            assert getattr(got.state, key) == getattr(want.state, key), key


def test_prepare_graph_step_chooses_fill_slots_or_leaves_the_state_as_it_was():
    """Before a replayed step that fills pages, the FP8 slots are chosen on the host (demoting the
    coldest pages, re-encoded at once) and put where the captured write reads them. When a later
    fill would demote an earlier fill of the same step (a page for nuq2, which the captured step
    cannot write), nothing changes and the step must run eagerly."""
    import torch

    from moekv.context import HostLists
    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page")
    H, P, D = 2, 16, 32
    g = torch.Generator().manual_seed(9)
    kv = lambda: {"k": torch.randn(H, P, D, generator=g), "v": torch.randn(H, P, D, generator=g)}  # noqa: E731
    for hot, want in ((5.0, False), (0.0, True)):
        cache = fmt.allocate(32, H, P, D, torch.device("cpu"), 2, torch.float32)  # (2 sequences)
        st = cache.state
        fmt._store_pages(cache, [(p, kv(), [p]) for p in range(st.scratch_fp8)])  # the pool full
        for p in range(st.scratch_fp8):
            st.mass[p] = hot
        before = (list(st.tier), list(st.fp8_slot), list(st.free_fp8), cache["k_low"].clone())
        # fills of pages 20 and 21 (two sequences whose first pages are 30 and 31)
        host = HostLists([32, 32], [0, 1, 2], [0, 1], [[30, 20], [31, 21]])  # (P = 16)
        assert fmt.prepare_graph_step([cache], host, [20, 21], [30, 31]) is want
        if not want:  # page 20 (no mass yet) would be the coldest when 21 needs a slot
            assert (st.tier, st.fp8_slot, st.free_fp8) == before[:3]
            assert st.steps == 0 and not st.counted_ahead
            assert torch.equal(cache["k_low"], before[3])
            continue
        assert st.tier[20] == st.tier[21] == TIER_FP8 and st.tier[0] == st.tier[1] == TIER_LOW
        assert st.fill_fp8_dev[:2].tolist() == [before[1][0], before[1][1]]  # the demoted pages' slots
        assert (st.fill_fp8_dev[2:] == st.scratch_fp8).all()
        assert cache["k_low"][0].abs().sum() > 0 and torch.equal(cache["k_low"][2], before[3][2])
        assert st.tier_dev[20].item() == TIER_FP8 and st.slot_dev[21].item() == before[1][1]


def test_the_fill_slots_return_to_scratch_after_the_replay_that_used_them():
    """A capture's warm-up runs the step on whatever the fill-slot buffer holds: after the replay
    that used real slots, it holds the scratch slot again (and replays without fills touch it not)."""
    import torch

    from moekv.context import HostLists
    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page")
    cache = fmt.allocate(32, 2, 16, 32, torch.device("cpu"), 2, torch.float32)
    st = cache.state
    assert fmt.prepare_graph_step([cache], HostLists([32], [0, 1], [0], [[30, 20]]), [20], [30])
    assert st.fill_fp8_dev[0].item() != st.scratch_fp8
    fmt.after_graph_replay([cache])
    assert (st.fill_fp8_dev == st.scratch_fp8).all() and not st.fill_slots_loaded


def _filling_step_cache(fmt):
    """A pool of 8 FP8 slots, full: sequence 0 (pages 0-4 full, page 20 filling now) and sequence 1
    (pages 5-7 full, page 21 partly), each page a mass of its own; and the step's decode tokens."""
    import torch

    from moekv.context import Context, HostLists

    H, P, D = 2, 16, 32
    g = torch.Generator().manual_seed(11)
    cache = fmt.allocate(32, H, P, D, torch.device("cpu"), 2, torch.float32)
    st = cache.state
    assert st.scratch_fp8 == 8
    tables, lens = [[0, 1, 2, 3, 4, 20], [5, 6, 7, 21]], [6 * P, 3 * P + 5]
    fmt._store_pages(cache, [(p, {"k": torch.randn(H, P, D, generator=g), "v": torch.randn(H, P, D, generator=g)},
                              t[:t.index(p) + 1]) for t in tables for p in t if p < 8])
    assert not st.free_fp8
    for page, mass in enumerate([3.0, 0.5, 2.0, 1.0, 4.0, 5.0, 0.2, 6.0]):
        st.mass[page] = mass
    cache["k_staging"].copy_(torch.randn(cache["k_staging"].shape, generator=g))
    cache["v_staging"].copy_(torch.randn(cache["v_staging"].shape, generator=g))
    k, v = torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g)
    padded = [t + [0] * (6 - len(t)) for t in tables]
    host = HostLists(lens, [0, 1, 2], [0, 1], padded)
    ctx = Context(positions=torch.tensor([n - 1 for n in lens]), slot_mapping=torch.zeros(2, dtype=torch.long),
                  block_tables=torch.tensor(padded, dtype=torch.int32),
                  context_lens=torch.tensor(lens, dtype=torch.int32),
                  query_start_loc=torch.arange(3, dtype=torch.int32), logits_indices=torch.arange(2),
                  seq_slots=torch.arange(2), max_query_len=1, fills_no_page=False, host=host)
    return cache, k, v, ctx


@pytest.mark.parametrize("rerank_interval", [1, 10 ** 6], ids=["re-ranks", "no-rerank"])
def test_a_prepared_step_that_runs_eagerly_ends_as_the_eager_step(rerank_interval):
    """Several ranks: a rank's format prepares a replay (the fill's FP8 slot chosen, the coldest page
    demoted for it, the step counted and, here, re-ranked) that another rank turns down, so the step
    runs eagerly on every rank. After graph_step_not_replayed the fill-slot buffer holds the scratch
    slot again, and the eager write of the same step (counting nothing again, storing the fill anew)
    leaves exactly what the eager step alone leaves: tiers, slots, free list, masses, step count and
    every pool."""
    import torch

    from moekv.kvcache.formats import get_kv_format

    # an FP8 pool of 8 slots over 32 pages (tier1_fraction + 0.1)
    fmt = get_kv_format("tiered", torch.float32, codebook="page", rerank_interval=rerank_interval,
                        tier1_fraction=0.15)
    want, k, v, ctx = _filling_step_cache(fmt)
    fmt.write(want, k, v, ctx)  # the eager step alone
    got, k, v, ctx = _filling_step_cache(fmt)
    assert fmt.prepare_graph_step([got], ctx.host, [20], [0])
    st = got.state
    assert st.fill_slots_loaded and st.fill_fp8_dev[0].item() != st.scratch_fp8 and st.counted_ahead
    fmt.graph_step_not_replayed([got])
    assert (st.fill_fp8_dev == st.scratch_fp8).all() and not st.fill_slots_loaded
    assert st.counted_ahead  # the step stays counted: its eager write must not count it again
    fmt.write(got, k, v, ctx)
    assert not st.counted_ahead and st.steps == want.state.steps == 1
    assert st.tier[20] == TIER_FP8 and st.tier[6] == TIER_LOW  # the fill took the coldest page's slot
    if rerank_interval == 1:
        assert [st.tier[p] for p in (1, 2, 3)] == [TIER_LOW] * 3, "the re-ranking demoted nothing: a weak test"
    for key in ("tier", "fp8_slot", "free_fp8", "mass", "mass_weight"):
        assert getattr(st, key) == getattr(want.state, key), key
    for name in want.tensors:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(st.tier_dev, want.state.tier_dev) and torch.equal(st.slot_dev, want.state.slot_dev)


def test_rerank_halves_masses_through_the_weight_of_later_mass():
    """Re-ranking halves every page's mass by doubling the weight of the mass added after it (no
    pass over the pool). Against masses halved one by one: the same decayed masses, before and
    after the weight is folded back into the masses (at 2^64), and the same pages kept in FP8."""
    import torch

    from moekv.context import HostLists

    fmt, caches, _ = _tiered_layers(10**6, num_layers=1)
    fmt._rerank = type(fmt)._rerank.__get__(fmt)  # the format's own, not the recording one
    cache = caches[0]
    st = cache.state
    P, pages = 16, list(range(8))
    g = torch.Generator().manual_seed(4)
    kv = lambda: {"k": torch.randn(1, P, 16, generator=g), "v": torch.randn(1, P, 16, generator=g)}  # noqa: E731
    fmt._store_pages(cache, [(p, kv(), pages[:p + 1]) for p in pages])
    host = HostLists([8 * P], [0, 1], [0], [pages])
    want = [0.0] * len(st.mass)
    st.mass_weight = 2.0 ** 62  # two re-rankings from the fold back
    for r in range(4):
        added = torch.rand(len(pages), generator=g, dtype=torch.float64).tolist()
        st.mass_dev[pages] = torch.tensor(added, dtype=torch.float32)
        st.mass_pending = True
        for p, m in zip(pages, st.mass_dev[pages].tolist()):
            want[p] += m
        fmt._rerank(cache, host)
        want = [m * 0.5 for m in want]
        got = [fmt.page_mass(cache, p) for p in pages]
        assert got == [want[p] for p in pages], r  # powers of two: exact
        assert st.mass_weight == (2.0 ** (63 + r) if r < 1 else 2.0 ** (r - 1)), r
        hot = sorted(pages[1:-1], key=lambda p: -want[p])[:2]  # 15% of 8 pages, beside the first and newest
        assert {p for p in pages if st.tier[p] == TIER_FP8} <= {pages[0], pages[-1], *hot}


@pytest.mark.parametrize("num_q, length, window, max_elements", [
    (40, 40, None, 1 << 26), (7, 50, None, 600), (30, 64, 9, 900), (30, 64, 9, 8 * 64 * 5), (20, 70, 5, 8 * 70 * 4),
    (1, 33, None, 1)])
def test_key_mass_matches_explicit_probabilities(num_q, length, window, max_elements):
    """key_mass (the prefill's page ranking signal, chunked over queries) against the whole
    [Hq, Tq, L] softmax in float64: the last num_q positions of the context attend causally (and in
    a sliding window), GQA 4 query heads per KV head; chunks of one query up to all of them, and
    chunks whose window starts past the ranked keys."""
    import torch

    from moekv.kvcache.formats.tiered import key_mass

    g = torch.Generator().manual_seed(length)
    Hq, Hkv, D = 8, 2, 16
    q = torch.randn(num_q, Hq, D, generator=g)
    k = torch.randn(length, Hkv, D, generator=g) * 2
    scale = D ** -0.5
    scores = torch.einsum("thd,lhd->htl", q.double(), k.double().repeat_interleave(Hq // Hkv, dim=1)) * scale
    q_pos = torch.arange(length - num_q, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).sum(dim=(0, 1))
    num_keys = length // 16 * 16
    got = key_mass(q, k, scale, window, num_keys, max_elements=max_elements)
    assert got.dtype == torch.float32 and got.shape == (num_keys,)
    torch.testing.assert_close(got.double(), want[:num_keys], rtol=1e-5, atol=1e-6)
    assert abs(want.sum().item() - Hq * num_q) < 1e-9  # every query's probabilities sum to 1
