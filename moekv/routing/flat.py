from __future__ import annotations

import torch

from moekv.ops.reference import topk_softmax_ref


class FlatTopKRouter:
    """The model's own router: softmax over all experts, top-k, optional renormalisation
    (Mixtral always renormalises; Qwen-MoE and OLMoE follow `norm_topk_prob`)."""

    def __init__(self, top_k: int, renormalize: bool) -> None:
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor):
        return topk_softmax_ref(router_logits, self.top_k, self.renormalize)
