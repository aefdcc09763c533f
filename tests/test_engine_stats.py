"""LLMEngine.stats(): one snapshot of the engine's counters, the routing locality it counts on the
device when it has a cluster map (captured in CUDA graphs, so replays count too), and the KV
format's own figures."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import default_model_path
from moekv.models.loader import moe_layers
from moekv.routing.cluster_map import ClusterMap
from moekv.routing.placement import LocalityCounter, Placement, PlacementStats
from moekv.routing.tap import tapped

MODEL = default_model_path()
CLUSTER_MAP = (Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu"
               / "domain-moe.clusters4.safetensors")
PROMPT = "The sea was calm and the ship"


def test_padding_rows_are_not_counted():
    """Only the first counted_rows rows of a step count (a replayed step's padding rows never do)."""
    placement = Placement.random([0], num_experts=8, num_devices=4, seed=3)
    ids = torch.tensor([[0, 1], [2, 5], [7, 3], [4, 4], [6, 0], [1, 2]])
    counter = LocalityCounter(placement, torch.device("cpu"))
    counter.count_rows(4)
    counter.add(0, ids)
    reference = PlacementStats(placement)
    reference.add(0, ids[:4])
    expected = reference.summary(hidden_size=1)
    snap = counter.snapshot()
    assert snap["locality"] == pytest.approx(expected["locality"], abs=1e-12)
    assert snap["fan_out"] == pytest.approx(expected["fan_out"], abs=1e-12)
    assert snap["decisions"] == 4
    counter.count_rows(0)  # a capture's warm-up: nothing counts
    counter.add(0, ids)
    assert counter.snapshot() == snap


@pytest.mark.parametrize("routing, clusters_per_token", [("flat", None), ("hierarchical", 2)])
def test_locality_counts_equal_the_placement_figures_of_the_router_outputs(routing, clusters_per_token):
    """The engine's device counters give the locality and fan-out that PlacementStats computes from
    the routers' own outputs (collected by a tap, independently of the counters) on the same run."""
    llm = LLM(MODEL, dtype="float32", max_model_len=128, routing=routing, cluster_map=str(CLUSTER_MAP),
              clusters_per_token=clusters_per_token)
    engine = llm.engine
    reference = PlacementStats(Placement.from_clusters(ClusterMap.load(CLUSTER_MAP)))

    def collect(layer_idx, hidden, router_logits, weights, ids):
        reference.add(layer_idx, ids)

    with tapped(moe_layers(engine.runner.model), collect):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stats = engine.stats()
    expected = reference.summary(engine.model_config.hidden_size)
    assert stats.routing_locality == pytest.approx(expected["locality"], abs=1e-12)
    assert stats.routing_fan_out == pytest.approx(expected["fan_out"], abs=1e-12)
    num_moe = len(moe_layers(engine.runner.model))
    fed = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1  # the last token is never fed back
    assert engine.runner.locality.snapshot()["decisions"] == fed * num_moe
    assert 0 < stats.routing_locality <= 1 and 1 <= stats.routing_fan_out
    assert stats.prompt_tokens == len(out.prompt_token_ids) and stats.generation_tokens == 12


def test_stats_without_cluster_map_or_format_figures():
    llm = LLM(MODEL, dtype="float32", max_model_len=64)
    llm.generate(["Once upon", "a time"], SamplingParams(max_tokens=3, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.routing_locality is None and stats.routing_fan_out is None and stats.kv_format == {}
    assert stats.generation_tokens == 6 and stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_dtype == "fp32" and stats.bits_per_element == 32  # "auto" on an fp32 model: fp32 pages
    assert llm.engine.stats(device=False).kv_format == {}


def test_tiered_format_reports_its_tier_shares():
    llm = LLM(MODEL, dtype="float32", max_model_len=256, kv_cache_dtype="tiered", block_size=32, kv_rerank_interval=4)
    llm.generate("word " * 100, SamplingParams(max_tokens=40, ignore_eos=True))
    figures = llm.engine.stats().kv_format
    assert figures["tier_share_fp8"] + figures["tier_share_low"] == pytest.approx(1)
    assert 0 < figures["tier_share_fp8"] < 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("routing, clusters_per_token", [("flat", None), ("hierarchical", 1)])
def test_cluster_map_engine_replays_cuda_graphs_and_counts_the_replays(routing, clusters_per_token):
    """With a cluster map the counters are captured inside the decode graphs: decode steps are still
    replayed, every real token of every step is counted once, padding rows never."""
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4, routing=routing,
              cluster_map=str(CLUSTER_MAP), clusters_per_token=clusters_per_token, async_scheduling=False)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.locality is not None
    before = runner.graphs.num_replays
    outs = llm.generate([PROMPT, "Once upon a time", "It was"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert runner.graphs.num_replays - before >= 10  # the decode steps were replayed
    fed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert runner.locality.snapshot()["decisions"] == fed * len(moe_layers(runner.model))  # 3 rows of bucket 4
    stats = llm.engine.stats()
    if routing == "hierarchical":  # one cluster per token: local by construction
        assert stats.routing_locality == 1.0 and stats.routing_fan_out == 1.0
    else:
        assert 0 < stats.routing_locality < 1 and 1 < stats.routing_fan_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_server_with_cluster_map_replays_its_captured_graphs():
    """`moekv serve --cluster-map` captures the decode graphs at start; its requests' decode steps replay them."""
    import httpx

    from moekv.config import EngineConfig
    from moekv.engine.llm_engine import LLMEngine
    from tests.server_harness import ServerThread, scrape

    engine = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4,
                                    cluster_map=CLUSTER_MAP))
    engine.runner.graphs.capture_all(progress=False)  # as `moekv serve` does at start
    srv = ServerThread(MODEL, engine=engine)
    with srv:
        before = engine.runner.graphs.num_replays
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True})
        assert r.status_code == 200
        m = scrape(srv.url)
    assert engine.runner.graphs.num_replays - before >= 10
    assert 0 < m["moekv:routing_locality"] <= 1.0
