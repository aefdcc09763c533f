"""Expert offload: experts beyond a device budget live in host memory (pinned on CUDA); each MoE
layer computes with a fixed-size on-device expert cache.

Per MoE layer, an `ExpertCache` holds S slots (`w13 [S, 2I, H]`, `w2 [S, H, I]` on the device), a
host-side map expert -> slot, and LRU order over the resident experts. At start the S experts most
often routed to on the calibration text (the predictor file's frequencies; else experts 0..S-1) are
loaded. Per step:

1. before layer L runs (DecoderHooks.before_layer), `ExpertOffload.__call__` predicts layer L's
   experts from the residual stream entering layer L (moekv/experts/predictor.py) and copies the
   predicted experts that are not resident into slots (evicting the least recently used experts
   that are not predicted), on a separate copy stream on CUDA, so the copies overlap layer L's
   attention; on the CPU the "copy" is a plain copy_ with the same bookkeeping;
2. in layer L's MoE (its executor, OffloadedExperts), the routed experts are looked up: a resident expert is a
   hit, a missing one is copied on demand (a miss); the compute stream waits for the copies of the
   slots it uses (CUDA events), and the experts run on the slots through the expert -> slot map
   (the same kernels: `fused_moe` on CUDA with slot ids; on the CPU a loop over experts in the
   order of `fused_moe_ref`, so results are bitwise those of the all-resident run). A step that
   routes to more distinct experts than there are slots (a long prefill) runs in rounds of S
   experts. A slot is overwritten only after the compute that last read it (an event the copy
   stream waits for).

Two options change when and how a prediction is read (ExpertOffload; lookahead 2 and sync-free are off by
default: docs/decisions.md, "Offload prediction: sync-free and two layers ahead are options, not defaults"):
- lookahead N (`expert_prefetch_lookahead`): layer L's experts are predicted from the residual
  stream entering layer L - (N - 1) (with the predictor of layer L: its router, or its fitted map,
  applied to an earlier state); 1 is step 1 above, 2 predicts a whole layer earlier, so the copies
  have the previous layer's MoE and the next attention to hide behind. Layers with no hook N - 1
  layers before them (the first ones) are predicted at the first layer's hook.
- sync-free (`expert_prefetch_async`): the prediction (the most-voted experts and their votes,
  [2, S] on the device) is copied to a pinned host buffer with non_blocking on a side stream that
  waits for the compute stream through an event (no host sync), and an event is recorded after the
  copy. The host acts on it (copies the experts in) at the first poll that finds the event done:
  polls run at every before_layer hook and after each MoE layer has queued its work. At its target
  layer's hook (the last chance before that layer's attention), a prediction made at an earlier
  hook is waited for (its copy was queued a layer ago: the host waits for the side stream only)
  and one made at this same hook (lookahead 1) is dropped if not done (counted as late; its
  experts are then copied on demand if routed to). The compute stream never waits on the host.
  Without it, the prediction is read with `.tolist()`, which drains the compute stream.

An expert prefetched for a layer's next MoE computation and not used yet ("incoming": its copy may
be in flight) is evicted by a miss only when every other slot holds an expert the computation
needs; the copy stream's order then lands the later copy last.

Reading the routing on the host (the misses) costs a device sync per MoE layer, so steps with
offload run eagerly (no CUDA graphs; the engine says so in its log).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F

from moekv.ops.reference import silu_and_mul_ref

log = logging.getLogger("moekv")


def expert_nbytes(moe) -> int:
    """Bytes of one expert's weights (w13 and w2) of an MoE layer: what one copy moves."""
    return (moe.w13[0].numel() + moe.w2[0].numel()) * moe.w13.element_size()


def slots_for_budget(budget_gb: float, expert_bytes: int, num_moe_layers: int, num_experts: int) -> int:
    """Experts per MoE layer that fit budget_gb GiB of device memory (the same count in every layer)."""
    slots = int(budget_gb * 2**30 // (expert_bytes * num_moe_layers))
    if slots < 1:
        raise ValueError(f"gpu_expert_budget_gb={budget_gb} holds no expert per MoE layer: one expert is "
                         f"{expert_bytes:,} bytes and the model has {num_moe_layers} MoE layers, so at least "
                         f"{expert_bytes * num_moe_layers / 2**30:.4f} GiB is needed")
    return min(slots, num_experts)


class ExpertCache:
    """One MoE layer's on-device expert slots, filled from the host copy of its experts."""

    def __init__(self, layer_idx: int, host_w13: torch.Tensor, host_w2: torch.Tensor, num_slots: int,
                 device: torch.device, copy_stream=None) -> None:
        E = host_w13.shape[0]
        self.layer_idx = layer_idx
        self.num_experts = E
        self.num_slots = num_slots
        self.device = device
        self.host_w13, self.host_w2 = host_w13, host_w2  # [E, 2I, H], [E, H, I] (pinned on CUDA)
        self.w13 = torch.empty((num_slots, *host_w13.shape[1:]), dtype=host_w13.dtype, device=device)
        self.w2 = torch.empty((num_slots, *host_w2.shape[1:]), dtype=host_w2.dtype, device=device)
        self.expert_bytes = (host_w13[0].numel() + host_w2[0].numel()) * host_w13.element_size()
        self.slot_of = [-1] * E  # expert -> slot (-1: not resident)
        self.expert_in = [-1] * num_slots  # slot -> expert (-1: empty)
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident experts, least recently used first
        self.copy_stream = copy_stream
        self.slot_ready = [None] * num_slots  # CUDA: event after the copy into the slot
        self.slot_free = [None] * num_slots  # CUDA: event after the last compute that read the slot
        self.fresh: set[int] = set()  # experts a prefetch brought in, not used yet
        self.incoming: set[int] = set()  # experts prefetched for the next MoE computation (copy may be in flight)
        self.after_compute = None  # called once the MoE's work is queued (ExpertOffload.poll)
        self.predicted: torch.Tensor | None = None  # [T, k] this step's predicted top-k, for recall
        # counters since start
        self.hits = self.misses = self.evictions = 0
        self.evicted_incoming = 0  # incoming experts a miss had to evict (every other slot was needed)
        self.prefetch_hits = self.prefetch_unused = 0  # prefetched experts used / evicted before use
        self.bytes = {"initial": 0, "prefetch": 0, "demand": 0}
        self.copies = {"initial": 0, "prefetch": 0, "demand": 0}
        self.recall_hits = torch.zeros((), dtype=torch.long, device=device)  # true (token, expert) pairs predicted
        self.recall_pairs = torch.zeros((), dtype=torch.long, device=device)

    # -- residency ---------------------------------------------------------------------------------
    def resident(self) -> list[int]:
        return list(self.lru)

    def _victim(self, protect: set[int]) -> int:
        """A free slot, else the slot of the least recently used expert neither in protect nor
        incoming, else (every other slot protected) of the least recently used incoming one."""
        for slot, expert in enumerate(self.expert_in):
            if expert < 0:
                return slot
        for expert in self.lru:
            if expert not in protect and expert not in self.incoming:
                return self.slot_of[expert]
        for expert in self.lru:
            if expert not in protect:
                self.evicted_incoming += 1
                return self.slot_of[expert]
        raise RuntimeError(f"layer {self.layer_idx}: all {self.num_slots} expert slots are protected")

    def _load(self, expert: int, reason: str, protect: set[int]) -> int:
        slot = self._victim(protect)
        old = self.expert_in[slot]
        if old >= 0:
            self.evictions += 1
            self.slot_of[old] = -1
            del self.lru[old]
            if old in self.fresh:
                self.fresh.discard(old)
                self.prefetch_unused += 1
            self.incoming.discard(old)
        if self.copy_stream is not None:
            free = self.slot_free[slot]
            with torch.cuda.stream(self.copy_stream):
                if free is not None:  # the compute that last read this slot comes first
                    self.copy_stream.wait_event(free)
                self.w13[slot].copy_(self.host_w13[expert], non_blocking=True)
                self.w2[slot].copy_(self.host_w2[expert], non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            self.slot_ready[slot] = ready
        else:
            self.w13[slot].copy_(self.host_w13[expert])
            self.w2[slot].copy_(self.host_w2[expert])
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.lru[expert] = None
        self.bytes[reason] += self.expert_bytes
        self.copies[reason] += 1
        return slot

    def fill(self, experts: list[int]) -> None:
        """Load these experts (at most num_slots of them, in order) at start."""
        for e in experts[:self.num_slots]:
            if self.slot_of[e] < 0:
                self._load(e, "initial", set())

    def prefetch(self, experts: list[int]) -> None:
        """Make these experts resident (best first; at most num_slots), without evicting any of them."""
        experts = experts[:self.num_slots]
        protect = set(experts)
        for e in experts:
            if self.slot_of[e] >= 0:
                self.lru.move_to_end(e)
            else:
                self._load(e, "prefetch", protect)
                self.fresh.add(e)
                self.incoming.add(e)

    def ensure(self, experts: list[int]) -> None:
        """The experts one MoE computation uses (at most num_slots): count hits and misses, copy the
        missing ones on demand, and order the compute stream after the copies of their slots."""
        protect = set(experts)
        for e in experts:
            if self.slot_of[e] >= 0:
                self.hits += 1
                self.lru.move_to_end(e)
                if e in self.fresh:
                    self.prefetch_hits += 1
            else:
                self.misses += 1
                self._load(e, "demand", protect)
            self.fresh.discard(e)
            self.incoming.discard(e)  # used: the compute is ordered after its copy
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            for e in experts:
                slot = self.slot_of[e]
                if self.slot_ready[slot] is not None:
                    compute.wait_event(self.slot_ready[slot])
                    self.slot_ready[slot] = None

    def _release(self, experts: list[int]) -> None:
        """CUDA: the slots of these experts may be overwritten once the compute queued so far is done."""
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            for e in experts:
                self.slot_free[self.slot_of[e]] = done

    # -- compute -------------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The experts step of fused_moe_ref / fused_moe (x [T, H], weights and expert_ids [T, k])
        computed on the cache's slots; then the prefetches of this computation are no longer
        incoming, and after_compute runs (the poll of pending predictions)."""
        out = self._compute(x, weights, expert_ids)
        self.finish()
        return out

    def finish(self) -> None:
        """The MoE computation's work is queued: what was prefetched for it and not used is no longer
        incoming (a later copy into its slot is ordered after it on the copy stream); poll."""
        self.incoming.clear()
        if self.after_compute is not None:
            self.after_compute()

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if self.predicted is not None:
            if self.predicted.shape[0] == expert_ids.shape[0]:
                found = (expert_ids[:, :, None] == self.predicted[:, None, :]).any(-1)
                self.recall_hits += found.sum()
                self.recall_pairs += expert_ids.numel()
            self.predicted = None
        needed = torch.unique(expert_ids).tolist()  # sorted: the order of fused_moe_ref's loop
        S = self.num_slots
        rounds = [needed[i:i + S] for i in range(0, len(needed), S)]
        if not x.is_cuda:
            out = torch.zeros_like(x)
            for chunk in rounds:
                self.ensure(chunk)
                for expert in chunk:  # as fused_moe_ref, on the expert's slot
                    slot = self.slot_of[expert]
                    token_idx, k_slot = torch.where(expert_ids == expert)
                    h = silu_and_mul_ref(F.linear(x[token_idx], self.w13[slot]))
                    y = F.linear(h, self.w2[slot]) * weights[token_idx, k_slot, None].to(x.dtype)
                    out.index_add_(0, token_idx, y)
            return out
        from moekv.ops.fused_moe import fused_moe

        if len(rounds) <= 1:
            self.ensure(needed)
            slot_map = torch.tensor(self.slot_of, dtype=torch.long).to(x.device, non_blocking=True)
            out = fused_moe(x, self.w13, self.w2, weights, slot_map[expert_ids].to(expert_ids.dtype))
            self._release(needed)
            return out
        out = torch.zeros_like(x)
        for chunk in rounds:  # each round: the (token, expert) pairs of its experts, as single-expert rows
            self.ensure(chunk)
            slot_map = torch.tensor(self.slot_of, dtype=torch.long).to(x.device, non_blocking=True)
            in_round = torch.isin(expert_ids, torch.tensor(chunk, device=x.device))
            token_idx, k_slot = torch.where(in_round)
            ids = slot_map[expert_ids[token_idx, k_slot]][:, None].to(expert_ids.dtype)
            y = fused_moe(x[token_idx], self.w13, self.w2, weights[token_idx, k_slot][:, None], ids)
            out.index_add_(0, token_idx, y)
            self._release(chunk)
        return out

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {"slots": self.num_slots, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / lookups if lookups else 0.0, "evictions": self.evictions,
                "prefetch_hits": self.prefetch_hits, "prefetch_unused": self.prefetch_unused,
                "evicted_incoming": self.evicted_incoming,
                "bytes_initial": self.bytes["initial"], "bytes_prefetch": self.bytes["prefetch"],
                "bytes_demand": self.bytes["demand"], "copies_prefetch": self.copies["prefetch"],
                "copies_demand": self.copies["demand"]}


class PendingPrediction:
    """A prediction on its way to the host (sync-free mode): the target MoE layer, the hook it was
    made at, the host buffer ([2, S]: experts, most-voted first, and their votes) and the event
    after the copy into it (None: already on the host)."""

    def __init__(self, target: int, made_at: int, host: torch.Tensor, event=None) -> None:
        self.target, self.made_at, self.host, self.event = target, made_at, host, event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def _wanted(packed: list) -> list[int]:
    """The experts to prefetch from a [2, S] prediction read on the host: those with votes, best first."""
    order, votes = packed
    return [e for e, v in zip(order, votes) if v > 0]


class PreviousResidual:
    """The previous token's residual entering each MoE layer, per sequence slot, for predictors
    that read it (`calibrate-experts --previous-token`). At each step, for layer L: a sequence's
    rows after its first in the step take the row before them; its first row takes the row kept
    for its slot at the last step if that row is the one just before it (same slot, position one
    less), else zeros (a new sequence, or a slot whose row belongs to another one); then each
    sequence's newest row is kept for the next step. Host lists only (eager steps): no device sync."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # layer -> [slots, H], the kept rows
        self.positions: dict[int, dict[int, int]] = {}  # layer -> slot -> position of its kept row

    def previous(self, layer_idx: int, residual: torch.Tensor, ctx) -> torch.Tensor:
        from moekv.context import to_device
        from moekv.experts.observe import sequence_starts
        from moekv.experts.predictor import previous_rows

        hl = ctx.host if ctx.host is not None else ctx.host_lists()
        qs, slots, lens = hl.query_start, hl.seq_slots, hl.context_lens
        seqs = [b for b in range(len(slots)) if qs[b + 1] > qs[b]]
        prev = previous_rows(residual, sequence_starts(ctx, residual.shape[0], residual.device))
        kept = self.positions.setdefault(layer_idx, {})
        buf = self.rows.get(layer_idx)
        carry = [(qs[b], slots[b]) for b in seqs if lens[b] - (qs[b + 1] - qs[b]) > 0
                 and kept.get(slots[b]) == lens[b] - (qs[b + 1] - qs[b]) - 1]
        dev = residual.device
        if carry and buf is not None:
            rows = to_device([r for r, _ in carry], torch.long, dev)
            prev[rows] = buf[to_device([s for _, s in carry], torch.long, dev)]
        need = max(slots) + 1 if slots else 0
        if buf is None or buf.shape[0] < need or buf.dtype != residual.dtype or buf.device != dev:
            grown = torch.zeros(max(need, 1), residual.shape[1], dtype=residual.dtype, device=dev)
            if buf is not None and buf.dtype == residual.dtype and buf.device == dev:
                grown[:buf.shape[0]] = buf
            else:
                kept.clear()
            buf = self.rows[layer_idx] = grown
        if seqs:
            buf[to_device([slots[b] for b in seqs], torch.long, dev)] = \
                residual[to_device([qs[b + 1] - 1 for b in seqs], torch.long, dev)]
            for b in seqs:
                kept[slots[b]] = lens[b] - 1
        return prev


class ExpertOffload:
    """Every MoE layer's ExpertCache, and the prefetch hook the decoder calls before each layer.

    lookahead: layer L's experts are predicted at the hook of layer L - (lookahead - 1) (the first
    MoE layers at the first hook); sync_free: the prediction reaches the host through a pinned
    buffer and an event on read_stream (CUDA) instead of `.tolist()` (see the module's docstring)."""

    def __init__(self, caches: dict, predictor=None, prefetch_per_token: int | None = None, lookahead: int = 1,
                 sync_free: bool = False, read_stream=None) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead={lookahead} must be >= 1")
        self.caches = caches  # MoE layer index -> ExpertCache
        self.predictor = predictor  # ExpertPredictor, or None: no prefetch (on-demand copies only)
        self.prefetch_per_token = prefetch_per_token
        self.lookahead = lookahead
        self.sync_free = sync_free
        self.read_stream = read_stream  # CUDA, sync-free: the stream of the device -> host copies
        self.tokens = 0  # tokens through the first MoE layer (for bytes per token)
        self._first = min(caches)
        # hook layer -> the MoE layers predicted there
        self.targets_at: dict[int, list[int]] = {}
        for t in sorted(caches):
            self.targets_at.setdefault(max(t - (lookahead - 1), 0), []).append(t)
        self.pending: dict[int, PendingPrediction] = {}  # target layer -> prediction not acted on yet
        self.model = None  # the MoEDecoder (its step_ctx: the step's sequences, for previous-token maps)
        self.previous = None
        if predictor is not None and getattr(predictor, "needs_previous", False):
            if lookahead != 1:
                raise ValueError(f"expert_prefetch_lookahead={lookahead}: the expert predictor reads the previous "
                                 "token's residual entering the layer it predicts, which only lookahead 1 has")
            self.previous = PreviousResidual()
        self._buffers: dict[int, torch.Tensor] = {}  # target layer -> pinned [2, S] buffer (CUDA)
        self.predictions = {"made": 0, "acted": 0, "late": 0, "waited": 0}
        if predictor is not None and sync_free:
            for cache in caches.values():
                cache.after_compute = self.poll

    def _predict(self, target: int, residual: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """On the device, no sync: layer target's top-k per token (kept for the recall) and the [2, S]
        prediction (experts by votes over the step's tokens, most-voted first, and their votes)."""
        cache = self.caches[target]
        top_k = self.predictor.top_k
        n = self.prefetch_per_token or top_k
        scores = (self.predictor.scores(target, residual) if previous is None  # stand-ins take no `previous`
                  else self.predictor.scores(target, residual, previous=previous))
        ranked = scores.topk(max(n, top_k), dim=-1).indices  # [T, n]
        cache.predicted = ranked[:, :top_k]
        flat = ranked[:, :n].reshape(-1)
        votes = torch.zeros(cache.num_experts, dtype=torch.long, device=flat.device)
        votes.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync (it reads the max)
        order = votes.argsort(descending=True, stable=True)[:cache.num_slots]
        return torch.stack([order, votes[order]])

    def _cpu_event(self):
        """The event of a prediction read on the CPU: None (at once on the host). Tests replace it
        with one that is not done yet, to run the sync-free bookkeeping on the CPU."""
        return None

    def _send(self, target: int, made_at: int, packed: torch.Tensor) -> PendingPrediction:
        """Start the prediction's trip to the host without a sync."""
        if not packed.is_cuda:
            return PendingPrediction(target, made_at, packed.clone(), self._cpu_event())
        buf = self._buffers.get(target)
        if buf is None or buf.shape != packed.shape:
            buf = self._buffers[target] = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        stream = self.read_stream
        stream.wait_stream(torch.cuda.current_stream(packed.device))  # an event, not a host wait
        with torch.cuda.stream(stream):
            buf.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        packed.record_stream(stream)
        return PendingPrediction(target, made_at, buf, event)

    def _act(self, p: PendingPrediction) -> None:
        self.predictions["acted"] += 1
        self.caches[p.target].prefetch(_wanted(p.host.tolist()))  # a host tensor: no device sync

    def poll(self, hook: int | None = None) -> None:
        """Act on the pending predictions whose copy is done. At a hook (hook = the layer about to
        run) a prediction for that layer is resolved: waited for if made at an earlier hook,
        dropped (late) if made at this one and not done."""
        for target, p in list(self.pending.items()):
            if p.ready():
                del self.pending[target]
                self._act(p)
            elif hook is not None and target <= hook:
                del self.pending[target]
                if p.made_at < hook:
                    self.predictions["waited"] += 1
                    p.wait()
                    self._act(p)
                else:
                    self.predictions["late"] += 1

    def __call__(self, layer_idx: int, x: torch.Tensor, delta: torch.Tensor | None) -> None:
        """DecoderHooks.before_layer: predict the experts of the MoE layers targeted at this hook
        from the residual entering layer layer_idx, and copy them in (sync-free: once read)."""
        if layer_idx == self._first:
            self.tokens += x.shape[0]
        if self.predictor is None or x.shape[0] == 0:
            return
        targets = self.targets_at.get(layer_idx, ())
        if targets:
            residual = x if delta is None else x + delta
        for target in targets:
            prev = None
            if self.previous is not None:
                ctx = getattr(self.model, "step_ctx", None)
                prev = None if ctx is None else self.previous.previous(target, residual, ctx)
            packed = self._predict(target, residual, prev)
            self.predictions["made"] += 1
            if self.sync_free:
                self.pending[target] = self._send(target, layer_idx, packed)
            else:
                self.predictions["acted"] += 1
                self.caches[target].prefetch(_wanted(packed.tolist()))  # host sync on CUDA
        if self.sync_free:
            self.poll(layer_idx)

    def stats(self) -> dict:
        """Totals over layers (and per layer under 'layers'); reading the recall waits for the device."""
        per_layer = {i: c.stats() for i, c in self.caches.items()}
        total = {key: sum(s[key] for s in per_layer.values())
                 for key in ("hits", "misses", "evictions", "prefetch_hits", "prefetch_unused", "bytes_initial",
                             "bytes_prefetch", "bytes_demand", "copies_prefetch", "copies_demand")}
        lookups = total["hits"] + total["misses"]
        pairs = int(sum(c.recall_pairs for c in self.caches.values()))
        moved = total["bytes_prefetch"] + total["bytes_demand"]
        return {**total, "hit_rate": total["hits"] / lookups if lookups else 0.0,
                "evicted_incoming": sum(s["evicted_incoming"] for s in per_layer.values()),
                "lookahead": self.lookahead, "sync_free": self.sync_free,
                **{f"predictions_{k}": v for k, v in self.predictions.items()},
                "prediction_recall": int(sum(c.recall_hits for c in self.caches.values())) / pairs if pairs else None,
                "tokens": self.tokens, "bytes_per_token": moved / self.tokens if self.tokens else 0.0,
                "slots_per_layer": next(iter(self.caches.values())).num_slots,
                "prefetch": self.predictor is not None, "layers": per_layer}


class OffloadedExperts:
    """An MoE layer's ExpertExecutor (layers/moe.py) with expert offload: its experts computed on its
    ExpertCache's slots (the module's own w13 / w2 are the host copies; the cache reads them itself)."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor:
        return self.cache(x, weights, expert_ids)


def install_expert_offload(model, model_cfg, config, device: torch.device) -> ExpertOffload:
    """Move the model (loaded on the CPU) to `device` except its experts, which stay on the host
    (pinned when device is CUDA) behind one ExpertCache per MoE layer; install the caches in the
    MoE layers and, unless config.experts.expert_prefetch is False, the prefetch hook in the decoder."""
    from moekv.experts.predictor import ExpertPredictor
    from moekv.models.loader import moe_layers

    layers = moe_layers(model)
    if not layers:
        raise ValueError("expert_offload=True but the model has no MoE layer")
    if model_cfg.clamped_swiglu is not None:
        raise ValueError(f"expert_offload=True: {model_cfg.architecture}'s experts (biases, clamped SwiGLU) are not "
                         "offloaded; accepted: expert_offload=False")
    first = next(iter(layers.values()))
    nbytes = expert_nbytes(first)
    E = model_cfg.num_experts
    if config.experts.expert_cache_slots is not None:
        slots = min(config.experts.expert_cache_slots, E)
    else:
        budget = config.experts.gpu_expert_budget_gb
        if budget is None:
            budget = len(layers) * E * nbytes / 2 / 2**30  # half of the experts
        slots = slots_for_budget(budget, nbytes, len(layers), E)
    host = {}
    for i, moe in layers.items():  # the experts leave the module while the rest moves to the device
        host[i] = (moe.w13, moe.w2)
        moe.w13 = moe.w2 = None
    if device.type == "cuda":
        model.to(device)
    for i, moe in layers.items():
        w13, w2 = host[i]
        if device.type == "cuda":
            w13 = torch.nn.Parameter(w13.data.pin_memory(), requires_grad=False)
            w2 = torch.nn.Parameter(w2.data.pin_memory(), requires_grad=False)
        moe.w13, moe.w2 = w13, w2  # the host copy (what `moekv eval routing` and tools read)
    predictor = None
    if config.experts.expert_predictor is not None:
        predictor = ExpertPredictor.load(config.experts.expert_predictor, model)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    caches = {}
    for i, moe in layers.items():
        cache = ExpertCache(i, moe.w13.data, moe.w2.data, slots, device, copy_stream)
        freq = predictor.frequency(i) if predictor is not None else None
        hot = freq.argsort(descending=True, stable=True).tolist() if freq is not None else list(range(E))
        cache.fill(hot)
        moe.hooks.experts = OffloadedExperts(cache)
        caches[i] = cache
    prefetch = config.experts.expert_prefetch is not False
    if prefetch and predictor is None:
        predictor = ExpertPredictor(model)  # pre-gating
    sync_free = bool(config.experts.expert_prefetch_async)
    read_stream = torch.cuda.Stream(device) if device.type == "cuda" and sync_free else None
    offload = ExpertOffload(caches, predictor if prefetch else None, config.experts.expert_prefetch_per_token,
                            lookahead=config.experts.expert_prefetch_lookahead or 1, sync_free=sync_free,
                            read_stream=read_stream)
    offload.model = model
    model.hooks.before_layer = offload  # without a predictor it only counts tokens
    log.info("expert offload: %d of %d experts per MoE layer on %s (%.3f GiB), the rest in host memory; "
             "prefetch %s", slots, E, device, slots * nbytes * len(layers) / 2**30,
             f"on ({predictor.kind}, lookahead {offload.lookahead}, {'sync-free' if sync_free else 'host sync'})"
             if prefetch else "off (misses are copied on demand)")
    return offload
