"""RouterLogits: what a router may read about one MoE layer's gate, computed only when asked.

Flat and group-limited routing read `full()` ([T, E], hidden @ gate.T); a hierarchical router reads
`cluster_scores` (its coarse gate) and then only the router rows of the clusters it kept, so it never
pays for the [T, E] product. `full_computed` counts the full products (tests check it stays 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RouterLogits:
    def __init__(self, hidden: torch.Tensor | None, gate: torch.Tensor | None, bias: torch.Tensor | None = None,
                 cluster_scores: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                 logit_bias: torch.Tensor | None = None) -> None:
        self.hidden = hidden  # [T, H] the normalised state the router reads
        self.gate = gate  # [E, H] router rows
        self.bias = bias  # [E] selection bias (e_score_correction_bias) or None
        self.cluster_scores = cluster_scores  # [T, C] coarse gate output when the norm computed it
        self.logit_bias = logit_bias  # [E] added to the logits themselves (gpt-oss's router) or None
        self._logits = logits  # [T, E] once computed (or given)
        self.full_computed = 0

    @classmethod
    def of(cls, value: "RouterLogits | torch.Tensor", bias: torch.Tensor | None = None) -> "RouterLogits":
        """Wrap precomputed logits [T, E] (tests, offline analysis); pass a RouterLogits through."""
        if isinstance(value, RouterLogits):
            return value
        return cls(None, None, bias=bias, logits=value)

    def full(self) -> torch.Tensor:
        """hidden @ gate.T (+ logit_bias) over all experts: [T, E]."""
        if self._logits is None:
            if self.hidden.is_cuda and self.hidden.dtype == self.gate.dtype:
                from moekv.ops import router_gemv

                if router_gemv.fits(self.hidden, self.gate):  # decode: one launch, not a split-K GEMM + reduce
                    self._logits = router_gemv.router_gemv(self.hidden, self.gate, bias=self.logit_bias)
                    self.full_computed += 1
                    return self._logits
            self._logits = F.linear(self.hidden, self.gate, self.logit_bias)
            self.full_computed += 1
        return self._logits
