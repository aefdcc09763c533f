"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache (kvcache/formats/latent.py).

Each token's K/V are cached as one entry: c_kv = RMSNorm(kv_a(x)[:R]) (R = kv_lora_rank) and the
rotated shared key k_rope = RoPE(kv_a(x)[R:]). Head h's key is [W_UK[h] c_kv, k_rope] and its value
W_UV[h] c_kv, with W_UK, W_UV the two halves of kv_b_proj. Two ways to attend, equal in exact math:

  - expanded (prefill chunks): the sequence's entries go through kv_b_proj into per-head K [L, H,
    nope + rope] and V [L, H, v_head_dim]; ordinary causal attention. Cheap when the queries are many.
  - absorbed (decode): q_nope goes through W_UK into the latent space (q_lat [H, R]), so every head
    scores the entries themselves: q_lat . c_kv + q_rope . k_rope; the weighted sum of the c_kv
    [H, R] goes through W_UV. One latent head read by every query head: the bytes decode streams are
    the cache's, W wide per token, whatever the number of heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.context import Context
from moekv.kvcache.formats.dense import is_decode_only
from moekv.layers.attention import project
from moekv.layers.hooks import LayerHooks
from moekv.layers.norms import RMSNorm
from moekv.models.model_config import ModelConfig
from moekv.ops.reference import causal_attention_ref, mla_rope_apply_ref, mla_rope_cos_sin_ref

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm are built with the default eps, not rms_norm_eps


def fused_glue(x: torch.Tensor, norm: RMSNorm) -> bool:
    """Whether a step's RoPE, kv_a_layernorm and entry take ops/mla_rope_norm.py (one launch): on CUDA,
    with the norm's weight in the activations' dtype (as RMSNorm's own kernel)."""
    return x.is_cuda and norm.weight.dtype == x.dtype


class MLAttention(nn.Module):
    """MLA self-attention whose latent entries live in a paged latent cache; its format and pool are
    its layer's hooks (layers/hooks.LayerHooks), as for Attention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, hooks: LayerHooks | None = None) -> None:
        super().__init__()
        m = cfg.mla
        self.layer_idx, self.mla = layer_idx, m
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = 1, m.latent_width  # the cache's view: one latent entry per token
        q_out = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Parameter(torch.empty(q_out, cfg.hidden_size))
        else:
            self.q_a_proj = nn.Parameter(torch.empty(m.q_lora_rank, cfg.hidden_size))
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Parameter(torch.empty(q_out, m.q_lora_rank))
        self.kv_a_proj_with_mqa = nn.Parameter(torch.empty(m.latent_width, cfg.hidden_size))
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Parameter(torch.empty(cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_heads * m.v_head_dim))
        self.scale = m.softmax_scale
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # not a buffer: loading fills parameters only
        self.hooks = hooks if hooks is not None else LayerHooks()

    @property
    def kv_cache(self):
        return self.hooks.kv_cache

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = torch.tensor(self.mla.inv_freq, dtype=torch.float32, device=device)
        return self._inv_freq[device]

    def rope_cos_sin(self, ctx: Context, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, r/2] of the step's positions (reference.mla_rope_cos_sin_ref): the same in
        every layer (one MLAConfig per model), so the step's first MLA layer computes them and the others
        read them from ctx.step_values (eight launches a layer fewer). Kept with the positions tensor
        they came from and whether a CUDA graph was being captured: a Context whose positions were
        swapped recomputes them, and so does one reused across a capture's edge (a graph must hold
        the launches that compute them; outside it, its tensors change only when it replays)."""
        positions = ctx.positions
        capturing = positions.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        key = ("mla_rope_cos_sin", id(self.mla), dtype)
        hit = ctx.step_values.get(key)
        if hit is None or hit[0] is not positions or hit[1] != capturing:
            hit = ctx.step_values[key] = (positions, capturing, *mla_rope_cos_sin_ref(
                positions, self.inv_freq(positions.device), self.mla.rope_scale, dtype))
        return hit[2], hit[3]

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v_head_dim, R]): kv_b_proj's rows per head."""
        m = self.mla
        w = self.kv_b_proj.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        m, hooks = self.mla, self.hooks
        if hooks.tp is not None:
            raise RuntimeError("multi-head latent attention is not split over tensor-parallel ranks")
        if hooks.kv_observer is not None:
            raise RuntimeError("KV calibration observes per-head K/V; a multi-head latent attention model caches "
                               "latents, and its latent formats (bf16, fp8_e4m3) need no calibration")
        T = x.shape[0]
        if m.q_lora_rank is None:
            q = project(x, self.q_proj)
        else:
            q = project(self.q_a_layernorm(project(x, self.q_a_proj)), self.q_b_proj)
        q_nope, q_rope = q.view(T, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        kv = project(x, self.kv_a_proj_with_mqa)  # [T, W]: c_kv, then the shared key
        cos, sin = self.rope_cos_sin(ctx, x.dtype)
        norm = self.kv_a_layernorm
        q_abs = None  # the absorbed decode's queries [T, H, W], q_rope already in columns R: (CUDA)
        if fused_glue(x, norm):  # the rotations, the norm and the entry in one launch
            from moekv.ops.mla_rope_norm import mla_rope_norm

            q_abs, entries = mla_rope_norm(q, kv, cos, sin, norm.weight, norm.eps, self.num_heads,
                                           m.qk_nope_head_dim, m.rope_interleave)
            q_rope = q_abs[..., m.kv_lora_rank:]
        else:  # reference.mla_rope_norm_ref's ops: q's heads and the shared key rotated in one pass
            c_kv, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
            rotated = mla_rope_apply_ref(torch.cat([q_rope, k_rope[:, None]], dim=1), cos, sin, m.rope_interleave)
            q_rope, k_rope = rotated[:, :self.num_heads], rotated[:, self.num_heads]
            entries = torch.cat([norm(c_kv), k_rope], dim=-1)  # [T, W]
        fmt, cache = hooks.kv_format, hooks.kv_cache
        fmt.write(cache, entries, None, ctx)
        step_kv = (entries, None) if hooks.exact_prefill else None
        if ctx.mixed is not None:  # decodes beside prefill chunks: each part its own way
            split = ctx.mixed
            o = q_nope.new_empty(T, self.num_heads, m.v_head_dim)
            o[split.decode_rows] = self._absorbed(q_nope[split.decode_rows], q_rope[split.decode_rows], split.decode,
                                                  None)
            part_kv = None if step_kv is None else (entries[split.prefill_rows], None)
            o[split.prefill_rows] = self._expanded(q_nope[split.prefill_rows], q_rope[split.prefill_rows],
                                                   split.prefill, part_kv)
        elif is_decode_only(q_nope, ctx):
            o = self._absorbed(q_nope, q_rope, ctx, step_kv, q_abs)
        else:
            o = self._expanded(q_nope, q_rope, ctx, step_kv)
        return project(o.reshape(T, -1), self.o_proj)

    def _absorbed(self, q_nope, q_rope, ctx: Context, step_kv, q_abs: torch.Tensor | None = None) -> torch.Tensor:
        """Decode: [T, H, nope], [T, H, rope] -> [T, H, v_head_dim] through the latent space. q_abs
        [T, H, R + rope]: a buffer whose columns R: hold q_rope (ops/mla_rope_norm.py), into whose
        first R columns q_lat is multiplied (no concatenation); None: q_lat and q_rope concatenated.
        The output is multiplied into a [T, H, v_head_dim] buffer, so o_proj reads it as it lies."""
        w_uk, w_uv = self.up_weights()
        T, H, R = q_nope.shape[0], self.num_heads, self.mla.kv_lora_rank
        if q_abs is None:
            q_abs = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], dim=-1)
        else:  # [H, T, nope] @ [H, nope, R] into the buffer's [H, T, R] view
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_abs[..., :R].transpose(0, 1))
        o_lat = self.hooks.kv_format.attend(q_abs, self.hooks.kv_cache, ctx, self.scale, None, step_kv)  # [T, H, R]
        o = q_nope.new_empty(T, H, self.mla.v_head_dim)
        torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return o

    def _expanded(self, q_nope, q_rope, ctx: Context, step_kv) -> torch.Tensor:
        """Prefill: each sequence's entries expanded into per-head K, V; causal attention."""
        m, fmt, cache = self.mla, self.hooks.kv_format, self.hooks.kv_cache
        H = self.num_heads
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = q.new_empty(q.shape[0], H, m.v_head_dim)
        for lo, hi, entries in fmt.step_sequences(cache, ctx, step_kv, q.dtype):  # entries [L, W]
            length = entries.shape[0]
            kv = F.linear(entries[:, :m.kv_lora_rank], self.kv_b_proj).view(length, H, -1)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k = torch.cat([k_nope, entries[:, None, m.kv_lora_rank:].expand(length, H, m.qk_rope_head_dim)], dim=-1)
            out[lo:hi] = causal_attention_ref(q[lo:hi], k, v, self.scale)
        return out
