"""What the engine plugs into a decoder from outside its weights, in one place: a `LayerHooks` per
decoder layer (shared by the layer's attention and MLP modules) and a `DecoderHooks` for the whole
model. The modules only read them; what sets each field is named beside it.

An MoE layer's `experts` is its ExpertExecutor: how it computes its routed experts, chosen once
(layers/moe.py: the reference or the Triton kernel by device; layers/parallel.ExpertParallel;
experts/offload.OffloadedExperts)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moekv.kvcache.formats import KVFormat, LayerKVCache
from moekv.routing.base import Router, RoutingObserver


class ExpertExecutor(Protocol):
    """(x [T, H], w13 [E, 2I, H], w2 [E, H, I] as the module holds them, weights [T, k],
    expert_ids [T, k]) -> this rank's routed output [T, H]."""

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class LayerHooks:
    """One decoder layer's behaviours set from outside the model (None: not in use)."""

    # attention: the layer's KV format and pool (the runner's allocate phase, engine/model_runner.py)
    kv_format: KVFormat | None = None
    kv_cache: LayerKVCache | None = None
    # callback(layer_idx, k, v) seeing each step's post-RoPE K/V [T, Hkv, D] before they are stored
    # (calibration, tools/calibrate.py)
    kv_observer: Callable | None = None
    # RoPE + K/V store in one kernel (ops/rope_kv_write.py) where the format allows it: None = on CUDA
    # only (the CPU keeps the references); True / False force it (tests)
    fuse_rope_write: bool | None = None
    # True: a prefill chunk attends to its own tokens' K/V as computed (and earlier tokens as stored);
    # False: it reads its own tokens back from the cache as decode does, so outputs do not depend on
    # where chunks or a cached prefix end (tests of page bookkeeping)
    exact_prefill: bool = True
    # MoE: the router (models/loader.install_routers; routing/tap.py wraps it), the engine's counter of
    # its decisions (the runner's install phase), the ExpertExecutor (models/loader.empty_model, then
    # layers/parallel.shard_moe or experts/offload.install_expert_offload)
    router: Router | None = None
    observer: RoutingObserver | None = None
    experts: ExpertExecutor | None = None
    # tensor parallel (a layers/parallel.TPGroup, set by layers/parallel.py's shard_*): the layer's
    # attention and MLP outputs are this rank's partial sums, all-reduced
    tp: Any = None
    # called as after_attention(attn_out) (the expert L2 prefetch's late launch point, experts/l2_prefetch.py)
    after_attention: Callable | None = None
    # called as projection_observer(name, x) with the input x [T, K] of the attention projection `name`
    # ('qkv_proj', 'o_proj') before it runs (GPTQ calibration of int4 weights, models/gptq.py)
    projection_observer: Callable | None = None


@dataclass(eq=False)
class DecoderHooks:
    """The model-wide hooks, and each layer's LayerHooks (`layers[i]`, the object layer i's modules read)."""

    layers: list[LayerHooks] = field(default_factory=list)
    # called as before_layer(i, x, delta) before layer i runs (expert offload's prefetch,
    # experts/offload.py; the expert L2 prefetch, experts/l2_prefetch.py; GPTQ's record of the
    # calibration steps, models/gptq.CalibrationRecord)
    before_layer: Callable | None = None
    # called as after_layers() once the last layer has run (joins the L2 prefetch's side stream)
    after_layers: Callable | None = None
    # called as hidden_observer(hidden) with the final norm's output [T, H], every row (the LM head's
    # input, for a caller that wants it; GPTQ's calibration reads it from its own replay)
    hidden_observer: Callable | None = None
