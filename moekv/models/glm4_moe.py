"""Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air).

GQA attention with q/k/v biases (attention_bias), optional per-head q/k RMSNorm before RoPE
(use_qk_norm) and partial RoPE: the first int(head_dim * partial_rotary_factor) elements of each
head rotated in the rotate-half layout, the rest passed through. The first first_k_dense_replace
layers have a dense MLP; the others route n_routed_experts with sigmoid scores, the learned
selection bias (mlp.gate.e_score_correction_bias), group-limited choice (n_group, topk_group),
norm_topk_prob and routed_scaling_factor, plus an ungated shared expert of
n_shared_experts * moe_intermediate_size. The multi-token-prediction layers a checkpoint may store
after the decoder (num_nextn_predict_layers: speculative decoding, which moekv does not run) are
skipped by the loader (ignored_tensor).
"""
from __future__ import annotations

import re
from typing import Any

from moekv.models.model_config import (ModelConfig, UnsupportedModelError, dtype_from, eos_ids_from, require,
                                       rope_theta_from)

ARCHITECTURES = ("Glm4MoeForCausalLM",)

# transformers' own default when a config.json names none (Glm4MoeConfig)
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def partial_rotary_factor_from(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return DEFAULT_PARTIAL_ROTARY_FACTOR if factor is None else float(factor)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    arch = hf["architectures"][0]
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or hidden // heads
    num_layers = require(hf, "num_hidden_layers")
    factor = partial_rotary_factor_from(hf)
    if not 0.0 < factor <= 1.0:
        raise UnsupportedModelError(f"{arch} with partial_rotary_factor={factor} is not supported; accepted: (0, 1]")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2:
        raise UnsupportedModelError(
            f"{arch}: partial_rotary_factor={factor} of head_dim={head_dim} rotates {rotary_dim} elements; "
            f"accepted: a factor giving an even number (rotate-half pairs element i with i + rotary_dim/2)")
    shared = int(hf.get("n_shared_experts", 1) or 0)
    if shared < 1:
        raise UnsupportedModelError(f"{arch} with n_shared_experts={shared} is not supported; accepted: 1 or more "
                                    f"(they run as one MLP of n_shared_experts * moe_intermediate_size)")
    moe_inter = require(hf, "moe_intermediate_size")
    dense_layers = int(hf.get("first_k_dense_replace", 1) or 0)
    return ModelConfig(
        architecture=arch,
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta_from(hf, 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        num_experts=require(hf, "n_routed_experts", "num_local_experts"),
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=False,
        qk_norm="per_head" if hf.get("use_qk_norm", False) else None,
        shared_expert_intermediate_size=shared * moe_inter,
        shared_expert_gated=False,
        dense_intermediate_size=hf.get("intermediate_size", 0) or 0,
        moe_layers=[i >= dense_layers for i in range(num_layers)],
        rotary_dim=rotary_dim,
        num_skipped_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
        # GLM always scores with a sigmoid and has the selection bias, which its config.json does not
        # name (n_group, topk_group: models/model_config.apply_routing_fields)
        scoring_func="sigmoid",
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        router_bias=True,
    )


_SHARED = re.compile(r"\.mlp\.shared_experts\.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def ignored_tensor(name: str, cfg: ModelConfig) -> bool:
    """The tensors of the num_nextn_predict_layers multi-token-prediction layers stored after the
    decoder's (model.layers.<num_hidden_layers + i>.*); a tensor of any later layer is still an error."""
    m = _LAYER.match(name)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_skipped_layers


def canonical_name(name: str) -> str:
    return _SHARED.sub(".mlp.shared_expert.", name)
