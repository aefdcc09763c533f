"""The MoE decoder shared by every supported architecture (they differ only in ModelConfig)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.context import Context
from moekv.layers.attention import Attention
from moekv.layers.hooks import DecoderHooks, LayerHooks
from moekv.layers.mla import MLAttention
from moekv.layers.mlp import GatedMLP
from moekv.layers.moe import SparseMoE
from moekv.layers.norms import RMSNorm
from moekv.models.model_config import ModelConfig
from moekv.ops.quantized_weight import QuantizedWeight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        # what the engine plugs into this layer, one object shared by its attention and MLP
        self.hooks = LayerHooks()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # multi-head latent attention (DeepSeek) or GQA
        self.self_attn = (MLAttention(cfg, layer_idx, self.hooks) if cfg.mla is not None
                          else Attention(cfg, layer_idx, self.hooks))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(cfg, self.hooks)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, self.hooks)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's output, still to be added to it (None
        before the first layer). Returns (x, this layer's output): each residual add is done by the
        next norm, in the same launch."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        attn = self.self_attn(h, ctx)
        if self.hooks.after_attention is not None:  # the expert L2 prefetch's late launch point
            self.hooks.after_attention(attn)
        if isinstance(self.mlp, SparseMoE) and self.mlp.router_fuses_norm:  # the norm shares a pass with a coarse gate
            x = x + attn
            return x, self.mlp(x, norm=self.post_attention_layernorm)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        return x, self.mlp(h)


class MoEDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # the model-wide hooks (before_layer, after_layers) and every layer's (layers/hooks.py)
        self.hooks = DecoderHooks([layer.hooks for layer in self.layers])
        # the running step's Context while a before_layer hook is installed (the hook reads the
        # step's sequences from it: expert offload's previous-token prediction)
        self.step_ctx = None

    @property
    def attention_layers(self) -> list[Attention | MLAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, H] (normalised)."""
        x, delta = F.embedding(input_ids, self.embed_tokens), None
        before_layer, after_layers = self.hooks.before_layer, self.hooks.after_layers
        if before_layer is not None:
            self.step_ctx = ctx
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i, x, delta)
            x, delta = layer(x, delta, ctx)
        if after_layers is not None:
            after_layers()
        hidden = self.norm.add_and_norm(x, delta)[1]
        if self.hooks.hidden_observer is not None:
            self.hooks.hidden_observer(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in fp32."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(weight, QuantizedWeight):
            from moekv.ops.quant_linear import quant_linear

            return quant_linear(hidden, weight).float()
        return F.linear(hidden, weight).float()
