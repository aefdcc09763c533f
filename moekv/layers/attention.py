from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.context import Context
from moekv.kvcache.formats import LayerKVCache
from moekv.layers.hooks import LayerHooks
from moekv.layers.norms import RMSNorm
from moekv.layers.rotary import RotaryEmbedding
from moekv.models.model_config import ModelConfig
from moekv.ops.quantized_weight import QuantizedWeight


def project(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a few tokens on the GPU go through the one-launch GEMV (ops/dense_gemv.py); a
    quantized weight through ops/quant_linear.py. Every dense projection of a layer goes through
    here (GQA's qkv and o, MLA's, the shared experts' and dense MLPs')."""
    if isinstance(weight, QuantizedWeight):
        from moekv.ops.quant_linear import quant_linear

        return quant_linear(x, weight, bias)
    if x.is_cuda:
        from moekv.ops.dense_gemv import linear

        return linear(x, weight, bias)
    return F.linear(x, weight, bias)


def attend_mixed(attend, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
                 sliding_window: int | None, step_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **sinks) -> torch.Tensor:
    """Attention of a mixed step (ctx.mixed): the one-token queries and the longer ones each
    through `attend` (a format's) with their own Context, then back in the step's order. The
    step's k, v (step_kv) go with the prefill rows; one-token queries read the cache only.
    sinks: {'sinks': [Hq]} for a model with attention sinks, else empty."""
    split = ctx.mixed
    out = torch.empty_like(q)
    out[split.decode_rows] = attend(q[split.decode_rows], cache, split.decode, scale, sliding_window, **sinks)
    prefill_kv = None if step_kv is None else tuple(x[split.prefill_rows] for x in step_kv)
    out[split.prefill_rows] = attend(q[split.prefill_rows], cache, split.prefill, scale, sliding_window, prefill_kv,
                                     **sinks)
    return out


class Attention(nn.Module):
    """GQA self-attention whose K/V live in a paged cache of some KV format.

    Its KV format and pool are its layer's hooks (layers/hooks.LayerHooks: the model runner binds
    them after allocating the pools, with the K/V observer, the fused-write switch and the
    tensor-parallel group); each step the new tokens' K/V are written to their pages first, then
    every query attends over its sequence's context: the cache, and for a prefill chunk its own
    tokens' K/V as computed this step, which the format's `attend` takes beside the cache
    (KVFormat.attend's step_kv).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, hooks: LayerHooks | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, cfg.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if cfg.qkv_bias else None
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size))
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "per_head":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(self.q_size, cfg.rms_norm_eps), RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        self.sliding_window = cfg.layer_windows[layer_idx]
        # gpt-oss: a logit per query head entering the softmax as a key whose value is 0
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta, cfg.rotary_dim, cfg.yarn)
        # with hooks.tp (tensor parallel): this rank's heads only; o_proj's output is all-reduced
        self.hooks = hooks if hooks is not None else LayerHooks()

    @property
    def kv_cache(self) -> LayerKVCache | None:
        """This layer's KV pool (hooks.kv_cache)."""
        return self.hooks.kv_cache

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        T = x.shape[0]
        if self.hooks.projection_observer is not None:
            self.hooks.projection_observer("qkv_proj", x)
        qkv = project(x, self.qkv_proj, self.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":  # OLMoE normalises the whole projection, before clipping
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":  # Qwen3 normalises each head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        hooks = self.hooks
        fmt, cache = hooks.kv_format, hooks.kv_cache
        target = None
        fuse = x.is_cuda if hooks.fuse_rope_write is None else hooks.fuse_rope_write
        # an observer needs the rotated k: the unfused path
        if fuse and hooks.kv_observer is None:
            target = fmt.fused_rope_write_target(cache, k, ctx)
        if target is not None:
            from moekv.ops.rope_kv_write import rope_kv_write

            rotary = self.rotary
            q = rope_kv_write(ctx.positions, q, k, v, rotary.theta, target.k_dest, target.v_dest, target.index,
                              target.staged, target.k_ring, target.v_ring, rotary.rotary_dim, rotary.inv_freq(q.device),
                              rotary.scale)
            # k stays unrotated here, so no step_kv: compressed formats fuse the store in one-token
            # steps only, which read the cache alone; plain ones read pages that hold the K/V as computed
            step_kv = None
        else:
            q, k = self.rotary(ctx.positions, q, k)
            if hooks.kv_observer is not None:
                hooks.kv_observer(self.layer_idx, k, v)
            fmt.write(cache, k, v, ctx)
            step_kv = (k, v) if hooks.exact_prefill else None
        # only a model with sinks passes them: a format without sink support still serves the others
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if ctx.mixed is not None:  # decodes beside prefill chunks: each part on its own (the decodes' kernel)
            o = attend_mixed(fmt.attend, q, cache, ctx, self.scale, self.sliding_window, step_kv, **sinks)
        else:
            o = fmt.attend(q, cache, ctx, self.scale, self.sliding_window, step_kv, **sinks)
        if hooks.projection_observer is not None:
            hooks.projection_observer("o_proj", o.reshape(T, self.q_size))
        if hooks.tp is None:
            return project(o.reshape(T, self.q_size), self.o_proj, self.o_bias)
        out = hooks.tp.all_reduce(project(o.reshape(T, self.q_size), self.o_proj, None))  # partial sums
        return out if self.o_bias is None else out + self.o_bias
