"""L2 prefetch of the predicted experts (all experts resident, CUDA): `--expert-l2-prefetch`.

At batch 1 a decode layer alternates latency-bound phases (norms, the attention over the KV pages,
router and top-k: HBM mostly idle) with the bandwidth-bound expert GEMV. Before layer L runs
(DecoderHooks.before_layer), `ExpertL2Prefetch` forks a side stream from the compute stream (an
event), and there:

1. predicts layer L's experts from the residual stream entering layer L (ExpertPredictor: pre-gating,
   or the fitted map of `--expert-predictor`), all on the device: [T, n] expert ids, no host sync;
2. launches `_l2_prefetch_kernel`, which issues `prefetch.global.L2` (or, with bulk=True, Hopper's
   `cp.async.bulk.prefetch.L2`) over the first `lines` 128-byte lines of each predicted expert's
   w13 (its gate and up rows: the first bytes the MoE's GEMV reads; the programs of the lowest
   n-blocks start first). Nothing is written, so a wrong prediction costs bandwidth, never results.

The prefetch kernel starts once layer L's attention block is done (`when="router"`, the default:
beside the post-attention norm, router and top-k) or as soon as the prediction is ready
(`when="attention"`). The compute stream waits for the side stream (joins) before layer L + 1 (and
after the last layer), so every fork is joined inside the step and the whole thing is captured in
the decode step's CUDA graph.

On the H200 it is SLOWER at batch 1 at every budget and launch point (Mixtral-8x7B and Qwen3-30B-A3B
shapes; docs/experts.md, docs/decisions.md "Expert L2 prefetch off by default"): the expert GEMV
already runs at the HBM copy rate and the side stream's kernels slow the compute stream's small ones.
Hence off by default. w2 is not
prefetched: the w13 GEMV streams more than the L2 holds between the prefetch and w2's GEMV.

Bytes per layer and step (`l2_prefetch_budget`): at most half the L2 (the attention's KV pages and
the attention weights pass through it too), at most what HBM delivers in the window the prefetch
overlaps (default 10 us at 4 TB/s; `--expert-l2-prefetch-mb` sets it), shared evenly by the T * n
predicted (token, expert) pairs, each capped at one expert's w13 (`l2_prefetch_lines`). Steps with
more than MAX_PAIRS pairs (prefill) prefetch nothing: they are not bandwidth-bound on the experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("moekv")

LINE_BYTES = 128
L2_SHARE = 0.5  # most of the L2 one layer's prefetch may take
DEFAULT_WINDOW_S = 10e-6  # the overlap the default budget assumes (a decode attention at 4k context)
DEFAULT_BANDWIDTH = 4.0e12  # bytes/s HBM delivers to the prefetch in that window (under an H200's copy rate)
MAX_PAIRS = 16  # (token, expert) pairs above which a step prefetches nothing (fused_moe's GEMV bound)
BLOCK_LINES = 1024  # lines per program of the prefetch kernel
BULK_LINES = 32  # lines (4 KiB) per bulk prefetch instruction
# When the prefetch kernel starts: "attention": as soon as the prediction is done (beside the QKV
# projection, the attention and its output projection, whose weights and KV pages then stream
# through the L2 before the experts' GEMV reads it); "router": once the attention block is done,
# beside the post-attention norm, the router and the top-k (latency-bound, right before the GEMV).
WHEN = ("attention", "router")
DEFAULT_WHEN = "router"


def l2_prefetch_budget(l2_bytes: int, requested_bytes: int | None = None, window_s: float = DEFAULT_WINDOW_S,
                       bandwidth: float = DEFAULT_BANDWIDTH) -> int:
    """Bytes one MoE layer prefetches per step: requested_bytes (the option) or what HBM delivers in
    window_s, and never more than L2_SHARE of the L2."""
    if l2_bytes <= 0:
        raise ValueError(f"l2_bytes={l2_bytes} must be > 0")
    want = int(window_s * bandwidth) if requested_bytes is None else int(requested_bytes)
    if want <= 0:
        raise ValueError(f"the L2 prefetch budget must be > 0 bytes, got {want}")
    return min(want, int(l2_bytes * L2_SHARE))


def l2_prefetch_lines(budget_bytes: int, pairs: int, w13_bytes: int) -> int:
    """128-byte lines of each predicted expert's w13 to prefetch when `pairs` (token, expert) pairs
    share budget_bytes: an equal share rounded down to whole lines, at most one expert's w13 (rounded
    up: its last line counts whole). 0 when the share is under one line or there are no pairs."""
    if pairs <= 0:
        return 0
    per_pair = budget_bytes // pairs
    return min(per_pair // LINE_BYTES, -(-w13_bytes // LINE_BYTES))


@dataclass
class L2PrefetchPlan:
    """What one step of one MoE layer prefetches."""
    pairs: int  # predicted (token, expert) pairs
    lines: int  # 128-byte lines of each pair's expert w13

    @property
    def bytes(self) -> int:
        return self.pairs * self.lines * LINE_BYTES


def _kernel():
    import triton
    import triton.language as tl

    from moekv.ops.pdl import prefetch_l2

    @triton.jit
    def bulk_prefetch_l2(addr, nbytes):
        """Hopper bulk prefetch of nbytes (a multiple of 16) at each address (0: none)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s64 p, $1, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0",
            "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _l2_prefetch_kernel(ids_ptr, w_ptr, stride_e, lines, total_bytes,
                            ELEMS_PER_LINE: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr,
                            BULK_LINES: tl.constexpr):
        """Program (pair, block): the block's lines of the first `lines` lines of expert ids[pair]'s
        w13 (total_bytes: the expert's w13 bytes, so the last line never runs past it)."""
        pair = tl.program_id(0)
        blk = tl.program_id(1)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        base = w_ptr + e * stride_e
        if BULK:
            chunk = blk * BLOCK + tl.arange(0, BLOCK)  # chunks of BULK_LINES lines
            first = chunk * BULK_LINES
            ok = first < lines
            n_lines = tl.minimum(lines - first, BULK_LINES)
            nbytes = tl.minimum(n_lines * 128, total_bytes - first * 128)
            nbytes = (nbytes // 16) * 16
            ok = ok & (nbytes > 0)
            addr = (base + first.to(tl.int64) * ELEMS_PER_LINE).to(tl.int64, bitcast=True)
            bulk_prefetch_l2(tl.where(ok, addr, 0), tl.where(ok, nbytes, 0).to(tl.int32))
        else:
            line = blk * BLOCK + tl.arange(0, BLOCK)
            ok = line < lines
            addr = (base + line.to(tl.int64) * ELEMS_PER_LINE).to(tl.int64, bitcast=True)
            prefetch_l2(tl.where(ok, addr, 0))

    return _l2_prefetch_kernel


_KERNEL = None


def launch_l2_prefetch(ids: torch.Tensor, w13: torch.Tensor, lines: int, bulk: bool = False) -> None:
    """Prefetch into L2 the first `lines` 128-byte lines of w13[e] for every e in ids (any shape,
    integer, on w13's device). Asynchronous on the current stream; writes nothing."""
    global _KERNEL
    import triton

    if lines <= 0 or ids.numel() == 0:
        return
    if _KERNEL is None:
        _KERNEL = _kernel()
    ids = ids.reshape(-1)
    elem = w13.element_size()
    expert_bytes = w13[0].numel() * elem
    if LINE_BYTES % elem or w13.stride(1) * w13.shape[1] != w13.stride(0) or not w13[0].is_contiguous():
        raise ValueError("expert L2 prefetch needs each expert's w13 contiguous")
    lines = min(lines, triton.cdiv(expert_bytes, LINE_BYTES))
    units = triton.cdiv(lines, BULK_LINES) if bulk else lines
    block = max(16, min(BLOCK_LINES, triton.next_power_of_2(units)))
    grid = (ids.numel(), triton.cdiv(units, block))
    _KERNEL[grid](ids, w13, w13.stride(0), lines, expert_bytes, ELEMS_PER_LINE=LINE_BYTES // elem, BLOCK=block,
                  BULK=bulk, BULK_LINES=BULK_LINES, num_warps=4)


class ExpertL2Prefetch:
    """DecoderHooks.before_layer / after_layers: per MoE layer, predict and prefetch on a side stream."""

    def __init__(self, model, predictor, budget_bytes: int, device: torch.device, per_token: int | None = None,
                 bulk: bool = False, when: str = DEFAULT_WHEN) -> None:
        from moekv.models.loader import moe_layers

        if when not in WHEN:
            raise ValueError(f"when={when!r}: accepted {list(WHEN)}")
        self.layers = moe_layers(model)
        self.predictor = predictor
        self.budget_bytes = budget_bytes
        self.per_token = per_token or predictor.top_k
        self.bulk = bulk
        self.when = when
        self.enabled = True  # benchmarks compare with and without on one model
        self.stream = torch.cuda.Stream(device)
        self._pending = None  # (event, device, tensors the side stream reads or wrote) until the join
        self._ready = None  # (layer, ids, lines): predicted, prefetch not launched yet (when="router")
        self.launches = 0  # layer prefetches issued (at capture time for captured steps)
        self.bytes_issued = 0
        for i in self.layers:  # LayerHooks.after_attention: the "router" launch point
            model.layers[i].hooks.after_attention = self.after_attention

    def plan(self, tokens: int, layer_idx: int) -> L2PrefetchPlan:
        moe = self.layers[layer_idx]
        pairs = tokens * min(self.per_token, moe.w13.shape[0])
        if pairs > MAX_PAIRS:
            return L2PrefetchPlan(pairs, 0)
        w13_bytes = moe.w13[0].numel() * moe.w13.element_size()
        return L2PrefetchPlan(pairs, l2_prefetch_lines(self.budget_bytes, pairs, w13_bytes))

    def join(self) -> None:
        """The compute stream waits for the side stream's last work (and drops its tensors)."""
        self._ready = None
        if self._pending is not None:
            event, device = self._pending[0], self._pending[1]
            torch.cuda.current_stream(device).wait_event(event)
            self._pending = None

    def _launch(self, layer_idx: int, ids: torch.Tensor, lines: int) -> None:
        launch_l2_prefetch(ids, self.layers[layer_idx].w13, lines, self.bulk)
        self.launches += 1
        self.bytes_issued += ids.numel() * lines * LINE_BYTES

    def __call__(self, layer_idx: int, x: torch.Tensor, delta: torch.Tensor | None) -> None:
        """DecoderHooks.before_layer: fork, predict layer layer_idx's experts from the residual entering
        it, and (when="attention") prefetch them at once."""
        self.join()
        if not self.enabled or layer_idx not in self.layers or x.shape[0] == 0:
            return
        plan = self.plan(x.shape[0], layer_idx)
        if plan.lines == 0:
            return
        compute = torch.cuda.current_stream(x.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            residual = x if delta is None else x + delta
            ids = self.predictor.scores(layer_idx, residual).topk(self.per_token, dim=-1).indices  # [T, n]
            if self.when == "attention":
                self._launch(layer_idx, ids, plan.lines)
            else:
                self._ready = (layer_idx, ids, plan.lines)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending = (done, x.device, x, delta, residual, ids)

    def after_attention(self, attn_out: torch.Tensor) -> None:
        """LayerHooks.after_attention (when="router"): the prefetch starts once the attention
        (its output projection included) is done, beside the norm, router and top-k."""
        if self._ready is None:
            return
        layer_idx, ids, lines = self._ready
        self._ready = None
        self.stream.wait_stream(torch.cuda.current_stream(attn_out.device))
        with torch.cuda.stream(self.stream):
            self._launch(layer_idx, ids, lines)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending = (done, *self._pending[1:], attn_out)

    def after_layers(self) -> None:
        self.join()


def install_l2_prefetch(model, config, device: torch.device) -> ExpertL2Prefetch:
    """The L2 prefetch hook in the decoder (config.experts.expert_l2_prefetch), with the budget from the
    device's L2 size and config.experts.expert_l2_prefetch_mb."""
    from moekv.experts.predictor import ExpertPredictor
    from moekv.models.loader import moe_layers

    if device.type != "cuda":  # EngineConfig refuses this first; a direct caller gets the same reason
        raise ValueError(f"expert_l2_prefetch=True needs a CUDA device; device={device}")
    if not moe_layers(model):
        raise ValueError("expert_l2_prefetch=True but the model has no MoE layer")
    from moekv.ops.quantized_weight import QuantizedWeight

    if any(isinstance(moe.w13, QuantizedWeight) for moe in moe_layers(model).values()):
        raise ValueError("expert_l2_prefetch=True prefetches 16-bit expert weights; this model's experts are "
                         "quantized (a pre-quantized checkpoint, or gpt-oss's MXFP4)")
    if config.experts.expert_predictor is not None:
        predictor = ExpertPredictor.load(config.experts.expert_predictor, model)
        predictor.check_engine_use("expert_l2_prefetch=True")
    else:
        predictor = ExpertPredictor(model)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    mb = config.experts.expert_l2_prefetch_mb
    budget = l2_prefetch_budget(l2, None if mb is None else int(mb * 1e6))
    hook = ExpertL2Prefetch(model, predictor, budget, device)
    model.hooks.before_layer = hook
    model.hooks.after_layers = hook.after_layers
    log.info("expert L2 prefetch: %.1f MB per MoE layer and step (L2 %.1f MB), predictor %s, on a side stream",
             budget / 1e6, l2 / 1e6, predictor.kind)
    return hook
