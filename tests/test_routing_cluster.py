"""Offline clustering, cluster map files, placement statistics and `moekv eval routing`.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_routing_cluster.py
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from moekv import LLM
from moekv.routing import HierarchicalRouter
from moekv.routing.cluster import choose_margins, coactivation_counts, equal_partition, expert_affinity
from moekv.routing.cluster_map import ClusterMap, ClusterMapError, LayerClusters
from moekv.routing.placement import Placement, PlacementStats
from moekv.tools.cluster import build_cluster_map
from tests.checkpoints import CORPUS

PROMPT = [{"prompt_token_ids": [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11]}]


def assert_partition(experts: torch.Tensor, num_experts: int, num_clusters: int) -> None:
    assert experts.shape == (num_clusters, num_experts // num_clusters)  # equal sizes
    assert sorted(experts.flatten().tolist()) == list(range(num_experts))  # every expert exactly once


@pytest.mark.parametrize("E,C", [(16, 4), (12, 3), (8, 8), (64, 8), (6, 1)])
def test_equal_partition_is_equal_sized_and_covers_every_expert(E, C):
    g = torch.Generator().manual_seed(E + C)
    a = torch.rand(E, E, generator=g)
    experts = equal_partition((a + a.T) / 2, C, restarts=3)
    assert_partition(experts, E, C)


def test_equal_partition_recovers_planted_clusters():
    """Experts that always fire together (a hidden block structure, shuffled) end up together."""
    E, C = 16, 4
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(0))
    blocks = perm.view(C, E // C)
    g = torch.Generator().manual_seed(1)
    ids = []
    for _ in range(2000):
        block = blocks[torch.randint(C, (1,), generator=g)].flatten()
        ids.append(block[torch.randperm(E // C, generator=g)[:2]])
    ids = torch.stack(ids)
    counts = coactivation_counts(ids, E)
    assert torch.equal(counts, counts.T) and counts.diagonal().sum() == 2 * len(ids)
    experts = equal_partition(expert_affinity(counts, torch.randn(E, 8), None, None), C)
    assert sorted(map(sorted, experts.tolist())) == sorted(map(sorted, blocks.tolist()))
    with pytest.raises(ValueError, match="clusters=3 must divide the number of experts"):
        equal_partition(torch.zeros(E, E), 3)


def test_choose_margins_maximises_locality_within_budget():
    table = {0: [{"margin": -math.inf, "locality": 1.0, "delta_nll": 0.05},
                 {"margin": 0.0, "locality": 0.9, "delta_nll": 0.004},
                 {"margin": math.inf, "locality": 0.7, "delta_nll": 0.0}],
             1: [{"margin": -math.inf, "locality": 1.0, "delta_nll": 0.004},
                 {"margin": 0.0, "locality": 0.8, "delta_nll": 0.001},
                 {"margin": math.inf, "locality": 0.7, "delta_nll": 0.0}]}
    assert choose_margins(table, 0.01) == {0: 0.0, 1: -math.inf}
    assert choose_margins(table, 0.0) == {0: math.inf, 1: math.inf}
    assert choose_margins(table, 1.0) == {0: -math.inf, 1: -math.inf}


def layer(E=8, C=4, H=64, seed=0) -> LayerClusters:
    g = torch.Generator().manual_seed(seed)
    return LayerClusters(torch.randperm(E, generator=g).view(C, E // C), torch.randn(C, H, generator=g),
                         torch.zeros(C), admit_margin=0.5)


def test_cluster_map_round_trip_and_validation(tmp_path):
    cmap = ClusterMap("MixtralForCausalLM", 2, 8, 64, 2, {0: layer(), 1: layer(seed=1)}, clusters_per_token=2,
                      summary={"note": "x"})
    path = cmap.save(tmp_path / "map.safetensors")
    back = ClusterMap.load(path)
    assert back.num_clusters == 4 and back.clusters_per_token == 2 and back.summary == {"note": "x"}
    assert torch.equal(back.layers[1].experts, cmap.layers[1].experts) and back.layers[0].admit_margin == 0.5
    bad = ClusterMap("MixtralForCausalLM", 2, 8, 64, 2, {0: layer()})
    bad.layers[0].experts = torch.tensor([[0, 1], [1, 2], [3, 4], [5, 6]])  # 1 twice, 7 missing
    with pytest.raises(ClusterMapError, match="exactly once"):
        bad.save(tmp_path / "bad.safetensors")
    bad.layers[0].experts = torch.arange(6).view(3, 2)  # 6 of 8 experts
    with pytest.raises(ClusterMapError, match="6 expert slots"):
        bad.validate()
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ClusterMapError, match="is not a cluster map"):
        ClusterMap.load(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError, match="cluster map not found"):
        ClusterMap.load(tmp_path / "missing.safetensors")


def test_placement_stats_by_hand():
    # 8 experts, 4 devices: expert e on device e // 2
    placement = Placement({0: torch.arange(8) // 2}, 4, "hand")
    stats = PlacementStats(placement)
    stats.add(0, torch.tensor([[0, 1], [0, 2], [7, 6], [4, 0]]))  # local, remote, local, remote
    out = stats.summary(hidden_size=10, bytes_per_element=2)
    assert out["locality"] == 6 / 8 and out["fan_out"] == 6 / 4
    assert out["cross_device_bytes_per_token"] == 2 * 10 * 2 * (2 / 4)  # two of four tokens use one remote device
    cmap = ClusterMap("X", 1, 8, 4, 2, {0: LayerClusters(torch.tensor([[3, 5], [0, 1], [2, 4], [6, 7]]),
                                                         torch.zeros(4, 4), torch.zeros(4))})
    assert Placement.from_clusters(cmap).device_of_expert[0].tolist() == [1, 1, 2, 0, 2, 0, 3, 3]
    assert Placement.from_clusters(cmap, 2).device_of_expert[0].tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    rnd = Placement.random([0, 1], 8, 4, seed=3).device_of_expert
    assert all(torch.bincount(d, minlength=4).tolist() == [2, 2, 2, 2] for d in rnd.values())


# -- on a real (tiny, random) checkpoint ---------------------------------------------------------
@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(CORPUS * 3)
    return path


@pytest.fixture(scope="module")
def built_map(mixtral_ckpt, tmp_path_factory):
    llm = LLM(mixtral_ckpt, dtype="float32", max_model_len=128)
    ids = llm.tokenizer.encode(CORPUS * 3, add_special_tokens=False)
    cmap, summary = build_cluster_map(llm, ids[:600], 4, quality_ids=ids[600:900], ppl_budget=0.02, restarts=4,
                                      progress=False)
    path = cmap.save(tmp_path_factory.mktemp("maps") / "mixtral.safetensors")
    return path, cmap, summary


def test_build_cluster_map_on_a_checkpoint(built_map):
    path, cmap, summary = built_map
    assert cmap.num_clusters == 4 and sorted(cmap.layers) == [0, 1]
    for lay in cmap.layers.values():
        assert_partition(lay.experts, 8, 4)
        assert lay.coarse_weight.shape == (4, 64)
    assert summary["expected_ppl_change"] <= 0.02 + 1e-9
    for rows in summary["margin_table"].values():
        assert {r["margin"] for r in rows} >= {-math.inf, 0.0, 2.0, 3.0, 4.0, math.inf}
        # a wider margin admits at least the clusters a narrower one does
        by_margin = sorted(rows, key=lambda r: r["margin"])
        admitted = [r["clusters_per_token"] for r in by_margin]
        assert all(a <= b + 1e-9 for a, b in zip(admitted, admitted[1:])), by_margin
        one = next(r for r in rows if r["margin"] == -math.inf)
        assert one["locality"] == 1.0 and one["clusters_per_token"] == 1.0
        assert next(r for r in rows if r["margin"] == math.inf)["delta_nll"] == 0.0


def test_hierarchical_engine_never_computes_full_logits_and_all_clusters_equal_flat(mixtral_ckpt, built_map,
                                                                                       monkeypatch):
    path, cmap, _ = built_map
    flat = LLM(mixtral_ckpt, dtype="float32", max_model_len=64).score(PROMPT)[0]
    wide = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="hierarchical", cluster_map=path,
               cluster_admit_margin=math.inf)
    assert isinstance(wide.engine.runner.model.layers[0].hooks.router, HierarchicalRouter)
    from moekv.routing.logits import RouterLogits

    def no_full(self):
        raise AssertionError("the hierarchical path computed the full [T, E] router logits")

    monkeypatch.setattr(RouterLogits, "full", no_full)
    torch.testing.assert_close(wide.score(PROMPT)[0], flat, rtol=1e-5, atol=1e-5)
    local = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="hierarchical", cluster_map=path,
                cluster_admit_margin=-math.inf)
    assert local.score(PROMPT)[0].shape == flat.shape


def test_wrong_cluster_maps_are_rejected(checkpoints, built_map, tmp_path):
    path, cmap, _ = built_map
    # another architecture (and shape) entirely
    with pytest.raises(ClusterMapError, match=r"was made for MixtralForCausalLM .* this model is Qwen3MoeForCausalLM"):
        LLM(checkpoints["qwen3_moe"], dtype="float32", max_model_len=64, routing="hierarchical", cluster_map=path)
    # wrong expert count
    other = ClusterMap(cmap.architecture, cmap.num_layers, 16, cmap.hidden_size, cmap.top_k,
                       {i: LayerClusters(torch.arange(16).view(4, 4), torch.zeros(4, 64), torch.zeros(4))
                        for i in cmap.layers})
    other.save(tmp_path / "e16.safetensors")
    with pytest.raises(ClusterMapError, match="16 experts per layer.* 8 experts per layer"):
        LLM(checkpoints["mixtral"], dtype="float32", max_model_len=64, routing="hierarchical",
            cluster_map=tmp_path / "e16.safetensors")
    # same shape, other weights: the router probe tells them apart
    for lay in cmap.layers.values():
        lay.router_probe = lay.router_probe + 1.0
    cmap.save(tmp_path / "other_weights.safetensors")
    with pytest.raises(ClusterMapError, match="router weights of layer 0 differ.*another checkpoint"):
        LLM(checkpoints["mixtral"], dtype="float32", max_model_len=64, routing="hierarchical",
            cluster_map=tmp_path / "other_weights.safetensors")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moekv.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_cluster_and_eval_routing(mixtral_ckpt, text_file, tmp_path):
    out = tmp_path / "map.safetensors"
    r = run_cli("cluster", "--model", str(mixtral_ckpt), "--text", str(text_file), "--clusters", "2", "--out",
                str(out), "--max-tokens", "400", "--quality-tokens", "200", "--restarts", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout and "locality" in r.stdout and "FLOPs/token" in r.stdout
    r = run_cli("eval", "routing", "--model", str(mixtral_ckpt), "--text", str(text_file), "--routing",
                "hierarchical", "--cluster-map", str(out), "--max-tokens", "300", "--max-model-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"ppl", "locality", "fan_out", "topk_agreement", "routing"} <= set(record)
    assert record["routing"] == "hierarchical" and 0.5 <= record["locality"] <= 1.0
    assert set(record["topk_agreement"]) == {"set", "top1"} and set(record["relative_error"]) == {"0", "1"}
    r = run_cli("eval", "routing", "--model", str(mixtral_ckpt), "--text", str(text_file), "--max-tokens", "200",
                "--max-model-len", "64")
    assert r.returncode == 0, r.stderr
    assert "identical sets" in r.stdout and "random" in r.stdout
    r = run_cli("cluster", "--model", str(mixtral_ckpt), "--text", str(text_file), "--clusters", "3")
    assert r.returncode == 2 and "--clusters 3 must divide num_experts=8" in r.stderr


def test_eval_routing_group_limited_under_its_group_placement(mixtral_ckpt, text_file):
    from moekv.eval.routing import evaluate_routing

    llm = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="group_limited", n_group=4, topk_group=1)
    record = evaluate_routing(llm, text_file, max_tokens=200, progress=False, random_seeds=1)
    assert record["placement"] == "grouped" and record["locality"] == 1.0 and record["fan_out"] == 1.0
    assert record["flat_placements"]["grouped"]["locality"] < 1.0  # flat routing crosses groups
    assert 0.0 < record["topk_agreement"]["set"] < 1.0
