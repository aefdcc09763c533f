"""ModelConfig: the numbers of a decoder, read from a Hugging Face config.json.

Each supported architecture maps its config keys onto these fields in its own module
(mixtral.py, qwen_moe.py, olmoe.py); everything after loading sees only ModelConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something moekv does not implement (names what and what is accepted)."""


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token caches one normalised latent c_kv
    [kv_lora_rank] and one rotated key [qk_rope_head_dim] shared by every head; per head, keys are
    W_UK c_kv (qk_nope_head_dim) beside the shared rotary key, values W_UV c_kv (v_head_dim)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    # the rotary part's pairs: True (x0, x1), (x2, x3), ... rotated together (DeepSeek's layout);
    # False: rotate-half
    rope_interleave: bool = True
    inv_freq: tuple[float, ...] = ()  # [qk_rope_head_dim / 2] (YaRN-corrected when the config asks)
    rope_scale: float = 1.0  # cos and sin are multiplied by it (YaRN's attention factor)
    softmax_scale: float = 1.0  # qk_head_dim ** -0.5, times YaRN's mscale_all_dim correction squared

    @property
    def latent_width(self) -> int:
        """One cache entry: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # "per_head": RMSNorm over head_dim of each head (Qwen3); "full": over all heads' dims (OLMoE)
    qk_norm: str | None = None
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0  # for layers that use a dense MLP instead of experts
    moe_layers: list[bool] = field(default_factory=list)  # per layer: experts (True) or dense MLP
    sliding_window: int | None = None
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # routing beyond plain softmax top-k (DeepSeek-V3 style; set by apply_routing_fields)
    n_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # the checkpoint has mlp.gate.e_score_correction_bias
    # how group-limited routing scores a group: 'top2_sum' (DeepSeek-V3) or 'max' (DeepSeek-V2's group_limited_greedy)
    group_score: str = "top2_sum"
    # False: the shared expert's output is added as is (DeepSeek), True: through a sigmoid gate (Qwen2-MoE)
    shared_expert_gated: bool = True
    # multi-head latent attention (DeepSeek-V2/V3); then num_kv_heads is 1 and head_dim the width of
    # one latent cache entry (mla.latent_width): what the KV pool holds per token and layer
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        if not self.moe_layers:
            self.moe_layers = [True] * self.num_layers
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def parameter_counts(self) -> tuple[int, int]:
        """(total parameters, parameters touched per token): experts count top_k / num_experts."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        if self.mla is not None:
            attn = self._mla_parameters() + 2 * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm == "per_head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "full":
            attn += self.q_size + self.kv_size
        total = active = embed + h
        for is_moe in self.moe_layers:
            total += attn
            active += attn
            if not is_moe:
                dense = 3 * h * self.dense_intermediate_size
                total += dense
                active += dense
                continue
            expert = 3 * h * self.moe_intermediate_size
            router = self.num_experts * h
            shared = 3 * h * self.shared_expert_intermediate_size
            if self.shared_expert_intermediate_size and self.shared_expert_gated:
                shared += h
            total += self.num_experts * expert + router + shared
            active += self.top_k * expert + router + shared
        return total, active

    def _mla_parameters(self) -> int:
        """One MLA block's weights (projections and the two latent norms)."""
        m, h, heads = self.mla, self.hidden_size, self.num_heads
        q_out = heads * m.qk_head_dim
        q = h * q_out if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_out
        kv = h * m.latent_width + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h


def rope_theta_from(hf: dict[str, Any], default: float) -> float:
    """Read RoPE settings from either the transformers-4 keys or the transformers-5 `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported yet; accepted: 'default' (plain RoPE)")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def dtype_from(hf: dict[str, Any]) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def eos_ids_from(*values: Any) -> list[int]:
    ids: list[int] = []
    for value in values:
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def apply_routing_fields(cfg: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
    """Group-limited routing keys any architecture's config.json may carry (n_group, topk_group,
    scoring_func, routed_scaling_factor, topk_method='noaux_tc' for the selection bias)."""
    cfg.n_group = hf.get("n_group") or None
    cfg.topk_group = hf.get("topk_group") or None
    cfg.scoring_func = hf.get("scoring_func") or "softmax"
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        raise UnsupportedModelError(f"scoring_func={cfg.scoring_func!r} is not supported; accepted: 'softmax', 'sigmoid'")
    cfg.routed_scaling_factor = float(hf.get("routed_scaling_factor") or 1.0)
    cfg.router_bias = hf.get("topk_method") == "noaux_tc"
    return cfg


def require(hf: dict[str, Any], *keys: str) -> Any:
    """The first of keys present in config.json, or a clear error naming them."""
    for key in keys:
        if key in hf and hf[key] is not None:
            return hf[key]
    raise UnsupportedModelError(f"config.json has no {' / '.join(keys)}; a {hf.get('architectures')} config needs it")
