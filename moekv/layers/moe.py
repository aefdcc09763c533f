"""SparseMoE, and the ExpertExecutors of a layer whose experts all live on its device (the interface
is layers/hooks.ExpertExecutor; expert parallelism's and expert offload's live beside what they wrap)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.hooks import ExpertExecutor, LayerHooks
from moekv.layers.mlp import GatedMLP
from moekv.models.model_config import ModelConfig
from moekv.ops.reference import clamped_swiglu_moe_ref, fused_moe_ref
from moekv.routing.base import RouterLogits


class ReferenceExperts:
    """Every expert on this device, through the plain-PyTorch reference (the CPU path)."""

    def __call__(self, x, w13, w2, weights, expert_ids):
        return fused_moe_ref(x, w13, w2, weights, expert_ids)


class FusedExperts:
    """Every expert on this device, through the Triton grouped GEMM / decode GEMV (ops/fused_moe.py;
    ops/fused_moe_quant.py for quantized experts), capturable in CUDA graphs."""

    def __call__(self, x, w13, w2, weights, expert_ids):
        from moekv.ops.fused_moe_quant import fused_experts

        return fused_experts(x, w13, w2, weights, expert_ids)


def local_experts(device: torch.device) -> ExpertExecutor:
    """The executor of a layer whose experts all live on `device`: the kernel on CUDA, the reference elsewhere."""
    return FusedExperts() if device.type == "cuda" else ReferenceExperts()


class SparseMoE(nn.Module):
    """Router + stacked experts (+ an optional always-on shared expert, with a sigmoid gate when
    cfg.shared_expert_gated). Its
    router, routing observer, ExpertExecutor and tensor-parallel group are its layer's hooks
    (layers/hooks.LayerHooks, shared with the layer's attention)."""

    def __init__(self, cfg: ModelConfig, hooks: LayerHooks | None = None) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Parameter(torch.empty(E, H))  # router weights: logits = x @ gate.T
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))  # per expert: gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        # DeepSeek-V3's and GLM-4.5's selection bias (added to the scores for the choice only), in fp32 at any
        # model dtype as the checkpoints keep it: rounded to bf16 it would reorder experts whose biased scores
        # differ by less than its spacing (2^-9 near 0.5)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32)) if cfg.router_bias else None
        # gpt-oss: the router's logit bias, expert biases and the clamped SwiGLU (the fused kernels'
        # epilogues on CUDA, clamped_swiglu_moe_ref elsewhere)
        self.gate_bias = nn.Parameter(torch.empty(E)) if cfg.router_logit_bias else None
        self.clamped_swiglu = cfg.clamped_swiglu
        self.w13_bias = nn.Parameter(torch.empty(E, 2 * I)) if cfg.clamped_swiglu is not None else None
        self.w2_bias = nn.Parameter(torch.empty(E, H)) if cfg.clamped_swiglu is not None else None
        self.shared_expert = (GatedMLP(H, cfg.shared_expert_intermediate_size)
                              if cfg.shared_expert_intermediate_size else None)
        self.shared_expert_gate = (nn.Parameter(torch.empty(1, H))
                                   if cfg.shared_expert_intermediate_size and cfg.shared_expert_gated else None)
        # tensor parallel (hooks.tp): this rank's share of the output (a slice of every expert, or with
        # expert parallelism its whole experts), all-reduced
        self.hooks = hooks if hooks is not None else LayerHooks()

    @property
    def router_fuses_norm(self) -> bool:
        """Whether the router computes the RMSNorm before the layer itself (with a coarse gate)."""
        router = self.hooks.router
        return router is not None and router.fuses_norm

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's contribution: through its sigmoid gate (Qwen2-MoE), or as is (DeepSeek, GLM)."""
        if self.shared_expert_gate is None:
            return self.shared_expert(x)
        return torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x [T, H]: the normalised state, or, with `norm` given, the residual stream before the
        norm (a router with a coarse gate computes both from one read of x)."""
        hooks = self.hooks
        if hooks.router is None:
            raise RuntimeError("this MoE layer has no router: models/loader.install_routers installs one")
        if hooks.experts is None:
            raise RuntimeError("this MoE layer has no expert executor: models/loader.empty_model installs one")
        cluster_scores = None
        if norm is not None:
            x, cluster_scores = hooks.router.norm_and_coarse(x, norm)  # [T, H], [T, C] or None
        # logits [T, E] are computed only if the router reads them (hierarchical does not)
        router_logits = RouterLogits(x, self.gate, self.e_score_correction_bias, cluster_scores,
                                     logit_bias=self.gate_bias)
        weights, expert_ids = hooks.router(x, router_logits)  # [T, k], [T, k]
        if hooks.observer is not None:
            hooks.observer(weights, expert_ids)
        if self.clamped_swiglu is not None:
            out = self._clamped_swiglu_experts(x, weights, expert_ids)
        else:
            out = hooks.experts(x, self.w13, self.w2, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + self.shared_output(x)
        return out if hooks.tp is None else hooks.tp.all_reduce(out)

    def _clamped_swiglu_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """gpt-oss's experts (biases, the clamped SwiGLU) on this device: the fused kernels with those
        epilogues where the layer's executor is FusedExperts (16-bit or quantized experts: MXFP4 as the
        checkpoint ships them, fp8 / int4), the reference where it is ReferenceExperts."""
        hooks, act = self.hooks, self.clamped_swiglu
        if isinstance(hooks.experts, FusedExperts) and hooks.tp is None:
            from moekv.ops.fused_moe_quant import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, expert_ids, biases=(self.w13_bias, self.w2_bias),
                                 clamped_swiglu=(act.alpha, act.limit))
        if isinstance(hooks.experts, ReferenceExperts) and hooks.tp is None:
            return clamped_swiglu_moe_ref(x, self.w13, self.w13_bias, self.w2, self.w2_bias, weights, expert_ids,
                                          act.alpha, act.limit)
        raise RuntimeError("experts with biases and the clamped SwiGLU (gpt-oss) run on one device only: tensor / "
                           "expert parallelism and expert offload are not supported for them")
