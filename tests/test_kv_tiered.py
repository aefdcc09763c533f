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
            fp8_used = [p for p, t in enumerate(st["tier"]) if t == TIER_FP8]
            # every FP8 page owns exactly one FP8 slot, and slots are never shared or also free
            slots = [st["fp8_slot"][p] for p in fp8_used]
            assert len(set(slots)) == len(slots) and not set(slots) & set(st["free_fp8"])
            assert len(slots) + len(st["free_fp8"]) == cache["k_fp8"].shape[0]
            seen_low |= TIER_LOW in st["tier"]
            for seq in engine.scheduler.running:  # sink and newest full page stay in FP8
                full = seq.block_table[:seq.num_computed_tokens // 32]
                if len(full) > 2 and st["steps"] % 4 == 0:
                    assert st["tier"][full[0]] == TIER_FP8 and st["tier"][full[-1]] == TIER_FP8
    assert seen_low, "no page was ever demoted to nuq2"
    engine.runner.release_pages(engine.block_manager.drain_freed())
    for cache in engine.runner.kv_caches:
        assert set(cache.state["tier"]) == {TIER_NONE}
        assert len(cache.state["free_fp8"]) == cache["k_fp8"].shape[0]
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
