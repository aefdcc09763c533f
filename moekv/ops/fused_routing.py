"""Fused routing: one launch from router logits (or, hierarchical, from the normalised hidden
state and the coarse scores) to (weights [T, k], expert_ids [T, k]).

Semantics are the references' in ops/reference.py: `fused_routing_ref` (flat and group-limited:
scores, selection bias, group scores = sum of each group's top-2 or its best, kept groups, top-k,
renormalisation, scaling) and `cluster_routing_ref` (hierarchical: cluster order, the best
cluster's logits, admission of further clusters by margin + spread, logits of the admitted
clusters only, scores, top-k, renormalisation, scaling). Ties go to the lower index, as in the
references: a top-k step takes the maximum, then the smallest index among the untaken entries
equal to it (so -inf entries are taken in index order, never skipped or repeated).

One program per token. Experts sit in a [groups, experts per group] tile (flat routing: one group);
the hierarchical kernel holds a [kept rank, experts per cluster] tile and computes each admitted
cluster's M logits as M x H products accumulated over BLOCK_H slices of the hidden row.
Shape legend: T = tokens, E = experts, G = groups (S = E / G per group), k = top-k, C = clusters,
M = experts per cluster, Kc = most clusters per token, H = hidden size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.pdl import let_dependents_launch, pdl_enabled
from moekv.ops.reference import check_group_score

_BIG = tl.constexpr(1 << 30)  # "no index" in the min-index reductions


@triton.jit
def _fused_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scaling_factor,
                       N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                       SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
                       GROUP_TOP2: tl.constexpr):
    let_dependents_launch(PDL)  # the MoE GEMV after the routing may get resident (ops/pdl.py)
    t = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    valid_g = offs_g < N_GROUP
    valid = valid_g[:, None] & (offs_s[None, :] < GROUP_SIZE)  # [BG, BS]
    expert = offs_g[:, None] * GROUP_SIZE + offs_s[None, :]
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        p = tl.where(valid, p, 0.0)
        scores = p / tl.sum(tl.sum(p, 1), 0)
    else:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        top1 = tl.max(choice, 1)  # [BG]
        first = tl.min(tl.where((choice == top1[:, None]) & valid, offs_s[None, :], _BIG), 1)
        group_score = top1
        if GROUP_SIZE > 1 and GROUP_TOP2:
            rest = tl.where(offs_s[None, :] == first[:, None], float("-inf"), choice)
            group_score = top1 + tl.max(rest, 1)
        kept = offs_g < 0  # all False, [BG]
        for _ in tl.static_range(TOPK_GROUP):
            cand = tl.where(kept, float("-inf"), group_score)
            best = tl.max(cand, 0)
            g = tl.min(tl.where((cand == best) & ~kept & valid_g, offs_g, _BIG), 0)
            kept = kept | (offs_g == g)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    taken = expert < 0  # all False, [BG, BS]
    w_out = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_out = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, float("-inf"), choice)
        best = tl.max(tl.max(cand, 1), 0)
        e = tl.min(tl.min(tl.where((cand == best) & ~taken & valid, expert, _BIG), 1), 0)
        hit = expert == e
        w_out = tl.where(offs_k == j, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), w_out)
        id_out = tl.where(offs_k == j, e, id_out)
        taken = taken | hit
    if RENORMALIZE:
        w_out = w_out / (tl.sum(tl.where(offs_k < TOP_K, w_out, 0.0), 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + offs_k, w_out * scaling_factor, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, id_out.to(tl.int64), mask=offs_k < TOP_K)


def fused_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                  bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                  scaling_factor: float = 1.0, group_score: str = "top2_sum") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert_ids [T, k] int64); see fused_routing_ref."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring={scoring!r} is not supported; accepted: 'softmax', 'sigmoid'")
    check_group_score(group_score)
    num_tokens, num_experts = router_logits.shape
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide the {num_experts} experts")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // n_group
    _fused_topk_kernel[(num_tokens,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), float(scaling_factor),
        N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, TOP_K=top_k,
        BLOCK_G=triton.next_power_of_2(n_group), BLOCK_S=triton.next_power_of_2(group_size),
        BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize, PDL=pdl_enabled(logits.device), GROUP_TOP2=group_score == "top2_sum",
        num_warps=1 if num_experts <= 64 else 4)
    return weights, ids


@triton.jit
def _cluster_topk_kernel(hidden_ptr, scores_ptr, gate_ptr, experts_ptr, bias_ptr, weights_ptr, ids_ptr,
                         stride_h, stride_s, admit_margin, scaling_factor,
                         C: tl.constexpr, M: tl.constexpr, H: tl.constexpr, MAX_CLUSTERS: tl.constexpr,
                         TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_KC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                         SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
    t = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_KC)  # kept rank
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    valid_m = offs_m < M
    cs = tl.load(scores_ptr + t * stride_s + offs_c, mask=offs_c < C, other=float("-inf")).to(tl.float32)
    cs_exp = tl.where(offs_c < C, tl.exp(cs - tl.max(cs, 0)), 0.0)
    coarse_p = cs_exp / tl.sum(cs_exp, 0)  # softmax over clusters: estimated share of the mass
    logits = tl.full([BLOCK_KC, BLOCK_M], float("-inf"), dtype=tl.float32)
    ids = tl.zeros([BLOCK_KC, BLOCK_M], dtype=tl.int32)
    ranked = offs_c < 0  # clusters already ranked, [BC]
    kept_share = tl.full([], 0.0, tl.float32)
    best = tl.full([], 0.0, tl.float32)
    slack = tl.full([], 0.0, tl.float32)
    for j in tl.static_range(MAX_CLUSTERS):
        cand = tl.where(ranked, float("-inf"), cs)
        score = tl.max(cand, 0)
        c = tl.min(tl.where((cand == score) & ~ranked & (offs_c < C), offs_c, _BIG), 0)
        ranked = ranked | (offs_c == c)
        if j == 0:
            best = score
            keep = score == score  # always
        else:
            keep = (score >= best - admit_margin - slack) & (score > float("-inf"))
        if keep:
            acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            row_ptr = gate_ptr + c * (M * H) + offs_m[:, None] * H
            for h0 in tl.static_range(0, H, BLOCK_H):
                mask_h = (h0 + offs_h) < H
                x = tl.load(hidden_ptr + t * stride_h + h0 + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                w = tl.load(row_ptr + h0 + offs_h[None, :], mask=valid_m[:, None] & mask_h[None, :], other=0.0)
                acc += w.to(tl.float32) * x[None, :]
            row = tl.where(valid_m, tl.sum(acc, 1), float("-inf"))  # [BM]
            logits = tl.where(offs_r[:, None] == j, row[None, :], logits)
            members = tl.load(experts_ptr + c * M + offs_m, mask=valid_m, other=0).to(tl.int32)
            ids = tl.where(offs_r[:, None] == j, members[None, :], ids)
            kept_share += tl.sum(tl.where(offs_c == c, coarse_p, 0.0), 0)
            if j == 0:
                row_max = tl.max(row, 0)
                slack = tl.log(tl.sum(tl.where(valid_m, tl.exp(row - row_max), 0.0), 0))
    live = logits > float("-inf")
    valid = (offs_r[:, None] < MAX_CLUSTERS) & valid_m[None, :]
    if SOFTMAX:
        p = tl.where(live, tl.exp(logits - tl.max(tl.max(logits, 1), 0)), 0.0)
        scores = p / tl.sum(tl.sum(p, 1), 0) * kept_share
    else:
        scores = tl.where(live, tl.sigmoid(logits), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + ids, mask=live, other=0.0).to(tl.float32)
    choice = tl.where(live, choice, float("-inf"))
    pos = offs_r[:, None] * BLOCK_M + offs_m[None, :]  # candidate order: (kept rank, position)
    offs_k = tl.arange(0, BLOCK_K)
    taken = pos < 0
    w_out = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_out = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, float("-inf"), choice)
        top = tl.max(tl.max(cand, 1), 0)
        q = tl.min(tl.min(tl.where((cand == top) & ~taken & valid, pos, _BIG), 1), 0)
        hit = pos == q
        w_out = tl.where(offs_k == j, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), w_out)
        id_out = tl.where(offs_k == j, tl.sum(tl.sum(tl.where(hit, ids, 0), 1), 0), id_out)
        taken = taken | hit
    if RENORMALIZE:
        w_out = w_out / (tl.sum(tl.where(offs_k < TOP_K, w_out, 0.0), 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + offs_k, w_out * scaling_factor, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, id_out.to(tl.int64), mask=offs_k < TOP_K)


def fused_cluster_routing(hidden: torch.Tensor, cluster_scores: torch.Tensor, gate_by_cluster: torch.Tensor,
                          cluster_experts: torch.Tensor, top_k: int, renormalize: bool, max_clusters: int,
                          admit_margin: float, scoring: str = "softmax", bias: torch.Tensor | None = None,
                          scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hierarchical routing in one launch; see cluster_routing_ref (same arguments, same result)."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring={scoring!r} is not supported; accepted: 'softmax', 'sigmoid'")
    num_tokens, hidden_size = hidden.shape
    C, M, _ = gate_by_cluster.shape
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    scores = cluster_scores if cluster_scores.stride(-1) == 1 else cluster_scores.contiguous()
    gate_by_cluster = gate_by_cluster.contiguous()
    cluster_experts = cluster_experts.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return weights, ids
    block_m = triton.next_power_of_2(M)
    block_h = max(16, min(triton.next_power_of_2(hidden_size), 4096 // block_m))
    _cluster_topk_kernel[(num_tokens,)](
        hidden, scores, gate_by_cluster, cluster_experts, bias if bias is not None else scores, weights, ids,
        hidden.stride(0), scores.stride(0), float(admit_margin), float(scaling_factor),
        C=C, M=M, H=hidden_size, MAX_CLUSTERS=max_clusters, TOP_K=top_k, BLOCK_C=triton.next_power_of_2(C),
        BLOCK_KC=triton.next_power_of_2(max_clusters), BLOCK_M=block_m, BLOCK_H=block_h,
        BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize, num_warps=4)
    return weights, ids
