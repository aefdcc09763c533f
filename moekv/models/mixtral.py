"""MixtralForCausalLM: softmax top-k router that always renormalises; experts w1/w3/w2."""
from __future__ import annotations

import re
from typing import Any

from moekv.models.model_config import ModelConfig, dtype_from, eos_ids_from, require, rope_theta_from

ARCHITECTURES = ("MixtralForCausalLM",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    return ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta_from(hf, 1e6),
        max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32),
        num_experts=require(hf, "num_local_experts", "num_experts"),
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=require(hf, "intermediate_size"),
        norm_topk_prob=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        sliding_window=hf.get("sliding_window"),
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
    )


_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_W_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def canonical_name(name: str) -> str:
    """Mixtral's tensor names -> the Qwen/OLMoE-style names the loader understands."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.mlp.experts.{m.group(2)}.{_W_NAMES[m.group(3)]}.weight"
    return name.replace(".block_sparse_moe.", ".mlp.")
