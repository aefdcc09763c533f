"""tiered_policy: which pages of the tiered format stay in FP8, as plain functions on plain lists.

No tensors and no storage here: the format (tiered.py) keeps each layer's page state, moves the
slabs and mirrors the tiers to the device; these functions only decide. A page is in one tier
(TIER_NONE: free or being filled). The rules:

- a page that fills takes a free FP8 slot; with none free, the coldest FP8 page (least attention
  mass) outside the filling sequence's first page and the page itself gives up its slot (is
  demoted), and when every FP8 page is protected the new page goes straight to the low tier;
- every `rerank_interval` steps each sequence keeps in FP8 its first page (attention sinks), its
  newest full page and the top `tier1_fraction` of its full pages by mass; the rest are demoted;
- demotion only: a page in the low tier has lost what FP8 would keep;
- masses decay: after each re-ranking every mass halves, by doubling the weight of what is added
  from then on (the ranking only compares masses).
"""
from __future__ import annotations

import heapq
import math
from typing import Callable

from moekv.ops.tiers import TIER_FP8, TIER_LOW, TIER_NONE

MAX_MASS_WEIGHT = 2.0 ** 64  # past it the masses are rescaled, before floats lose the small ones


def is_rerank_step(steps: int, rerank_interval: int) -> bool:
    """Whether the layer re-ranks after its `steps`-th step."""
    return steps % rerank_interval == 0


def pages_to_keep(full_pages: list[int], mass: list[float], tier1_fraction: float) -> set[int]:
    """Of one sequence's full pages (in order), those that stay in FP8: the top tier1_fraction by
    mass (the earlier page among equal masses), the first and the newest."""
    top = sorted(full_pages, key=lambda p: -mass[p])[:math.ceil(tier1_fraction * len(full_pages))]
    return set(top) | {full_pages[0], full_pages[-1]}


def rerank_demotions(full_pages_per_seq: list[list[int]], tier: list[int], mass: list[float],
                     tier1_fraction: float) -> list[int]:
    """The FP8 pages a re-ranking demotes, sequence by sequence (each one's full pages, in order);
    a sequence of two full pages or fewer keeps them all."""
    demote = []
    for full in full_pages_per_seq:
        if len(full) <= 2:
            continue
        keep = pages_to_keep(full, mass, tier1_fraction)
        demote += [page for page in full if page not in keep and tier[page] == TIER_FP8]
    return demote


def decayed_weight(mass: list[float], weight: float) -> tuple[list[float], float]:
    """After a re-ranking: every mass halves, as the weight of mass added from now on doubles; past
    MAX_MASS_WEIGHT the masses are divided by it and it starts over at 1. -> (mass, weight)."""
    weight *= 2.0
    if weight >= MAX_MASS_WEIGHT:
        return [m / weight for m in mass], 1.0
    return mass, weight


def choose_tiers(pages: list[tuple[int, list[int]]], tier: list[int], fp8_slot: list[int], free_fp8: list[int],
                 current_mass: Callable[[], list[float]]):
    """Store pages, each (page, its sequence's pages up to it), in order, as one at a time would:
    a free FP8 slot each (popped from the end of free_fp8); with none free, the coldest FP8 page
    outside the sequence's first and this one gives up its slot. Updates tier, fp8_slot and
    free_fp8 in place; current_mass() gives every page's mass, asked for only when a slot must be
    freed (the format folds the device's mass into it then). -> (page -> FP8 slot, pages for the
    low tier, (page, slot) of the FP8 pages stored before that were demoted: their slabs must be
    re-encoded before the slots are written). A page of the batch that a later page demotes goes to
    the low tier directly."""
    to_fp8: dict[int, int] = {}
    to_low: list[int] = []
    demoted: list[tuple[int, int]] = []
    coldest: list[tuple[float, int]] | None = None  # heap of (mass, page) over the FP8 pages
    for page, protect in pages:
        if not free_fp8:
            if coldest is None:
                mass = current_mass()
                coldest = [(mass[p], p) for p, t in enumerate(tier) if t == TIER_FP8]
                heapq.heapify(coldest)
            victim = pop_coldest(coldest, exclude=set(protect[:1] + protect[-1:]))
            if victim is not None:
                slot = fp8_slot[victim]
                if victim in to_fp8:  # a page of this batch: never written to FP8
                    del to_fp8[victim]
                    to_low.append(victim)
                else:
                    demoted.append((victim, slot))
                tier[victim], fp8_slot[victim] = TIER_LOW, -1
                free_fp8.append(slot)
        if free_fp8:
            slot = free_fp8.pop()
            tier[page], fp8_slot[page] = TIER_FP8, slot
            to_fp8[page] = slot
            if coldest is not None:
                heapq.heappush(coldest, (0.0, page))  # released: no mass yet
        else:  # every FP8 page is protected: this one goes straight to the low tier
            tier[page] = TIER_LOW
            to_low.append(page)
    return to_fp8, to_low, demoted


def pop_coldest(heap: list[tuple[float, int]], exclude: set[int]) -> int | None:
    """The page of least mass on the heap outside `exclude` (the lowest page among equal masses, as
    min over the pages in order picks), removed from it; the excluded ones stay. None if none."""
    skipped, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        if entry[1] in exclude:
            skipped.append(entry)
        else:
            found = entry[1]
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def tier_shares(tiers_per_layer: list[list[int]]) -> tuple[float, float]:
    """The share of stored pages in FP8 and in the low tier, averaged over layers (0, 0 when none)."""
    fp8 = low = 0.0
    for tiers in tiers_per_layer:
        used = len(tiers) - tiers.count(TIER_NONE) or 1
        fp8 += tiers.count(TIER_FP8) / used / len(tiers_per_layer)
        low += tiers.count(TIER_LOW) / used / len(tiers_per_layer)
    return fp8, low
