"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: multi-head latent attention (layers/mla.py, the
paged latent cache of kvcache/formats/latent.py), dense first layers (first_k_dense_replace), routed
experts with always-on, ungated shared experts (n_shared_experts x moe_intermediate_size).

Routing: V2 scores with a softmax, top-k over every expert (topk_method 'greedy') or inside the
topk_group groups with the best single scores ('group_limited_greedy'); V3 with a sigmoid plus the
selection bias, in n_group groups of which the topk_group with the best top-2 sums are kept
(DeepSeek-V3's `noaux_tc`). Both through routing/group_limited.py. norm_topk_prob renormalises the
chosen weights in both, as DeepSeek's own code does (transformers' V2 ignores it; the released V2
configs set it false). RoPE on the rotary part only, pairs interleaved unless
rope_interleave is false, with YaRN (mscale on cos / sin, mscale_all_dim on the softmax scale).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from moekv.models.model_config import MLAConfig, ModelConfig, UnsupportedModelError, dtype_from, eos_ids_from, require

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

ROPE_TYPES = ("default", "yarn")


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, rope: dict[str, Any]) -> torch.Tensor:
    """YaRN's per-pair frequencies: the fast pairs (many rotations over the original context) keep
    theta's, the slow ones are divided by `factor`, with a linear ramp between the two bounds."""
    factor = float(rope["factor"])
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedModelError("rope type 'yarn' needs original_max_position_embeddings in its parameters")
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def pair_index(rotations: float) -> float:  # the pair that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0 fast .. 1 slow
    return (1.0 / base) * (1 - ramp) + (1.0 / (factor * base)) * ramp


def _rope(hf: dict[str, Any], dim: int, qk_head_dim: int) -> tuple[list[float], float, float]:
    """(inv_freq [dim / 2], cos / sin scale, softmax scale) from rope_parameters (transformers 5) or
    rope_theta + rope_scaling (the checkpoints' own config.json)."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported for {hf['architectures'][0]}; "
                                    f"accepted: {list(ROPE_TYPES)}")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    softmax_scale = qk_head_dim ** -0.5
    if rope_type == "default":
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return inv_freq.tolist(), 1.0, softmax_scale
    factor = float(rope["factor"])
    inv_freq = _yarn_inv_freq(dim, theta, rope)
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    cos_scale = rope.get("attention_factor")
    if cos_scale is None:
        cos_scale = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _mscale(factor, 1.0))
    if mscale_all_dim:  # MLA scales the whole q.k, not only the rotary part
        softmax_scale *= _mscale(factor, mscale_all_dim) ** 2
    return inv_freq.tolist(), float(cos_scale), softmax_scale


def _moe_layers(hf: dict[str, Any], num_layers: int, num_experts: int) -> list[bool]:
    first_dense = hf.get("first_k_dense_replace") or 0
    freq = hf.get("moe_layer_freq", 1) or 1
    if freq != 1:
        raise UnsupportedModelError(f"moe_layer_freq={freq} is not supported; accepted: 1 (every layer from "
                                    "first_k_dense_replace on has experts)")
    return [num_experts > 0 and i >= first_dense for i in range(num_layers)]


def _routing_keys(hf: dict[str, Any], is_v3: bool) -> str:
    """Set, in hf, the routing keys the loader reads after this module (model_config.apply_routing_fields)
    to what the architecture does when config.json leaves them out (transformers' files do); returns
    how a group of experts is scored (ModelConfig.group_score)."""
    method = hf.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
    accepted = ("noaux_tc",) if is_v3 else ("greedy", "group_limited_greedy")
    if method not in accepted:
        raise UnsupportedModelError(f"{hf['architectures'][0]} with topk_method={method!r} is not supported; "
                                    f"accepted: {list(accepted)}")
    hf["topk_method"] = method
    hf["scoring_func"] = hf.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")
    if method == "greedy":  # the top-k over every expert, whatever groups the config names
        hf["n_group"] = hf["topk_group"] = None
    elif not (hf.get("n_group") and hf.get("topk_group")):
        raise UnsupportedModelError(f"topk_method={method!r} needs n_group and topk_group in config.json")
    return "max" if method == "group_limited_greedy" else "top2_sum"


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    arch = hf["architectures"][0]
    is_v3 = arch == "DeepseekV3ForCausalLM"
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    num_layers = require(hf, "num_hidden_layers")
    num_experts = require(hf, "n_routed_experts", "num_local_experts", "num_experts")
    moe_size = require(hf, "moe_intermediate_size")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"{arch} with quantized weights (quantization_config {method!r}, e.g. DeepSeek's "
                                    "block-scaled fp8) is not supported; accepted: bf16 / fp16 / fp32 weights")
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias=true is not supported; accepted: false")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch} with mlp_bias=true is not supported; accepted: false")
    rope_dim, nope_dim = require(hf, "qk_rope_head_dim"), require(hf, "qk_nope_head_dim")
    if rope_dim % 2:
        raise UnsupportedModelError(f"qk_rope_head_dim={rope_dim} must be even (RoPE rotates pairs)")
    inv_freq, rope_scale, softmax_scale = _rope(hf, rope_dim, nope_dim + rope_dim)
    mla = MLAConfig(
        kv_lora_rank=require(hf, "kv_lora_rank"),
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=require(hf, "v_head_dim"),
        q_lora_rank=hf.get("q_lora_rank") or None,
        rope_interleave=bool(hf.get("rope_interleave", True)) if is_v3 else True,
        inv_freq=tuple(inv_freq),
        rope_scale=rope_scale,
        softmax_scale=softmax_scale,
    )
    group_score = _routing_keys(hf, is_v3)
    return ModelConfig(
        architecture=arch,
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=1,  # the latent cache: one entry per token, read by every head
        head_dim=mla.latent_width,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        num_experts=num_experts,
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=moe_size,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * moe_size,
        shared_expert_gated=False,
        dense_intermediate_size=hf.get("intermediate_size", 0) or 0,
        moe_layers=_moe_layers(hf, num_layers, num_experts),
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
        mla=mla,
        group_score=group_score,
    )


# DeepSeek's tensor names -> the engine's: the attention's own weights straight onto the MLA module's
# parameters (the loader's 'moekv:' rule: a name already the engine's), the shared experts onto the
# loader's shared_expert rules
_ATTN = re.compile(r"model\.(layers\.\d+\.self_attn)\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
                   r"\.weight$")
_ATTN_NORM = re.compile(r"model\.(layers\.\d+\.self_attn\.(?:q_a_layernorm|kv_a_layernorm)\.weight)$")


def canonical_name(name: str) -> str:
    m = _ATTN.match(name)
    if m:
        return f"moekv:{m.group(1)}.{m.group(2)}"
    m = _ATTN_NORM.match(name)
    if m:
        return f"moekv:{m.group(1)}"
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def ignored_tensor(name: str, cfg: ModelConfig) -> bool:
    """The multi-token-prediction layers DeepSeek-V3 checkpoints append after the decoder's
    (model.layers.<num_hidden_layers + i>.*): training-time heads the engine does not run."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_layers
