"""GPTQ rounding of INT4 weights (Frantar et al., 2022): each column is rounded in turn and its rounding
error spread over the columns not yet rounded, weighted by the inverse of the layer inputs' second
moment H = X^T X, so the error of X W^T rather than of W is kept small.

Block by block, as GPTQ is published (`round_blockwise`): the calibration text runs once through the
16-bit model while a `CalibrationRecord` keeps each step's input to the first decoder layer and its
Context (and the pages released between steps); then, for each decoder layer (block) l in turn, the
recorded steps run through block l alone to collect the second moments of its weights' inputs, the
block is rounded, and the steps run through the rounded block to become block l + 1's inputs. Block
l's second moments are freed before block l + 1's are collected, so the memory they take is one
block's; the LM head's come last, from the final norm of the stream the rounded blocks give.

`ExpertInputs` wraps a MoE layer's ExpertExecutor and accumulates, per expert, H of the rows routed to
it (for w13: the layer's input x; for w2: silu(x W1^T) * (x W3^T) from the 16-bit weights);
`InputMoments` accumulates H of other weights' inputs (the attention projections' and the LM head's,
fed by the decoder's projection_observer / hidden_observer hooks). Each call's products are formed in
fp64 and added into fp32 (`HESSIAN_DTYPE`: half fp64's memory, and the rounding it gives matches
fp64 accumulation's: docs/decisions.md, "GPTQ block by block"). `gptq_int4` rounds one [N, K]
matrix into quantize-on-load's int4 layout (groups of 128 with zero points, each group's scale and
zero point taken when its first column comes up, from the columns as the error updates left them).
Columns in natural order by default, blocks of one group; act_order is kept for measurements (on
domain-moe it lost to natural order: docs/decisions.md, "int4 with a calibration text").
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moekv.context import Context
from moekv.layers.attention import Attention
from moekv.layers.moe import SparseMoE
from moekv.models.quantize import QUANTIZED_ATTENTION, replace_weight
from moekv.ops.quantized_weight import INT4_GROUP, QuantizedWeight, pack_int4, quantize_int4

DAMP = 0.01  # of the mean diagonal of H, added to it (keeps the Cholesky factor well conditioned)
HESSIAN_DTYPE = torch.float32  # what second moments are accumulated in (each call's product in fp64)


class ExpertInputs:
    """An ExpertExecutor that runs the wrapped one and adds each expert's routed rows to its
    second-moment matrices: h13[e] = sum x x^T (H x H), h2[e] = sum a a^T (I x I), each call's sum
    formed in fp64 and added in `dtype` (None: HESSIAN_DTYPE), on x's device."""

    def __init__(self, inner, num_experts: int, hidden: int, intermediate: int, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
        self.inner = inner
        dtype = dtype or HESSIAN_DTYPE
        self.h13 = torch.zeros(num_experts, hidden, hidden, dtype=dtype, device=device)
        self.h2 = torch.zeros(num_experts, intermediate, intermediate, dtype=dtype, device=device)
        self.rows = torch.zeros(num_experts, dtype=torch.int64)

    def __call__(self, x, w13, w2, weights, expert_ids):
        for expert in torch.unique(expert_ids).tolist():
            tokens = torch.where(expert_ids == expert)[0]
            xe = x[tokens].double()
            gate, up = F.linear(xe, w13[expert].double()).chunk(2, dim=-1)
            act = F.silu(gate) * up
            self.h13[expert] += xe.T @ xe
            self.h2[expert] += act.T @ act
            self.rows[expert] += len(tokens)
        return self.inner(x, w13, w2, weights, expert_ids)

    @property
    def nbytes(self) -> int:
        return self.h13.nbytes + self.h2.nbytes


class InputMoments:
    """Second moments sum x x^T of the rows each named weight sees, added up over calls (each call's
    formed in fp64, added in `dtype` (None: HESSIAN_DTYPE), on x's device): `observe(name, x)` with x [T, K]."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.dtype = dtype or HESSIAN_DTYPE

    def observe(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        moment = x.T @ x
        if name in self.h:
            self.h[name] += moment
        else:
            self.h[name] = moment.to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.h.values())


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = INT4_GROUP,
              scale_dtype: torch.dtype | None = None, act_order: bool = False) -> QuantizedWeight:
    """w [N, K] rounded to INT4 (zero points, groups of group_size along K) minimising the error of
    x w^T over inputs whose second moment is hessian [K, K]; round-to-nearest where H is 0.

    act_order: columns rounded in descending order of H's diagonal (the inputs with the most energy
    first, while the most columns are left to absorb their error), each group's scale and zero point
    taken from the unrounded weight before any column moves ("static groups": the groups stay the
    contiguous runs of group_size features of the layout). Otherwise columns go in natural order and
    a group's scale and zero point come from its columns as the earlier groups' errors left them."""
    N, K = w.shape
    scale_dtype = scale_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32)
    if not hessian.abs().sum():
        return quantize_int4(w, group_size, zero_point=True, scale_dtype=scale_dtype)
    W = w.double().clone()
    H = hessian.to(torch.float64, copy=True)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(DAMP * torch.diag(H).mean())  # (in place: no K x K identity beside H)
    groups = -(-K // group_size)
    scales = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    zeros = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    if act_order:
        static = quantize_int4(W, group_size, zero_point=True, scale_dtype=scale_dtype)
        scales.copy_(static.scales)
        zeros.copy_(static.zeros)
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    else:
        perm = torch.arange(K, device=w.device)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    group_of = (perm // group_size).tolist()  # the group of each column in rounding order
    codes = torch.zeros(N, K, dtype=torch.int64, device=w.device)
    for start in range(0, K, group_size):  # blocks of group_size columns in rounding order
        stop = min(start + group_size, K)
        block = W[:, start:stop].clone()
        if not act_order:  # the block is group start // group_size
            lo, hi = block.amin(1).clamp_max(0.0), block.amax(1).clamp_min(0.0)
            s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
            scales[:, start // group_size] = s
            zeros[:, start // group_size] = (-lo / s.double()).round().clamp(0, 15).to(scale_dtype)
        Hinv_block = Hinv[start:stop, start:stop]
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            g = group_of[start + i]
            s64, z64 = scales[:, g].double(), zeros[:, g].double()
            col = block[:, i]
            q = (col / s64 + z64).round().clamp(0, 15)
            codes[:, perm[start + i]] = q.long()
            err = (col - (q - z64) * s64) / Hinv_block[i, i]
            block[:, i:] -= err[:, None] * Hinv_block[i, i:][None, :]
            errors[:, i] = err
        W[:, stop:] -= errors @ Hinv[start:stop, stop:]
    return QuantizedWeight("int4", (N, K), pack_int4(codes), scales, (1, group_size), zeros)


def gptq_stacked(w: torch.Tensor, hessians: torch.Tensor, group_size: int = INT4_GROUP,
                 act_order: bool = False) -> QuantizedWeight:
    """gptq_int4 of each expert of a stacked [E, N, K] weight with its own hessians[e], stacked."""
    parts = [gptq_int4(w[e], hessians[e].to(w.device), group_size, act_order=act_order) for e in range(w.shape[0])]
    return QuantizedWeight("int4", tuple(w.shape), torch.stack([p.codes for p in parts]),
                           torch.stack([p.scales for p in parts]), (1, group_size),
                           torch.stack([p.zeros for p in parts]))


@dataclass
class CalibrationRecord:
    """What the calibration pass ran, in order, for round_blockwise to run again one block at a time:
    ("step", x [T, H], ctx) with x the step's input to the first decoder layer (the embedded tokens)
    and ctx its Context, and ("release", pages) for the pages the engine freed between steps (a
    block's KV format sees them freed at the same points as in the pass). Filled through the
    decoder's before_layer hook (`before_layer`) and the runner's release_pages (`release`)."""

    model: torch.nn.Module
    events: list = field(default_factory=list)

    def before_layer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None) -> None:
        if i == 0:
            self.events.append(("step", x.clone(), self.model.step_ctx))

    def release(self, pages: list[int]) -> None:
        self.events.append(("release", list(pages)))

    @property
    def num_tokens(self) -> int:
        return sum(event[1].shape[0] for event in self.events if event[0] == "step")


@dataclass
class BlockwiseStats:
    """What round_blockwise held and took: the most second-moment bytes and matrices alive at once
    (one block's, or the LM head's), and each block's seconds."""

    peak_bytes: int = 0
    peak_matrices: int = 0
    block_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _replay_block(layer, events: list, streams: list, ctx_of: list[Context]) -> list:
    """The recorded steps through one decoder layer, in the recorded order (its KV pool is written
    as in the pass; pages released between steps are released here too): the layer's (x, delta) of
    each step."""
    fmt, cache = layer.hooks.kv_format, layer.hooks.kv_cache
    out, s = [], 0
    for event in events:
        if event[0] == "release":
            if fmt is not None:
                fmt.release_pages(cache, event[1])
            continue
        x, delta = streams[s]
        out.append(layer(x, delta, ctx_of[s]))
        if fmt is not None:
            fmt.quantize_filled_pages([cache], ctx_of[s])
        s += 1
    return out


def _round_layer(layer, experts: ExpertInputs | None, moments: InputMoments) -> int:
    """Replace a decoder layer's 16-bit experts and attention projections by their GPTQ int4 on the
    collected second moments (round-to-nearest where the text never reached a weight); -> matrices rounded."""
    rounded = 0
    if experts is not None:
        moe = layer.mlp
        for name, h in (("w13", experts.h13), ("w2", experts.h2)):
            w = getattr(moe, name)
            if not isinstance(w, QuantizedWeight):
                replace_weight(moe, name, gptq_stacked(w.data, h))
                rounded += w.shape[0]
    for name in QUANTIZED_ATTENTION if isinstance(layer.self_attn, Attention) else ():
        w = getattr(layer.self_attn, name)
        if not isinstance(w, QuantizedWeight):
            h = moments.h.get(name, torch.zeros(w.shape[1], w.shape[1], device=w.device))
            replace_weight(layer.self_attn, name, gptq_int4(w.data, h))
            rounded += 1
    return rounded


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@torch.inference_mode()
def round_blockwise(model, record: CalibrationRecord, progress: Callable[[str], None] | None = _stderr
                    ) -> BlockwiseStats:
    """GPTQ of the model's experts, attention projections and LM head, one decoder layer (block) at a
    time on the recorded calibration steps (module docstring): block l's second moments come from
    the stream the already rounded blocks 0..l-1 give, and are freed once block l is rounded.
    `progress` gets one line per block (None: quiet)."""
    start = time.perf_counter()
    stats = BlockwiseStats()
    steps = [event for event in record.events if event[0] == "step"]
    ctx_of = [event[2] for event in steps]
    streams = [(event[1], None) for event in steps]  # each step's (x, delta) entering the next block
    tokens = sum(x.shape[0] for x, _ in streams)

    def held(nbytes: int, matrices: int) -> None:
        stats.peak_bytes = max(stats.peak_bytes, nbytes)
        stats.peak_matrices = max(stats.peak_matrices, matrices)

    for i, layer in enumerate(model.layers):
        t0 = time.perf_counter()
        hooks = layer.hooks
        observer, hooks.observer = hooks.observer, None  # the engine's routing counters saw the pass already
        moments = InputMoments()
        experts = None
        if isinstance(layer.mlp, SparseMoE) and not isinstance(layer.mlp.w13, QuantizedWeight):
            E, I2, H = layer.mlp.w13.shape
            experts = ExpertInputs(hooks.experts, E, H, I2 // 2, layer.mlp.w13.device)
            hooks.experts = experts
        if isinstance(layer.self_attn, Attention):
            hooks.projection_observer = moments.observe
        try:
            _replay_block(layer, record.events, streams, ctx_of)  # collect (the outputs are dropped)
        finally:
            hooks.projection_observer = None
            if experts is not None:
                hooks.experts = experts.inner
        nbytes = moments.nbytes + (experts.nbytes if experts is not None else 0)
        held(nbytes, len(moments.h) + (2 * experts.h13.shape[0] if experts is not None else 0))
        rounded = _round_layer(layer, experts, moments)
        del experts, moments  # block i's second moments freed before block i + 1's
        streams = _replay_block(layer, record.events, streams, ctx_of)  # through the rounded block
        hooks.observer = observer
        stats.block_seconds.append(time.perf_counter() - t0)
        if progress is not None:
            progress(f"GPTQ block {i + 1}/{len(model.layers)}: {rounded} matrices rounded on {tokens:,} tokens, "
                     f"second moments {nbytes / 2**20:,.1f} MiB, {stats.block_seconds[-1]:.1f} s")
    if model.lm_head is not None and not isinstance(model.lm_head, QuantizedWeight):
        moments = InputMoments()
        for x, delta in streams:
            moments.observe("lm_head", model.norm.add_and_norm(x, delta)[1])
        held(moments.nbytes, len(moments.h))
        w = model.lm_head.data
        h = moments.h.get("lm_head", torch.zeros(w.shape[1], w.shape[1], device=w.device))
        replace_weight(model, "lm_head", gptq_int4(w, h))
        if progress is not None:
            progress(f"GPTQ LM head rounded, second moments {moments.nbytes / 2**20:,.1f} MiB")
    stats.seconds = time.perf_counter() - start
    return stats
