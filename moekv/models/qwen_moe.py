"""Qwen2MoeForCausalLM (qkv bias, shared expert with a sigmoid gate, optional dense layers) and
Qwen3MoeForCausalLM (per-head q/k RMSNorm, no shared expert)."""
from __future__ import annotations

from typing import Any

from moekv.models.model_config import (ModelConfig, UnsupportedModelError, dtype_from, eos_ids_from, require,
                                       rope_theta_from)

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    arch = hf["architectures"][0]
    is_qwen3 = arch == "Qwen3MoeForCausalLM"
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported; accepted: false")
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    num_layers = require(hf, "num_hidden_layers")
    num_experts = require(hf, "num_experts", "num_local_experts")
    # A layer uses experts unless listed in mlp_only_layers or skipped by decoder_sparse_step.
    step = hf.get("decoder_sparse_step", 1) or 1
    mlp_only = set(hf.get("mlp_only_layers") or [])
    moe_layers = [i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    return ModelConfig(
        architecture=arch,
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_from(hf, 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        num_experts=num_experts,
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=require(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        # Qwen2-MoE always has q/k/v biases (transformers 5 names the switch qkv_bias).
        qkv_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", not is_qwen3))),
        o_bias=is_qwen3 and bool(hf.get("attention_bias", False)),
        qk_norm="per_head" if is_qwen3 else None,
        shared_expert_intermediate_size=0 if is_qwen3 else hf.get("shared_expert_intermediate_size", 0) or 0,
        dense_intermediate_size=hf.get("intermediate_size", 0) or 0,
        moe_layers=moe_layers,
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
    )


def canonical_name(name: str) -> str:
    return name
