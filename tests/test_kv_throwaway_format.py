"""Adding a compressed KV format touches its own file and one registry line (kvcache/formats/names.py),
nothing else: shown with a throwaway format defined here (per-token int8 codes, no Gluon kernel) and
registered by a fixture (formats.register_format). The configuration accepts it, the cross-format
tests' lists (tests/kv_formats.py) take it up and their checks pass on it, the engine runs it, and
every optional capability of KVFormat defaults to none on it."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import EngineConfig
from moekv.engine.llm_engine import EngineStats
from moekv.kvcache import formats
from moekv.kvcache.formats import Field, GraphSupport, PagedQuantFormat, PageLayout
from moekv.kvcache.formats.paged import per_shape
from moekv.server.metrics import ServerMetrics
from tests import test_kv_staging
from tests.kv_formats import format_options, formats_sharing_pages, self_contained_compressed

NAME = "int8_toy"


class Int8Toy(PagedQuantFormat):
    """Per-token absmax int8 codes with an fp16 scale: all a paged format has to say about itself."""

    name = NAME

    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        return PageLayout([Field("codes", torch.int8, (block_size, head_dim)),
                           Field("scale", torch.float16, (block_size,))])

    def quantize(self, x, kind, layer=None):
        scale = (x.abs().amax(dim=-1) / 127).to(torch.float16).float()  # [n, Hkv, P], as stored
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return {"codes": (x / scale[..., None]).round().clamp(-127, 127).to(torch.int8), "scale": scale}

    def dequantize(self, fields, kind, layer=None):
        return fields["codes"].float() * fields["scale"].float()[..., None]


@pytest.fixture
def toy():
    formats.register_format(NAME, Int8Toy)
    yield
    formats.unregister_format(NAME)


def test_the_registry_and_the_cross_format_lists_take_it_up(toy):
    assert NAME in formats.compressed_formats()
    assert EngineConfig(kv_cache_dtype=NAME).cache.kv_cache_dtype == NAME
    assert NAME in self_contained_compressed()
    assert NAME in [name for name, _ in formats_sharing_pages()]  # its pages stay as written: prefix caching
    with pytest.raises(ValueError, match="already registered"):
        formats.register_format(NAME, Int8Toy)


def test_it_leaves_the_registry_with_its_fixture():
    assert NAME not in formats.compressed_formats()
    with pytest.raises(ValueError, match="unknown"):
        EngineConfig(kv_cache_dtype=NAME)


@pytest.mark.parametrize("check", [test_kv_staging.test_vectorized_decode_write_matches_the_loop,
                                   test_kv_staging.test_decode_steps_that_fill_pages_match_the_loop,
                                   test_kv_staging.test_prefill_chunks_store_what_one_token_at_a_time_stores],
                         ids=lambda check: check.__name__)
def test_the_cross_format_staging_checks_pass_on_it(toy, check):
    """The checks test_kv_staging.py runs for every name in self_contained_compressed(), run on it."""
    check(NAME)


def test_its_optional_capabilities_default_to_none(toy):
    fmt = formats.get_kv_format(NAME, torch.float32, decode_kernel="gluon", **format_options(NAME))
    H, P, D = 2, 64, 128
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 2, torch.float32)
    assert fmt.run_statistics([cache]) == {} and fmt.statistic_gauges == {}
    fmt.reset_read_counters()
    fmt.count_decode_reads(True)
    assert fmt.read_counts() is None and fmt.read_counts(decode=True) is None
    fmt.shard_tables(range(0, 1), H)  # no per-head tables: nothing to cut
    assert fmt.calibration_fitter is None and NAME not in formats.calibration_fitters()
    # no Gluon kernel: slab pools even where decode_kernel='gluon' asks for fragment order
    assert fmt.gluon_kernel is None and not fmt.fragment_pages(P, D, "cuda")
    assert not fmt.is_fragment_pool(cache) and "k_pages" in cache.tensors
    assert fmt.page_bytes(H, P, D) == H * 2 * (P * D + 128)  # codes and fp16 scales, on whole 128-byte lines
    assert fmt.graph_support is GraphSupport.DECODE_WITH_LISTED_FILLS and fmt.prefix_caching_unsupported() is None
    assert fmt.decode_spec(P, D) is None and "reference path" in fmt.fused_decode_unavailable(P, D)


def test_the_engine_runs_it_and_the_metrics_export_nothing_of_it(toy, mixtral_ckpt):
    llm = LLM(mixtral_ckpt, kv_cache_dtype=NAME, max_model_len=128, block_size=32, dtype="float32")
    out = llm.generate([{"prompt_token_ids": list(range(2, 70))}],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.stats().kv_format == {}
    metrics = ServerMetrics(llm.engine, "toy")
    assert b"kv_format_stat" not in metrics.render(llm.engine) and b"tier_fraction" not in metrics.render(llm.engine)


class Int8ToyWithStats(Int8Toy):
    """The toy with run statistics: one declared as a labelled gauge, one left to the generic gauge."""

    statistic_gauges = {"pages_in_a": formats.StatisticGauge("kv_cache_toy_fraction", "toy: share of pages in a.",
                                                             (("part", "a"),))}

    def run_statistics(self, caches):
        return {"pages_in_a": 0.25, "spare": 3.0}


def test_the_metrics_export_every_run_statistic():
    formats.register_format("int8_toy_stats", Int8ToyWithStats)
    try:
        stats = EngineStats(prompt_tokens=0, generation_tokens=0, num_preemptions=0, num_running=0, num_waiting=0,
                            kv_cache_usage=0.0, kv_pages_used=0, kv_cache_dtype="int8_toy_stats", block_size=64,
                            num_blocks=8, bits_per_element=8.5,
                            kv_format=Int8ToyWithStats().run_statistics([]))

        class Engine:
            def stats(self, device=True):
                return stats

        text = ServerMetrics(Engine(), "m").render(Engine()).decode()
    finally:
        formats.unregister_format("int8_toy_stats")
    assert 'moekv:kv_cache_toy_fraction{model_name="m",part="a"} 0.25' in text
    assert 'moekv:kv_format_stat{model_name="m",name="spare"} 3.0' in text
