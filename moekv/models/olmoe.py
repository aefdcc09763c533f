"""OlmoeForCausalLM: q/k RMSNorm over the whole projection, optional clip_qkv, top-k without
renormalisation unless norm_topk_prob."""
from __future__ import annotations

from typing import Any

from moekv.models.model_config import ModelConfig, dtype_from, eos_ids_from, require, rope_theta_from

ARCHITECTURES = ("OlmoeForCausalLM",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    return ModelConfig(
        architecture="OlmoeForCausalLM",
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta_from(hf, 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        num_experts=require(hf, "num_experts", "num_local_experts"),
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=require(hf, "intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        qk_norm="full",
        clip_qkv=hf.get("clip_qkv"),
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
    )


def canonical_name(name: str) -> str:
    return name
