"""Quantize-on-load: a loaded 16-bit model's experts, attention projections (GQA attention's qkv and o;
latent attention's projections stay 16-bit) and LM head replaced by QuantizedWeights
(ops/quantized_weight.py); norms, routers, embeddings, dense MLPs and shared experts stay 16-bit. A
tied LM head (the embedding) stays 16-bit too."""
from __future__ import annotations

import torch
from torch import nn

from moekv.layers.attention import Attention
from moekv.layers.moe import SparseMoE
from moekv.models.decoder import MoEDecoder
from moekv.models.model_config import ModelConfig
from moekv.ops.quantized_weight import INT4_GROUP, QuantizedWeight, quantize

QUANTIZED_ATTENTION = ("qkv_proj", "o_proj")
QUANTIZED_EXPERTS = ("w13", "w2")


def replace_weight(module: nn.Module, name: str, weight: QuantizedWeight) -> None:
    """Put a QuantizedWeight where the parameter `name` was (the parameter is dropped, its memory freed)."""
    module._parameters.pop(name, None)
    module._modules.pop(name, None)
    setattr(module, name, weight)


def quantize_stacked(w: torch.Tensor, method: str) -> QuantizedWeight:
    """quantize() of a stacked [E, N, K] weight one expert at a time (a fraction of the whole
    weight's fp32 temporaries), the codes and scales stacked after."""
    parts = [quantize(w[e], method) for e in range(w.shape[0])]
    first = parts[0]
    zeros = None if first.zeros is None else torch.stack([p.zeros for p in parts])
    return QuantizedWeight(method, tuple(w.shape), torch.stack([p.codes for p in parts]),
                           torch.stack([p.scales for p in parts]), first.scale_block, zeros)


@torch.no_grad()
def quantize_model(model: MoEDecoder, method: str) -> MoEDecoder:
    """Quantize, in place, every 16-bit weight of the chosen kinds that is not quantized already
    (a pre-quantized checkpoint's, or GPTQ's after a calibration pass, are kept as they are)."""
    for layer in model.layers:
        for name in QUANTIZED_ATTENTION if isinstance(layer.self_attn, Attention) else ():
            w = getattr(layer.self_attn, name)
            if not isinstance(w, QuantizedWeight):
                replace_weight(layer.self_attn, name, quantize(w.data, method))
        if isinstance(layer.mlp, SparseMoE):
            for name in QUANTIZED_EXPERTS:
                w = getattr(layer.mlp, name)
                if not isinstance(w, QuantizedWeight):
                    replace_weight(layer.mlp, name, quantize_stacked(w.data, method))
    if model.lm_head is not None and not isinstance(model.lm_head, QuantizedWeight):
        replace_weight(model, "lm_head", quantize(model.lm_head.data, method))
    if next(model.buffers()).is_cuda:
        torch.cuda.empty_cache()  # the 16-bit weights' blocks back to the device (the KV pools are sized from free memory)
    return model


def empty_quantized(method: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device | str = "meta") -> QuantizedWeight:
    """An uninitialised QuantizedWeight in the layout quantize() gives a [*batch, N, K] weight of
    `dtype` (random-weight benchmarks build the model quantized, never in 16-bit)."""
    *batch, N, K = shape
    if method == "fp8":
        return QuantizedWeight("fp8", shape, torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                               torch.empty(*batch, N, 1, device=device), (1, K))
    scale_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    groups = (*batch, N, -(-K // INT4_GROUP))
    return QuantizedWeight("int4", shape, torch.empty(*batch, N, K // 8, dtype=torch.int32, device=device),
                           torch.empty(groups, dtype=scale_dtype, device=device), (1, INT4_GROUP),
                           torch.empty(groups, dtype=scale_dtype, device=device))


def install_empty_quantized(model: MoEDecoder, method: str, dtype: torch.dtype) -> None:
    """On a meta model (before allocation): every weight quantize_model would quantize replaced by
    an empty QuantizedWeight of its layout."""
    for layer in model.layers:
        for name in QUANTIZED_ATTENTION if isinstance(layer.self_attn, Attention) else ():
            replace_weight(layer.self_attn, name, empty_quantized(method, tuple(getattr(layer.self_attn, name).shape),
                                                                  dtype))
        if isinstance(layer.mlp, SparseMoE):
            for name in QUANTIZED_EXPERTS:
                replace_weight(layer.mlp, name, empty_quantized(method, tuple(getattr(layer.mlp, name).shape), dtype))
    if model.lm_head is not None:
        replace_weight(model, "lm_head", empty_quantized(method, tuple(model.lm_head.shape), dtype))


def weight_quantization(model: MoEDecoder) -> str | None:
    """The method of the model's quantized weights ('fp8', 'int4'), None if it has none."""
    methods = {m.method for m in model.modules() if isinstance(m, QuantizedWeight)}
    if len(methods) > 1:
        raise ValueError(f"the model mixes weight quantizations {sorted(methods)}")
    return methods.pop() if methods else None


def weight_bytes(model: MoEDecoder) -> int:
    """Bytes of every parameter and quantized weight (codes, scales, zero points)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))


def matrix_bytes(N: int, K: int, method: str | None, elem_bytes: int = 2) -> int:
    """Bytes of an [N, K] weight as quantize-on-load stores it: 16-bit; fp8 codes + an fp32 scale per
    row; int4 codes + a 16-bit scale and zero point per group of 128."""
    if method is None:
        return elem_bytes * N * K
    if method == "fp8":
        return N * K + 4 * N
    return N * K // 2 + 2 * elem_bytes * N * -(-K // INT4_GROUP)


def weight_footprint(cfg: ModelConfig, method: str | None, elem_bytes: int = 2) -> tuple[int, int]:
    """(bytes of all weights, bytes a batch-1 decode step reads: every attention weight, router and
    norm, the top_k experts of each MoE layer, dense MLPs, shared experts and the LM head) with the
    experts, attention projections and (untied) LM head stored as `method` stores them."""
    total, active = cfg.parameter_counts()
    h, I, q, kv = cfg.hidden_size, cfg.moe_intermediate_size, cfg.q_size, cfg.kv_size
    attn_params = 0 if cfg.mla is not None else h * (q + 2 * kv) + q * h  # latent attention stays 16-bit
    attn = 0 if cfg.mla is not None else (matrix_bytes(q + 2 * kv, h, method, elem_bytes)
                                          + matrix_bytes(h, q, method, elem_bytes))
    expert_params = 3 * h * I
    expert = matrix_bytes(2 * I, h, method, elem_bytes) + matrix_bytes(h, I, method, elem_bytes)
    n_moe = sum(cfg.moe_layers)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    quantized_total = cfg.num_layers * attn_params + n_moe * cfg.num_experts * expert_params + head
    quantized_active = cfg.num_layers * attn_params + n_moe * cfg.top_k * expert_params + head
    stored = cfg.num_layers * attn + (matrix_bytes(cfg.vocab_size, h, method, elem_bytes) if head else 0)
    total_bytes = elem_bytes * (total - quantized_total) + stored + n_moe * cfg.num_experts * expert
    # a step reads one embedding row, not the table
    embed = cfg.vocab_size * h
    read = elem_bytes * (active - quantized_active - embed + h) + stored + n_moe * cfg.top_k * expert
    return total_bytes, read
