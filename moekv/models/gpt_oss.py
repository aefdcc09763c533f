"""GptOssForCausalLM (gpt-oss-20b / 120b): attention with biases, a learned sink logit per query
head and alternating sliding-window / full layers (`layer_types`), YaRN RoPE, a router with a logit
bias whose top-k logits are softmaxed (= softmax over all experts, top-k, renormalised), experts with
biases and a clamped SwiGLU, expert weights in bf16 or MXFP4 (`*_blocks` / `*_scales`: kept as
MXFP4 QuantizedWeights for the fused kernels on a CUDA device, dequantized to the model's dtype on
load elsewhere).

The checkpoint stores experts stacked and transposed ([E, in, out]: gate_up_proj [E, H, 2I] with
gate and up columns interleaved, down_proj [E, I, H]); the reader below turns them into the
engine's layout: [E, out, in], w13's gate rows then up rows (its bias likewise), as every other
architecture's experts, so the fused MoE kernels read them unchanged. gpt-oss's H equals I, so the
orientation cannot be told from the shapes."""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from moekv.models.model_config import (ClampedSwiGLU, ModelConfig, UnsupportedModelError, YarnRope, dtype_from,
                                       eos_ids_from, require)
from moekv.models.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4, empty_mxfp4, mxfp4_weight
from moekv.ops.quantized_weight import QuantizedWeight

ARCHITECTURES = ("GptOssForCausalLM",)
# quantization_config methods this module reads itself (its TensorReader), not the loader's prequantized path
READS_QUANTIZATION = ("mxfp4",)

LAYER_TYPES = ("sliding_attention", "full_attention")


def yarn_from(hf: dict[str, Any]) -> tuple[float, YarnRope | None]:
    """(rope_theta, YarnRope or None) from `rope_parameters` (transformers 5) or `rope_scaling` (4)."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 150000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise UnsupportedModelError(f"GptOssForCausalLM with rope type {rope_type!r} is not supported; "
                                    "accepted: 'yarn', 'default'")
    if params.get("mscale") or params.get("mscale_all_dim"):
        raise UnsupportedModelError("GptOssForCausalLM: YaRN with mscale / mscale_all_dim is not supported; "
                                    "accepted: factor, beta_fast, beta_slow, truncate, attention_factor")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("GptOssForCausalLM: partial_rotary_factor != 1 is not supported; accepted: 1.0")
    original = require(params, "original_max_position_embeddings")
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0  # YaRN's mscale
    return theta, YarnRope(factor=float(factor), original_max_position_embeddings=int(original),
                           beta_fast=float(params.get("beta_fast") or 32.0),
                           beta_slow=float(params.get("beta_slow") or 1.0),
                           truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))


def layer_windows_from(hf: dict[str, Any], num_layers: int) -> list[int | None]:
    """Per layer: `sliding_window` for 'sliding_attention' layers, None for 'full_attention' ones
    (transformers' default when layer_types is absent: sliding on even layers, full on odd)."""
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"GptOssForCausalLM: layer_types {unknown} are not supported; "
                                    f"accepted: {list(LAYER_TYPES)}")
    window = hf.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError("GptOssForCausalLM: layer_types has sliding_attention layers but "
                                    "sliding_window is not set (a positive number of tokens is needed)")
    return [window if t == "sliding_attention" else None for t in types]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise UnsupportedModelError(f"GptOssForCausalLM quantized with {quant.get('quant_method')!r} is not "
                                    "supported; accepted: none (bf16 experts) or 'mxfp4' (dequantized on load)")
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    num_layers = require(hf, "num_hidden_layers")
    theta, yarn = yarn_from(hf)
    return ModelConfig(
        architecture="GptOssForCausalLM",
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        num_experts=require(hf, "num_local_experts", "num_experts"),
        top_k=require(hf, "num_experts_per_tok"),
        moe_intermediate_size=require(hf, "intermediate_size"),
        norm_topk_prob=True,  # softmax over the top-k logits
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=bool(hf.get("attention_bias", True)),
        o_bias=bool(hf.get("attention_bias", True)),
        sliding_window=hf.get("sliding_window"),
        layer_windows=layer_windows_from(hf, num_layers),
        attention_sinks=True,
        yarn=yarn,
        router_logit_bias=True,
        clamped_swiglu=ClampedSwiGLU(alpha=float(hf.get("swiglu_alpha", 1.702)),
                                     limit=float(hf.get("swiglu_limit", 7.0))),
        torch_dtype=dtype_from(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from(hf.get("eos_token_id")),
    )


_RENAMES = ((".mlp.router.weight", ".mlp.gate.weight"), (".mlp.router.bias", ".mlp.gate_bias"))


def canonical_name(name: str) -> str:
    """gpt-oss's router -> the loader's mlp.gate names (weight; its logit bias as mlp.gate_bias)."""
    for old, new in _RENAMES:
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


_STACKED = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)$")
_INTERLEAVED = re.compile(r".*\.mlp\.experts\.gate_up_proj(_bias)?$")


def gate_rows_then_up_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up interleaved (gate at even rows) -> gate rows, then up rows."""
    return torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)


EXPERT_WEIGHTS = ("w13", "w2")


def install_mxfp4_experts(model) -> set[str]:
    """On a meta model (before allocation): every MoE layer's w13 and w2 replaced by an empty MXFP4
    QuantizedWeight of its shape, for a TensorReader(keep_mxfp4=True) to fill; returns their names."""
    from moekv.layers.moe import SparseMoE
    from moekv.models.quantize import replace_weight

    names = set()
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            for attr in EXPERT_WEIGHTS:
                replace_weight(layer.mlp, attr, empty_mxfp4(tuple(getattr(layer.mlp, attr).shape)))
                names.add(f"layers.{i}.mlp.{attr}")
    return names


class TensorReader:
    """Reads one checkpoint's tensors for the loader: stacked experts transposed to [E, out, in],
    gate_up's (and its bias's) interleaved rows split into gate rows then up rows;
    an MXFP4 pair (`<name>_blocks`, `<name>_scales`, possibly in different files) held until both
    halves are read, then dequantized to `<name>` in `dtype`, or with keep_mxfp4 returned as an MXFP4
    QuantizedWeight (its rows reordered alike). Everything else is left to the loader."""

    def __init__(self, dtype: torch.dtype, keep_mxfp4: bool = False) -> None:
        self.dtype = dtype
        self.keep_mxfp4 = keep_mxfp4
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def read(self, raw_name: str, f) -> tuple[str, torch.Tensor | QuantizedWeight | None] | None:
        """(name, tensor) for the loader (tensor None: read `name` from f as usual; a QuantizedWeight:
        a kept MXFP4 pair), or None: the first half of an MXFP4 pair, kept until its other half comes."""
        for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
            if raw_name.endswith(suffix):
                base = raw_name[: -len(suffix)]
                halves = self.pending.setdefault(base, {})
                halves[suffix] = f.get_tensor(raw_name)
                if len(halves) < 2:
                    return None
                del self.pending[base]
                # blocks and scales rows are already [E, out, ...]: no transpose
                if self.keep_mxfp4:
                    return base, mxfp4_weight(self._rows(base, halves[BLOCKS_SUFFIX]),
                                              self._rows(base, halves[SCALES_SUFFIX]))
                return base, self._rows(base, dequantize_mxfp4(halves[BLOCKS_SUFFIX], halves[SCALES_SUFFIX],
                                                               self.dtype))
        if _STACKED.match(raw_name):
            return raw_name, self._rows(raw_name, f.get_tensor(raw_name).transpose(-1, -2))
        if _INTERLEAVED.match(raw_name):
            return raw_name, self._rows(raw_name, f.get_tensor(raw_name))
        return raw_name, None

    @staticmethod
    def _rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return gate_rows_then_up_rows(tensor) if _INTERLEAVED.match(name) else tensor

    def finish(self) -> None:
        """Raise if an MXFP4 tensor lacks one of its halves."""
        if self.pending:
            base, halves = next(iter(self.pending.items()))
            missing = SCALES_SUFFIX if BLOCKS_SUFFIX in halves else BLOCKS_SUFFIX
            raise ValueError(f"MXFP4 tensor {base!r} has no {base + missing!r} in the checkpoint "
                             f"({len(self.pending)} incomplete pairs)")
