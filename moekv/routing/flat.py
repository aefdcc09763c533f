from __future__ import annotations

import torch

from moekv.ops.reference import topk_softmax_ref
from moekv.routing.logits import RouterLogits


class FlatTopKRouter:
    """The model's own router: softmax over all experts, top-k, optional renormalisation
    (Mixtral always renormalises; Qwen-MoE and OLMoE follow `norm_topk_prob`)."""

    name = "flat"
    fuses_norm = False

    def __init__(self, top_k: int, renormalize: bool) -> None:
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, hidden: torch.Tensor, router_logits: RouterLogits | torch.Tensor):
        logits = RouterLogits.of(router_logits).full()  # [T, E]
        if logits.is_cuda:
            from moekv.ops.fused_routing import fused_routing

            return fused_routing(logits, self.top_k, self.renormalize)
        return topk_softmax_ref(logits, self.top_k, self.renormalize)

    def norm_and_coarse(self, x: torch.Tensor, norm) -> tuple[torch.Tensor, None]:
        """The RMSNorm before the layer (routers with a coarse gate fuse theirs into it)."""
        return norm(x), None
