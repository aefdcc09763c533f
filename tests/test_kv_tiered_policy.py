"""tiered's ranking policy on plain lists, apart from any storage: which pages keep FP8 at a
re-ranking, which slot a filling page takes or which page gives one up, how masses decay; and the
format's stats() built on it."""
from __future__ import annotations

import math

import pytest
import torch

from moekv.kvcache.formats.tiered_policy import (
    MAX_MASS_WEIGHT,
    TIER_FP8,
    TIER_LOW,
    TIER_NONE,
    choose_tiers,
    decayed_weight,
    is_rerank_step,
    pages_to_keep,
    pop_coldest,
    rerank_demotions,
    tier_shares,
)


def test_rerank_every_interval_steps():
    assert [s for s in range(1, 13) if is_rerank_step(s, 4)] == [4, 8, 12]
    assert all(is_rerank_step(s, 1) for s in range(1, 5))


def test_pages_to_keep_are_the_sink_the_newest_and_the_top_fraction():
    mass = [0.0] * 20
    full = [10, 3, 7, 12, 5, 9, 2, 4, 8, 6]  # one sequence's pages in order: sink 10, newest 6
    mass[7], mass[9], mass[4] = 5.0, 4.0, 3.0
    assert pages_to_keep(full, mass, 0.2) == {10, 6, 7, 9}  # ceil(0.2 * 10) = 2 by mass
    assert pages_to_keep(full, mass, 0.3) == {10, 6, 7, 9, 4}
    assert pages_to_keep(full, mass, 0.0) == {10, 6}
    # equal masses: the earlier pages of the sequence win
    assert pages_to_keep(full, [0.0] * 20, 0.2) == {10, 3, 6}


def test_rerank_demotes_only_fp8_pages_outside_the_kept_set():
    tier = [TIER_FP8] * 12
    tier[2] = TIER_LOW  # already low: not demoted again
    mass = [float(p) for p in range(12)]
    seqs = [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    # seq 0: keeps 0, 5 and the top ceil(0.34 * 6) = 3 by mass (5, 4, 3); seq 1: two pages, all kept;
    # seq 2: keeps 8, 11 and the top 2 (11, 10)
    assert rerank_demotions(seqs, tier, mass, 0.34) == [1, 9]
    assert rerank_demotions([[0, 1], [3]], tier, mass, 0.0) == []
    assert rerank_demotions([], tier, mass, 0.5) == []


def test_masses_halve_by_a_doubling_weight_and_rescale_before_it_grows_too_large():
    mass = [1.0, 3.0]
    assert decayed_weight(mass, 1.0) == ([1.0, 3.0], 2.0)
    rescaled, weight = decayed_weight([2.0 ** 63, 2.0 ** 64], MAX_MASS_WEIGHT / 2)
    assert weight == 1.0 and rescaled == [0.5, 1.0]
    # the ranking is unchanged by the rescale: only relative masses matter
    assert sorted(range(2), key=lambda p: -rescaled[p]) == [1, 0]


def _state(num_pages: int, fp8: dict[int, int], free: list[int]):
    tier = [TIER_NONE] * num_pages
    slot = [-1] * num_pages
    for page, s in fp8.items():
        tier[page], slot[page] = TIER_FP8, s
    return tier, slot, list(free)


def test_filling_pages_take_free_slots_from_the_end_without_reading_masses():
    tier, slot, free = _state(8, {}, [2, 1, 0])
    asked = []
    to_fp8, to_low, demoted = choose_tiers([(4, [4]), (5, [4, 5])], tier, slot, free, lambda: asked.append(1))
    assert to_fp8 == {4: 0, 5: 1} and to_low == [] and demoted == [] and free == [2]
    assert tier[4] == tier[5] == TIER_FP8 and slot[4] == 0 and slot[5] == 1
    assert not asked  # no slot had to be freed: the masses (a device sync in the format) were not read


def test_a_full_pool_demotes_the_coldest_unprotected_page():
    tier, slot, free = _state(8, {0: 0, 1: 1, 2: 2}, [])
    mass = [0.1, 5.0, 0.2, 0, 0, 0, 0, 0]
    calls = []

    def current_mass():
        calls.append(1)
        return mass

    # page 3 of a sequence whose first page is 0: 0 is protected, the coldest other is 2
    to_fp8, to_low, demoted = choose_tiers([(3, [0, 1, 2, 3])], tier, slot, free, current_mass)
    assert demoted == [(2, 2)] and to_fp8 == {3: 2} and to_low == []
    assert tier[2] == TIER_LOW and slot[2] == -1 and free == []
    # next batch, pages 4 then 5 of another sequence [4, 5]: 4 demotes 3 (stored above, no mass
    # yet: the coldest); 5 may not demote 4 (its sequence's first page), so it demotes 0
    to_fp8, to_low, demoted = choose_tiers([(4, [4]), (5, [4, 5])], tier, slot, free, current_mass)
    assert demoted == [(3, 2), (0, 0)] and to_fp8 == {4: 2, 5: 0} and to_low == []
    assert [p for p, t in enumerate(tier) if t == TIER_FP8] == [1, 4, 5]
    assert [p for p, t in enumerate(tier) if t == TIER_LOW] == [0, 2, 3]
    assert len(calls) == 2  # read once per batch that needed a slot


def test_a_batch_page_demoted_by_a_later_one_goes_to_the_low_tier():
    tier, slot, free = _state(6, {0: 0}, [1])
    mass = [9.0, 0, 0, 0, 0, 0]
    # 2 takes the free slot 1; 3 (protecting 1 and itself) finds none free: the coldest FP8 page
    # outside {1, 3} is 2 (no mass yet) -> 2 leaves the batch's FP8 pages for the low tier
    to_fp8, to_low, demoted = choose_tiers([(2, [1, 2]), (3, [1, 2, 3])], tier, slot, free, lambda: mass)
    assert to_fp8 == {3: 1} and to_low == [2] and demoted == []
    assert tier[2] == TIER_LOW and tier[3] == TIER_FP8 and slot[3] == 1 and slot[2] == -1


def test_with_every_fp8_page_protected_the_page_goes_low():
    tier, slot, free = _state(4, {0: 0}, [])
    to_fp8, to_low, demoted = choose_tiers([(1, [0, 1])], tier, slot, free, lambda: [0.0] * 4)
    assert to_fp8 == {} and to_low == [1] and demoted == [] and tier[1] == TIER_LOW and tier[0] == TIER_FP8


def test_pop_coldest_skips_excluded_pages_and_breaks_ties_by_page():
    import heapq

    heap = [(1.0, 4), (0.5, 7), (0.5, 2), (3.0, 1)]
    heapq.heapify(heap)
    assert pop_coldest(heap, exclude={2}) == 7
    assert sorted(heap) == [(0.5, 2), (1.0, 4), (3.0, 1)]  # the excluded page stays
    assert pop_coldest(heap, exclude=set()) == 2
    assert pop_coldest(heap, exclude={1, 4}) is None and len(heap) == 2


def test_tier_shares_average_over_layers():
    layers = [[TIER_FP8, TIER_LOW, TIER_LOW, TIER_NONE], [TIER_FP8, TIER_FP8, TIER_NONE, TIER_NONE]]
    fp8, low = tier_shares(layers)
    assert fp8 == pytest.approx((1 / 3 + 1) / 2) and low == pytest.approx((2 / 3) / 2)
    assert tier_shares([[TIER_NONE] * 3]) == (0.0, 0.0)


def test_stats_of_the_tiered_format():
    from moekv.kvcache.formats import get_kv_format

    fmt = get_kv_format("tiered", torch.float32, codebook="page")
    caches = [fmt.allocate(8, 2, 16, 32, torch.device("cpu"), 2, torch.float32) for _ in range(2)]
    assert fmt.run_statistics(caches) == {"tier_share_fp8": 0.0, "tier_share_low": 0.0}  # nothing read yet
    caches[0].state.tier[:3] = [TIER_FP8, TIER_LOW, TIER_LOW]
    caches[1].state.tier[:1] = [TIER_FP8]
    fmt.bits_read, fmt.elements_read = 3000.0, 1000
    stats = fmt.run_statistics(caches)
    assert stats["tier_share_fp8"] == pytest.approx((1 / 3 + 1) / 2)
    assert stats["tier_share_low"] == pytest.approx(1 / 3)
    assert stats["bits_read"] == 3.0
    assert get_kv_format("int4").run_statistics(caches) == {}  # formats without run-dependent figures
    assert not math.isnan(sum(stats.values()))
