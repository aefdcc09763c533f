"""Offline expert clustering, the arithmetic of one layer (moekv/tools/cluster.py runs the model
over calibration text and calls it for every MoE layer).

For every MoE layer, from the router's inputs on calibration text (with the model's own flat
routing): count how often two experts are chosen by the same token (co-activation);
combine those counts with the similarity of the experts' router rows and weights into one
affinity matrix; split the experts into C equal clusters that maximise the affinity inside the
clusters (pair swaps from several random starts); fit a coarse gate (C rows + biases) that
predicts each cluster's share of the routing mass; and pick the admission margin of a second
cluster that reaches the target locality on the calibration tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekv.ops.reference import cluster_routing_ref, fused_routing_ref
from moekv.routing.cluster_map import PROBE_COLUMNS, LayerClusters


@dataclass
class ClusterWeights:
    """How the affinity of two experts is made (each term scaled to [-1, 1] before weighting)."""
    coactivation: float = 1.0  # count(i and j chosen together) / sqrt(count(i) * count(j))
    router: float = 0.25  # cosine of the two router rows
    experts: float = 0.1  # cosine of the two experts' weights (gate, up, down)


def coactivation_counts(expert_ids: torch.Tensor, num_experts: int,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
    """expert_ids [N, k] -> [E, E] symmetric counts of tokens choosing both i and j (diagonal: i at all)."""
    N, k = expert_ids.shape
    w = torch.ones(N) if weights is None else weights.float()
    counts = torch.zeros(num_experts, num_experts)
    for a in range(k):
        counts.index_put_((expert_ids[:, a], expert_ids[:, a]), w, accumulate=True)
        for b in range(a + 1, k):
            counts.index_put_((expert_ids[:, a], expert_ids[:, b]), w, accumulate=True)
            counts.index_put_((expert_ids[:, b], expert_ids[:, a]), w, accumulate=True)
    return counts


def _cosine(rows: torch.Tensor) -> torch.Tensor:
    rows = F.normalize(rows.float().flatten(1), dim=1)
    return rows @ rows.T


def expert_affinity(coact: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
                    weights: ClusterWeights = ClusterWeights()) -> torch.Tensor:
    """[E, E] affinity: normalised co-activation + router-row cosine + expert-weight cosine."""
    usage = coact.diagonal().clamp(min=1)
    affinity = weights.coactivation * coact / (usage[:, None] * usage[None, :]).sqrt()
    affinity = affinity + weights.router * _cosine(gate)
    if w13 is not None and weights.experts:
        affinity = affinity + weights.experts * _cosine(torch.cat([w13.flatten(1), w2.flatten(1)], dim=1))
    return affinity.fill_diagonal_(0)


def intra_affinity(affinity: torch.Tensor, labels: torch.Tensor, num_clusters: int) -> float:
    same = labels[:, None] == labels[None, :]
    return float((affinity * same).sum() / 2)


def equal_partition(affinity: torch.Tensor, num_clusters: int, restarts: int = 16, seed: int = 0) -> torch.Tensor:
    """Split E experts into num_clusters clusters of E / C that maximise the summed affinity inside
    the clusters: from each random balanced start, apply the best improving swap of two experts of
    different clusters until none improves (sizes never change). Returns [C, M] expert ids, each
    cluster sorted, clusters ordered by their smallest expert."""
    E = affinity.shape[0]
    if E % num_clusters:
        raise ValueError(f"clusters={num_clusters} must divide the number of experts ({E}) for equal-size clusters")
    S = affinity.double()
    gen = torch.Generator().manual_seed(seed)
    best, best_score = None, -math.inf
    eye = torch.arange(E)
    for _ in range(restarts):
        labels = torch.empty(E, dtype=torch.long)
        labels[torch.randperm(E, generator=gen)] = torch.arange(E) % num_clusters
        onehot = F.one_hot(labels, num_clusters).double()  # [E, C]
        G = S @ onehot  # G[i, c] = affinity of i to the members of c
        for _ in range(E * E):
            own = G[eye, labels]
            move = G[:, labels] - own[:, None]  # move[i, j]: i joins j's cluster (j leaving it)
            gain = move + move.T - 2 * S
            gain[labels[:, None] == labels[None, :]] = -math.inf
            flat = int(gain.argmax())
            i, j = divmod(flat, E)
            if gain[i, j] <= 1e-12:
                break
            a, b = int(labels[i]), int(labels[j])
            G[:, a] += S[:, j] - S[:, i]
            G[:, b] += S[:, i] - S[:, j]
            labels[i], labels[j] = b, a
        score = intra_affinity(S, labels, num_clusters)
        if score > best_score + 1e-12:
            best, best_score = labels.clone(), score
    clusters = [sorted(torch.nonzero(best == c).flatten().tolist()) for c in range(num_clusters)]
    clusters.sort(key=lambda members: members[0])
    return torch.tensor(clusters, dtype=torch.long)


def cluster_mass(logits: torch.Tensor, experts: torch.Tensor, scoring: str = "softmax",
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Share of each token's routing mass in each cluster: logits [N, E], experts [C, M] -> [N, C]."""
    if scoring == "softmax":
        lse = torch.logsumexp(logits.float()[:, experts], dim=-1)  # [N, C]
        return torch.softmax(lse, dim=-1)
    scores = torch.sigmoid(logits.float()) + (0 if bias is None else bias.float())
    mass = scores.clamp(min=0)[:, experts].sum(-1)
    return mass / mass.sum(-1, keepdim=True).clamp(min=1e-20)


def fit_coarse_gate(hidden: torch.Tensor, target: torch.Tensor, gate: torch.Tensor, experts: torch.Tensor,
                    l2: float = 1e-4, iters: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Coarse gate W [C, H], b [C] with softmax(hidden @ W.T + b) ~ target [N, C] (cross-entropy,
    L-BFGS), starting from each cluster's mean router row (and log of its size)."""
    C, M = experts.shape
    W = gate.float()[experts].mean(1).clone().requires_grad_(True)  # [C, H]
    b = torch.full((C,), math.log(M)).requires_grad_(True)
    h = hidden.float()
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -(target * torch.log_softmax(h @ W.T + b, dim=-1)).sum(-1).mean() + l2 * W.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return W.detach(), (b - b.mean()).detach()


def assignment_stats(expert_ids: torch.Tensor, device_of_expert: torch.Tensor) -> tuple[float, float]:
    """(locality, fan-out): share of a token's experts on its top-1 expert's device; mean devices per token."""
    dev = device_of_expert[expert_ids]  # [N, k]
    locality = (dev == dev[:, :1]).float().mean().item()
    fan_out = torch.stack([(dev == d).any(1) for d in dev.unique()], 1).float().sum(1).mean().item()
    return locality, fan_out


# candidate admission margins (nats of coarse score) measured per layer; 3 and 4 because on domain-moe the
# +1% budget kept every cluster at 2 and below, while uniform margins 3 and 4 fit it (docs/decisions.md,
# "Hierarchical routing: margins 3 and 4 among the candidates")
MARGINS = (-math.inf, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, math.inf)


def margin_locality(hidden: torch.Tensor, gate: torch.Tensor, layer: LayerClusters, top_k: int, renormalize: bool,
                    clusters_per_token: int, margin: float, scoring: str = "softmax",
                    bias: torch.Tensor | None = None) -> dict:
    """Locality, fan-out and clusters per token of hierarchical routing with this margin on these tokens."""
    scores = hidden.float() @ layer.coarse_weight.T + layer.coarse_bias
    _, ids, kept = cluster_routing_ref(hidden, scores, gate.float()[layer.experts], layer.experts, top_k, renormalize,
                                       clusters_per_token, margin, scoring, bias, return_kept=True)
    locality, fan_out = assignment_stats(ids, layer.cluster_of_expert())
    return {"locality": locality, "fan_out": fan_out, "clusters_per_token": (kept >= 0).float().sum(1).mean().item()}


def choose_margins(table: dict[int, list[dict]], ppl_budget: float) -> dict[int, float]:
    """Per layer margin that maximises the mean locality over layers while the summed increase of
    NLL (each layer measured alone) stays within log(1 + ppl_budget). table: layer -> rows with
    margin, locality, delta_nll (inf margin = all clusters = flat, delta 0, always allowed)."""
    limit = math.log1p(ppl_budget)
    best, best_locality = {i: float("inf") for i in table}, -1.0
    for lam in [0.0] + [10 ** (x / 8) for x in range(-16, 57)] + [math.inf]:
        pick = {}
        for i, rows in table.items():
            def value(r):
                return r["locality"] - (lam * r["delta_nll"] if lam != math.inf else (1e9 * r["delta_nll"]))
            pick[i] = max(rows, key=lambda r: (value(r), r["margin"]))
        loss = sum(r["delta_nll"] for r in pick.values())
        locality = sum(r["locality"] for r in pick.values()) / len(pick)
        if loss <= limit and locality > best_locality:
            best, best_locality = {i: r["margin"] for i, r in pick.items()}, locality
    return best


def cluster_layer(hidden: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
                  num_clusters: int, top_k: int, renormalize: bool, scoring: str = "softmax",
                  bias: torch.Tensor | None = None, weights: ClusterWeights = ClusterWeights(),
                  restarts: int = 16, seed: int = 0) -> tuple[LayerClusters, dict]:
    """One layer: hidden [N, H] router inputs from calibration text -> its clusters and coarse gate."""
    logits = hidden.float() @ gate.float().T  # [N, E]
    E = gate.shape[0]
    _, ids = fused_routing_ref(logits, top_k, renormalize, scoring, bias)
    coact = coactivation_counts(ids, E)
    experts = equal_partition(expert_affinity(coact, gate, w13, w2, weights), num_clusters, restarts, seed)
    target = cluster_mass(logits, experts, scoring, bias)
    W, b = fit_coarse_gate(hidden, target, gate, experts)
    layer = LayerClusters(experts, W, b, gate.detach().float()[:, :PROBE_COLUMNS].clone())
    cluster_of = layer.cluster_of_expert()
    scores = hidden.float() @ W.T + b
    flat_locality, flat_fan_out = assignment_stats(ids, cluster_of)
    stats = {"flat_locality": flat_locality, "flat_fan_out": flat_fan_out,
             "same_cluster_topk": (cluster_of[ids] == cluster_of[ids[:, :1]]).all(1).float().mean().item(),
             "coarse_top1_accuracy": (scores.argmax(1) == cluster_of[ids[:, 0]]).float().mean().item(),
             "coarse_mass_accuracy": (scores.argmax(1) == target.argmax(1)).float().mean().item()}
    return layer, stats
