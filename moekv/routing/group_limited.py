"""Group-limited routing (DeepSeek-V3, `topk_method: noaux_tc`; DeepSeek-V2's `group_limited_greedy`).

Experts form n_group contiguous groups. Each token scores every expert (sigmoid or softmax), adds
the selection bias (e_score_correction_bias) for the choice only, scores each group by the sum of
its two best biased scores (group_score 'top2_sum'; V2: by its best one, 'max'), keeps the
topk_group best groups and takes the top_k experts inside them. The weights are the un-biased
scores of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor.
Keeping few groups bounds how many devices (one group per device) a token's experts span.
"""
from __future__ import annotations

import torch

from moekv.ops.reference import check_group_score, fused_routing_ref
from moekv.routing.logits import RouterLogits


class GroupLimitedRouter:
    name = "group_limited"
    fuses_norm = False

    def __init__(self, top_k: int, num_experts: int, n_group: int, topk_group: int, renormalize: bool,
                 scoring: str = "sigmoid", scaling_factor: float = 1.0, group_score: str = "top2_sum") -> None:
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if topk_group * (num_experts // n_group) < top_k:
            raise ValueError(f"topk_group={topk_group} groups of {num_experts // n_group} experts hold fewer than "
                             f"top_k={top_k} experts; raise topk_group")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring={scoring!r} is not supported; accepted: 'softmax', 'sigmoid'")
        self.top_k, self.num_experts = top_k, num_experts
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.scoring, self.scaling_factor = renormalize, scoring, scaling_factor
        self.group_score = check_group_score(group_score)  # 'top2_sum' (V3) or 'max' (V2's group_limited_greedy)

    def __call__(self, hidden: torch.Tensor, router_logits: RouterLogits | torch.Tensor):
        gate = RouterLogits.of(router_logits)
        logits = gate.full()  # [T, E]
        kwargs = dict(scoring=self.scoring, bias=gate.bias, n_group=self.n_group, topk_group=self.topk_group,
                      scaling_factor=self.scaling_factor, group_score=self.group_score)
        if logits.is_cuda:
            from moekv.ops.fused_routing import fused_routing

            return fused_routing(logits, self.top_k, self.renormalize, **kwargs)
        return fused_routing_ref(logits, self.top_k, self.renormalize, **kwargs)

    def norm_and_coarse(self, x: torch.Tensor, norm) -> tuple[torch.Tensor, None]:
        return norm(x), None
