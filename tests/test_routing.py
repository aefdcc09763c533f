"""Routers (moekv/routing) and their references: flat, group-limited (DeepSeek-V3), hierarchical.

The references in ops/reference.py are checked against plain per-token loops written here from
the definitions, on random and adversarial scores (ties, -inf, groups that win nothing); the
routers against the references; the engine plumbing (routing modes, defaults from the checkpoint,
validation) end to end.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_routing.py
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from moekv import LLM
from moekv.config import EngineConfig
from moekv.ops.reference import cluster_routing_ref, fused_routing_ref, stable_topk_ref, topk_softmax_ref
from moekv.routing import FlatTopKRouter, GroupLimitedRouter, HierarchicalRouter, RouterLogits
from moekv.routing.cluster_map import LayerClusters

INF = float("inf")


# -- per-token loops from the definitions (independent of the references' tensor code) -----------
def best_first(values: list[float], k: int) -> list[int]:
    """Indices of the k largest values; equal values in index order."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def group_limited_loop(logits, top_k, renormalize, scoring, bias, n_group, topk_group, scaling):
    weights, ids = [], []
    for row in logits.double().tolist():
        if scoring == "softmax":
            m = max(row)
            ex = [math.exp(x - m) for x in row]
            scores = [e / sum(ex) for e in ex]
        else:
            scores = [1 / (1 + math.exp(-x)) if x != -INF else 0.0 for x in row]
        choice = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
        size = len(row) // n_group
        groups = [choice[g * size:(g + 1) * size] for g in range(n_group)]
        group_scores = [sum(sorted(g, reverse=True)[:2]) for g in groups]
        kept = set(best_first(group_scores, topk_group))
        masked = [c if i // size in kept else -INF for i, c in enumerate(choice)]
        chosen = best_first(masked, top_k)
        w = [scores[i] for i in chosen]
        if renormalize:
            w = [x / (sum(w) + 1e-20) for x in w]
        weights.append([x * scaling for x in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def check_against_loop(logits, top_k, renormalize=True, scoring="softmax", bias=None, n_group=1, topk_group=1,
                       scaling=1.0):
    w, ids = fused_routing_ref(logits, top_k, renormalize, scoring, bias, n_group, topk_group, scaling)
    w_loop, ids_loop = group_limited_loop(logits, top_k, renormalize, scoring, bias, n_group, topk_group, scaling)
    assert ids.tolist() == ids_loop.tolist()
    torch.testing.assert_close(w.double(), w_loop, rtol=1e-5, atol=1e-6)
    return w, ids


# -- group-limited -----------------------------------------------------------------------------
def test_group_limited_deepseek_v3_hand_example():
    """DeepSeek-V3 routing (noaux_tc) worked by hand: E=8 experts in n_group=4 groups of 2,
    topk_group=2, top_k=2, sigmoid scores, e_score_correction_bias, norm_topk_prob, scaling 2.5.

        expert            0     1  |  2     3  |  4     5  |  6     7
        score s          .90   .10 | .60   .50 | .80   .70 | .20   .30
        bias b            0     0  |  0     0  | -.50  -.50| +.35  +.35
        choice s+b       .90   .10 | .60   .50 | .30   .20 | .55   .65
        group score (sum of its top-2 choices):  g0 1.00, g1 1.10, g2 0.50, g3 1.20
        kept groups (top 2): g3, g1  -- g0 is dropped although it holds the best expert (0)
        candidates: 2 (.60), 3 (.50), 6 (.55), 7 (.65)  -> top-2 by choice: 7, then 2
        weights from the UN-biased scores: s7 = .30, s2 = .60 -> /(.90) -> 1/3, 2/3 -> x2.5
        -> expert_ids [7, 2], weights [0.8333, 1.6667]
    Without the bias the groups would be g2 (1.50), g1 (1.10) and the experts 4, 5 (.8/1.5, .7/1.5);
    flat top-2 with the bias would be 0, 7.
    """
    s = torch.tensor([[0.90, 0.10, 0.60, 0.50, 0.80, 0.70, 0.20, 0.30]], dtype=torch.float64)
    logits = torch.log(s / (1 - s)).float()
    bias = torch.tensor([0, 0, 0, 0, -0.5, -0.5, 0.35, 0.35])
    router = GroupLimitedRouter(top_k=2, num_experts=8, n_group=4, topk_group=2, renormalize=True,
                                scoring="sigmoid", scaling_factor=2.5)
    w, ids = router(None, RouterLogits.of(logits, bias=bias))
    assert ids.tolist() == [[7, 2]]
    torch.testing.assert_close(w, torch.tensor([[2.5 / 3, 5 / 3]]), rtol=1e-5, atol=1e-5)
    w, ids = fused_routing_ref(logits, 2, True, "sigmoid", None, 4, 2)
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(w, torch.tensor([[0.8 / 1.5, 0.7 / 1.5]]), rtol=1e-5, atol=1e-5)
    assert fused_routing_ref(logits, 2, True, "sigmoid", bias)[1].tolist() == [[0, 7]]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,k,n_group,topk_group", [(16, 2, 1, 1), (16, 4, 4, 2), (64, 6, 8, 3), (32, 8, 8, 8),
                                                    (8, 1, 8, 1)])
def test_fused_routing_ref_matches_loop_random(scoring, E, k, n_group, topk_group):
    g = torch.Generator().manual_seed(E * 31 + k)
    logits = torch.randn(24, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3
    for renormalize in (True, False):
        check_against_loop(logits, k, renormalize, scoring, bias, n_group, topk_group, 1.7)
        check_against_loop(logits, k, renormalize, scoring, None, n_group, topk_group)


def test_flat_equals_topk_softmax_and_transformers_semantics():
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    for renormalize in (True, False):
        w, ids = fused_routing_ref(logits, 2, renormalize)
        w2, ids2 = topk_softmax_ref(logits, 2, renormalize)
        assert torch.equal(ids, ids2)
        torch.testing.assert_close(w, w2)
        w3, ids3 = FlatTopKRouter(2, renormalize)(None, logits)
        assert torch.equal(ids3, ids2)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_ties_go_to_the_lower_index(scoring):
    logits = torch.zeros(3, 16)  # every expert equal
    w, ids = check_against_loop(logits, 4, True, scoring, None, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3  # groups 0 and 1 (tied scores), then experts in order
    logits[1, 9] = 1.0  # one winner in group 2: groups 2 and 0 kept
    logits[2, 5] = logits[2, 6] = 2.0  # two equal winners in group 1, then group 0
    w, ids = check_against_loop(logits, 4, True, scoring, None, n_group=4, topk_group=2)
    assert ids[1].tolist() == [9, 0, 1, 2]  # equal scores: index order across the kept groups
    assert ids[2].tolist() == [5, 6, 0, 1]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_minus_inf_scores_and_groups_with_no_winner(scoring):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=g)
    logits[0, :4] = -INF  # a whole group disabled: it has no winner and is never kept
    logits[1, ::2] = -INF  # half the experts disabled
    logits[2, 4:] = -INF  # only group 0 has live experts: the second kept group wins nothing
    logits[3, :] = -INF  # sigmoid only (softmax of an all -inf row is undefined)
    logits[3, 7] = 0.0
    logits[4, 0] = 10.0  # one group holds both winners; the other kept group wins nothing
    logits[4, 1] = 9.0
    rows = [0, 1, 2, 4] if scoring == "softmax" else [0, 1, 2, 3, 4, 5]
    w, ids = check_against_loop(logits[rows], 2, True, scoring, None, n_group=4, topk_group=2)
    assert not set(ids[0].tolist()) & {0, 1, 2, 3}
    assert set(ids[rows.index(4)].tolist()) == {0, 1}
    assert torch.isfinite(w).all()
    # more experts asked than live ones: the -inf ones come in index order with weight 0
    w, ids = check_against_loop(logits[2:3], 6, False, scoring, None, n_group=4, topk_group=2)
    assert ids[0, 4:].tolist() == [4, 5] and (w[0, 4:] == 0).all()


def test_group_limited_router_rejects_bad_groups():
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=16"):
        GroupLimitedRouter(2, 16, 3, 1, True)
    with pytest.raises(ValueError, match="topk_group=5 must be in"):
        GroupLimitedRouter(2, 16, 4, 5, True)
    with pytest.raises(ValueError, match="hold fewer than top_k=8"):
        GroupLimitedRouter(8, 16, 8, 2, True)


# -- hierarchical ------------------------------------------------------------------------------
def hierarchical_loop(hidden, cluster_scores, gate_by_cluster, experts, top_k, renormalize, max_clusters, margin):
    """Softmax scoring, no bias: the definition in cluster_routing_ref's docstring, token by token."""
    weights, ids = [], []
    M = experts.shape[1]
    for t in range(hidden.shape[0]):
        s = cluster_scores[t].double().tolist()
        order = best_first(s, max_clusters)
        logits = {j: (gate_by_cluster[c].double() @ hidden[t].double()).tolist() for j, c in enumerate(order)}
        first = logits[0]
        slack = math.log(sum(math.exp(x - max(first)) for x in first))
        kept = [0] + [j for j in range(1, len(order)) if s[order[j]] >= s[order[0]] - margin - slack
                      and s[order[j]] > -INF]
        cand = [(logits[j][m], experts[order[j], m].item()) for j in kept for m in range(M)]
        mx = max(x for x, _ in cand)
        z = sum(math.exp(x - mx) for x, _ in cand)
        coarse = torch.softmax(cluster_scores[t].double(), 0)
        share = sum(coarse[order[j]].item() for j in kept)
        probs = [math.exp(x - mx) / z * share for x, _ in cand]
        chosen = best_first(probs, top_k)
        w = [probs[i] for i in chosen]
        if renormalize:
            w = [x / (sum(w) + 1e-20) for x in w]
        weights.append(w)
        ids.append([cand[i][1] for i in chosen])
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def random_clusters(E=16, C=4, H=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, H, generator=g)
    experts = torch.randperm(E, generator=g).view(C, E // C)
    return gate, experts, gate[experts]


@pytest.mark.parametrize("max_clusters,margin", [(1, 0.0), (2, 0.0), (2, 0.7), (4, 0.3), (4, -0.5), (3, INF),
                                                 (4, -INF)])
def test_cluster_routing_ref_matches_loop(max_clusters, margin):
    gate, experts, gbc = random_clusters()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 24, generator=g) * 0.5
    scores = torch.randn(20, 4, generator=g)
    for renormalize in (True, False):
        w, ids = cluster_routing_ref(hidden, scores, gbc, experts, 2, renormalize, max_clusters, margin)
        w_loop, ids_loop = hierarchical_loop(hidden, scores, gbc, experts, 2, renormalize, max_clusters, margin)
        assert ids.tolist() == ids_loop.tolist()
        torch.testing.assert_close(w.double(), w_loop, rtol=1e-5, atol=1e-6)


def test_cluster_routing_ties_and_minus_inf():
    gate, experts, gbc = random_clusters()
    hidden = torch.zeros(3, 24)  # every logit 0: ties everywhere
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-INF, 1.0, -INF, 1.0], [2.0, -INF, -INF, -INF]])
    w, ids, kept = cluster_routing_ref(hidden, scores, gbc, experts, 2, True, 4, 0.0, return_kept=True)
    w_loop, ids_loop = hierarchical_loop(hidden, scores, gbc, experts, 2, True, 4, 0.0)
    assert ids.tolist() == ids_loop.tolist()
    # row 0: four tied clusters, slack log(4) admits all; the first two candidates of cluster 0 win
    assert ids[0].tolist() == experts[0, :2].tolist() and (kept[0] >= 0).all()
    # row 1: clusters at -inf are never admitted, even with an infinite margin
    _, _, kept = cluster_routing_ref(hidden, scores, gbc, experts, 2, True, 4, INF, return_kept=True)
    assert sorted(kept[1][kept[1] >= 0].tolist()) == [1, 3] and kept[2].tolist() == [0, -1, -1, -1]


def test_hierarchical_with_all_clusters_is_flat_and_one_cluster_is_local():
    gate, experts, gbc = random_clusters(E=16, C=4, H=32, seed=5)
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)) * 0.4
    scores = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    flat_w, flat_ids = topk_softmax_ref(hidden @ gate.T, 2, True)
    w, ids = cluster_routing_ref(hidden, scores, gbc, experts, 2, True, 4, INF)
    assert torch.equal(ids, flat_ids)
    torch.testing.assert_close(w, flat_w)
    # without renormalisation, and all clusters kept, the weights are the flat softmax's too
    w, ids = cluster_routing_ref(hidden, scores, gbc, experts, 2, False, 4, INF)
    torch.testing.assert_close(w, topk_softmax_ref(hidden @ gate.T, 2, False)[0])
    # one cluster: both experts in the coarse gate's best cluster
    w, ids = cluster_routing_ref(hidden, scores, gbc, experts, 2, True, 4, -INF)
    cluster_of = LayerClusters(experts, torch.zeros(4, 32), torch.zeros(4)).cluster_of_expert()
    assert torch.equal(cluster_of[ids[:, 0]], scores.argmax(1)) and torch.equal(cluster_of[ids[:, 1]], scores.argmax(1))


def test_hierarchical_router_never_computes_full_logits():
    gate, experts, _ = random_clusters(H=32)
    layer = LayerClusters(experts, torch.randn(4, 32), torch.zeros(4))
    router = HierarchicalRouter(layer, gate, 2, True, clusters_per_token=2, admit_margin=0.5)
    hidden = torch.randn(8, 32)
    logits = RouterLogits(hidden, gate)
    w, ids = router(hidden, logits)
    assert logits.full_computed == 0 and ids.shape == (8, 2)
    ref = cluster_routing_ref(hidden, router.coarse_scores(hidden), gate[experts], experts, 2, True, 2, 0.5)
    assert torch.equal(ids, ref[1])
    with pytest.raises(ValueError, match="clusters_per_token=5"):
        HierarchicalRouter(layer, gate, 2, True, clusters_per_token=5, admit_margin=0.0)


def test_stable_topk_ref():
    x = torch.tensor([[1.0, 3.0, 3.0, -INF, 2.0, -INF]])
    assert stable_topk_ref(x, 6)[1].tolist() == [[1, 2, 4, 0, 3, 5]]


# -- engine plumbing ---------------------------------------------------------------------------
def test_engine_config_validates_routing_fields(tmp_path):
    with pytest.raises(ValueError, match=r"routing='fastest' is unknown; accepted: \['auto', 'flat'"):
        EngineConfig(routing="fastest")
    with pytest.raises(ValueError, match="routing='hierarchical' needs cluster_map"):
        EngineConfig(routing="hierarchical")
    with pytest.raises(ValueError, match="cluster_map=.*no such file"):
        EngineConfig(routing="hierarchical", cluster_map=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="clusters_per_token=0 must be an integer >= 1"):
        EngineConfig(clusters_per_token=0)
    with pytest.raises(ValueError, match="cluster_admit_margin=nan must be a number"):
        EngineConfig(cluster_admit_margin=float("nan"))
    with pytest.raises(ValueError, match="topk_group=3 must be <= n_group=2"):
        EngineConfig(n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="n_group=0 must be an integer >= 1"):
        EngineConfig(n_group=0)


@pytest.fixture(scope="module")
def grouped_ckpt(mixtral_ckpt, tmp_path_factory):
    """The mixtral test checkpoint with DeepSeek-style routing keys in its config.json."""
    out = tmp_path_factory.mktemp("grouped") / "mixtral_grouped"
    shutil.copytree(mixtral_ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(n_group=4, topk_group=2, routed_scaling_factor=1.0)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_checkpoint_with_groups_routes_group_limited_by_default(grouped_ckpt, mixtral_ckpt):
    prompt = [{"prompt_token_ids": [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66]}]
    llm = LLM(grouped_ckpt, dtype="float32", max_model_len=64)
    assert llm.engine.runner.routing == "group_limited"
    router = llm.engine.runner.model.layers[0].hooks.router
    assert isinstance(router, GroupLimitedRouter) and (router.n_group, router.topk_group) == (4, 2)
    grouped = llm.score(prompt)[0]
    flat_llm = LLM(grouped_ckpt, dtype="float32", max_model_len=64, routing="flat")
    assert flat_llm.engine.runner.routing == "flat"
    flat = flat_llm.score(prompt)[0]
    same = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="group_limited", n_group=4, topk_group=2)
    assert torch.equal(same.score(prompt)[0], grouped)  # the same knobs given explicitly
    # with all groups kept, group-limited routing is flat routing
    wide = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="group_limited", n_group=4, topk_group=4)
    torch.testing.assert_close(wide.score(prompt)[0], flat)
    with pytest.raises(ValueError, match="needs n_group and topk_group"):
        LLM(mixtral_ckpt, dtype="float32", max_model_len=64, routing="group_limited")


def test_cli_has_routing_flags():
    from moekv.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["generate", "--prompt", "x", "--routing", "group_limited", "--n-group", "4",
                                      "--topk-group", "2", "--clusters-per-token", "2"])
    cfg = engine_config_from(args)
    assert (cfg.router.routing, cfg.router.n_group, cfg.router.topk_group, cfg.router.clusters_per_token) == (
        "group_limited", 4, 2, 2)


def test_every_router_meets_the_protocol_the_moe_layer_uses(mixtral_ckpt):
    """layers/moe.py knows routers only through routing.base.Router; the loader installs them, and a
    layer without one says so instead of failing somewhere inside."""
    from moekv.layers.moe import SparseMoE
    from moekv.models.loader import load_model, load_model_config, moe_layers
    from moekv.routing.base import Router
    from moekv.routing.tap import RouterTap

    E, H = 8, 16
    clusters = LayerClusters(torch.arange(E).view(4, 2), torch.randn(4, H), torch.zeros(4))
    routers = [FlatTopKRouter(2, True), GroupLimitedRouter(2, E, 4, 2, True),
               HierarchicalRouter(clusters, torch.randn(E, H), 2, True, 2, 0.5)]
    routers.append(RouterTap(routers[0], lambda *a: None, 0))
    for router in routers:
        assert isinstance(router, Router), type(router).__name__
        assert isinstance(router.name, str) and isinstance(router.fuses_norm, bool)
    cfg = load_model_config(mixtral_ckpt)
    model = load_model(mixtral_ckpt, torch.float32, torch.device("cpu"), cfg)
    assert all(isinstance(moe.hooks.router, FlatTopKRouter) for moe in moe_layers(model).values())
    bare = SparseMoE(cfg)
    with pytest.raises(RuntimeError, match="no router"):
        bare(torch.zeros(1, cfg.hidden_size))
