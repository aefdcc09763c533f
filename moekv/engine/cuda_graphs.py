"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the step's inputs.

At batch 1 a decode step is hundreds of small kernels; launched one by one from Python, the gaps
between them cost more than the kernels (bench_decode's tpot_eager_ms against tpot_ms:
docs/performance.md, "End to end"). A graph fixes every tensor's address and shape, so:

- the batch is padded to the next bucket (1, 2, 4, ..., max_num_seqs); padded rows are made
  harmless: token 0 at position 0 with a context of 1 on a *scratch page* (one page past the
  block manager's range in every pool, never handed out) and a *scratch staging slot* (one slot
  past max_num_seqs), so they write and read only there;
- inputs are copied into static buffers that the captured Context views; block tables are
  [bucket, max_pages_per_seq] wide, so the decode kernel's split count (from block_tables.shape[1])
  is the same at capture and at every replay;
- the graph ends with the logits of every row ([bucket, V] fp32); sampling stays outside.

Only steps that `step_fits_graph` accepts take this path (decode-only, every sequence samples and
needs no other logits rows, and no page fills unless the format's `graph_support.replays_fills`)
and whose host-side work the KV format's `prepare_graph_step` can do before the replay (tiered:
the fills' FP8 slots, its step count and re-ranking); the model runner keeps the eager path for
the rest, and for formats or devices that `graphs_unsupported_reason` turns down.

Page-filling steps: plain pages take the token through slot_mapping as in any step. Formats that
quantize filled pages (`graph_support.lists_fills`) get the step's fills as (staging slot, page)
lists in the Context; each batch bucket then keeps one graph per fill bucket (0, 1, 2, 4, ... up to
the batch bucket), the fill lists padded with (scratch slot, scratch page). At batch 64 with
64-token pages, about 63% of decode steps fill a page somewhere: without this they would all run
eagerly (docs/decisions.md, "Page-filling decode steps replay").
The captured Context says
`graph_step=True`, so formats keep to device work there; a format with host-side bookkeeping that
the replay skips implements GraphStepHooks (tiered: its FP8 slots, step count, re-ranking, and the
flag that the mass accumulator holds new mass): the runner calls its `prepare_graph_step` before
each replay and `after_graph_replay` after it.

Several ranks (tensor_parallel_size > 1): every rank holds a DecodeGraphs of the same buckets, and
its graphs hold the step's collectives (NCCL inside the graph; expert-parallel dispatch through the
shape-static path, layers/parallel.py StaticDispatch). Ranks never capture or replay on their own:
rank 0 commands each capture and each replay (engine/parallel.py, `GraphStep`), so every rank
captures the same (bucket, fill bucket) at the same time and replays the same graph in the same
step. A format's GraphStepHooks run on every rank, each on its own pools, before the status round
that precedes a replay; the round carries each rank's verdict, and if one rank's format turns the
step down every rank runs it eagerly (ModelRunner.run_graph_step). The pieces are split for that:
`load_step` (the step's inputs into the static buffers: the part that can fail on the host),
`replay` (the captured step: the graph, or with use_graphs=False the same static-buffer step
function run eagerly, which is what the CPU tests exercise), and `capture(..., upload=False)` +
`upload` (the first launch runs the collectives, so it waits until every rank has captured).
"""
from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moekv.context import Context, filling_rows

log = logging.getLogger("moekv")

GRAPH_DTYPES = (torch.float16, torch.bfloat16)  # the fused decode kernel's query dtypes
def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` sequences (None: the batch is larger than them all)."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def graphs_unsupported_reason(device: torch.device, enforce_eager: bool, kv_format, dtype: torch.dtype,
                              block_size: int, head_dim: int) -> str | None:
    """Why decode steps of this engine can never be replayed from a graph, or None if they can."""
    if enforce_eager:
        return "enforce_eager=True"
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype not in GRAPH_DTYPES:
        return f"model dtype {dtype} (the fused decode kernel takes fp16/bf16 queries)"
    if not kv_format.graph_support.replays_decode:
        return (f"kv_cache_dtype={kv_format.name!r} runs decode steps eagerly "
                f"(graph_support {kv_format.graph_support.name})")
    reason = kv_format.fused_decode_unavailable(block_size, head_dim)
    if reason is not None:
        return f"kv_cache_dtype={kv_format.name!r} {reason}"
    return None


def fill_buckets(bucket: int) -> list[int]:
    """Numbers of filled pages that get a graph in a batch bucket: 0, then powers of two below the
    bucket, then the bucket itself (every sequence fills a page)."""
    return [0] + graph_buckets(bucket)


def step_fits_graph(num_tokens: list[int], context_lens: list[int], logits_rows: list[int], block_size: int,
                    max_batch: int, fills_ok: bool = False) -> bool:
    """A step can be replayed when every sequence runs one token, no page becomes full unless the
    format can fill pages in a graph (fills_ok: its `graph_support.replays_fills`), the logits rows wanted
    are exactly one per sequence in order (the graph computes every row's logits: a sequence that
    does not sample, or that also wants prompt logits, needs the eager path), and a bucket holds
    the batch."""
    batch = len(num_tokens)
    return (0 < batch <= max_batch
            and all(n == 1 for n in num_tokens)
            and (fills_ok or all(n % block_size for n in context_lens))
            and logits_rows == list(range(batch)))


def decode_fills(context_lens: list[int], seq_slots: list[int], block_tables: list[list[int]],
                 block_size: int) -> tuple[list[int], list[int]]:
    """The (staging slot, page) of every sequence whose newest token completes its page in a
    decode step (filling_rows)."""
    rows = filling_rows(context_lens, block_size)
    return ([seq_slots[b] for b in rows], [block_tables[b][context_lens[b] // block_size - 1] for b in rows])


def capture_after_warmup(step: Callable[[], Any], warmups: int = 2, pool: Any = None,
                         capture_error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """step() run `warmups` times on a side stream (Triton compiles outside the capture, the allocator
    settles), then captured: the graph and what the captured call returned (the tensors its replays
    write). The engine's decode graphs, the kernels' graph tests and the benchmarks capture through it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        out = step()
    return graph, out


@dataclass
class DecodeInputs:
    """Host-side inputs of one decode step, one entry per row (sequence or padding)."""

    input_ids: np.ndarray     # [B] int64
    positions: np.ndarray     # [B] int64
    slot_mapping: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, W] int32, W = max_pages_per_seq
    context_lens: np.ndarray  # [B] int32
    seq_slots: np.ndarray     # [B] int64

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])


def pad_decode_inputs(input_ids: list[int], positions: list[int], slot_mapping: list[int],
                      block_tables: list[list[int]], context_lens: list[int], seq_slots: list[int], *,
                      bucket: int, width: int, scratch_page: int, scratch_slot: int, block_size: int) -> DecodeInputs:
    """The real rows, then padding rows up to `bucket`: token 0 at position 0, context 1, its K/V
    in slot 0 of the scratch page and its staging in the scratch slot. Block tables are `width`
    wide, their unused entries pointing at the scratch page."""
    real = len(input_ids)
    if real > bucket:
        raise ValueError(f"{real} sequences do not fit a bucket of {bucket}")
    pad = bucket - real
    tables = np.full((bucket, width), scratch_page, dtype=np.int32)
    for i, table in enumerate(block_tables):
        if len(table) > width:
            raise ValueError(f"a block table of {len(table)} pages is wider than max_pages_per_seq={width}")
        tables[i, :len(table)] = table
    return DecodeInputs(
        input_ids=np.array(list(input_ids) + [0] * pad, dtype=np.int64),
        positions=np.array(list(positions) + [0] * pad, dtype=np.int64),
        slot_mapping=np.array(list(slot_mapping) + [scratch_page * block_size] * pad, dtype=np.int64),
        block_tables=tables,
        context_lens=np.array(list(context_lens) + [1] * pad, dtype=np.int32),
        seq_slots=np.array(list(seq_slots) + [scratch_slot] * pad, dtype=np.int64),
    )


class DecodeGraphs:
    """Captures (lazily, per bucket, on first use) and replays the decode step of `model`.

    model(input_ids [T], ctx) -> hidden [T, H]; model.compute_logits(hidden) -> [T, V] fp32.
    All buckets share one memory pool; replays run one at a time on the current stream.
    use_graphs=False runs the same padded, static-buffer step eagerly instead of replaying it (on
    the CPU too): the tests check the host-side logic with it.
    """

    def __init__(self, model, device: torch.device, max_num_seqs: int, max_pages_per_seq: int, block_size: int,
                 scratch_page: int, scratch_slot: int, use_graphs: bool = True, fill_variants: bool = False,
                 after_forward=None, counted_rows=None, step_scope=None) -> None:
        self.model = model
        # step_scope(): a context manager around the model's forward in the captured step (several
        # ranks: the expert-parallel layers' static dispatch is active inside it)
        self.step_scope = step_scope
        self.after_forward = after_forward  # after_forward(ctx): the step's work after its last layer
        # counted_rows(n): tells the model's in-graph counters (routing locality) that only the first n
        # rows of the next steps are real (warm-up and capture: none; a replay: its batch, not the padding)
        self.counted_rows = counted_rows
        self.use_graphs = use_graphs
        # the format quantizes filled pages from the Context's fill lists: a graph per fill bucket.
        # Otherwise (plain pages) fill lists are not passed and every step is fill bucket 0
        self.fill_variants = fill_variants
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.width = max_pages_per_seq
        self.block_size = block_size
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_slot
        n = self.max_batch
        i64 = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        # static inputs: each bucket's Context views their first rows
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.zeros(n, **i64)
        self.seq_slots = torch.zeros(n, **i64)
        self.block_tables = torch.zeros(n, max_pages_per_seq, **i32)
        self.context_lens = torch.ones(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one token per row, always
        self.logits_indices = torch.arange(n, **i64)
        self.fill_slots = torch.full((n,), scratch_slot, **i64)
        self.fill_pages = torch.full((n,), scratch_page, **i64)
        # (bucket, fill bucket) -> (graph, logits)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_captures = 0
        self.num_replays = 0
        # (bucket, fill bucket) of the latest replays, in order (tests: every rank replayed the same)
        self.replayed: deque[tuple[int, int]] = deque(maxlen=1024)

    def context(self, bucket: int, fills: int = 0) -> Context:
        """The static buffers as a Context; fills > 0: the first `fills` entries of the fill lists
        (fills_no_page=True with no lists: no page fills, or the format needs none listed)."""
        return Context(
            positions=self.positions[:bucket], slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket], context_lens=self.context_lens[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1], logits_indices=self.logits_indices[:bucket],
            seq_slots=self.seq_slots[:bucket], max_query_len=1, fills_no_page=fills == 0,
            fill_slots=self.fill_slots[:fills] if fills else None,
            fill_pages=self.fill_pages[:fills] if fills else None,
            graph_step=True)

    def fill_bucket(self, num_fills: int, bucket: int) -> int:
        return bucket_for(num_fills, fill_buckets(bucket)) if self.fill_variants else 0

    def load_fills(self, fill_slots: list[int], fill_pages: list[int], fills: int) -> None:
        """The step's fills, then (scratch slot, scratch page) up to the fill bucket."""
        pad = fills - len(fill_slots)
        for dst, src, filler in ((self.fill_slots, fill_slots, self.scratch_slot),
                                 (self.fill_pages, fill_pages, self.scratch_page)):
            dst[:fills].copy_(torch.from_numpy(np.array(list(src) + [filler] * pad, dtype=np.int64)), non_blocking=True)

    def pad(self, input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots,
            bucket: int) -> DecodeInputs:
        return pad_decode_inputs(input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots,
                                 bucket=bucket, width=self.width, scratch_page=self.scratch_page,
                                 scratch_slot=self.scratch_slot, block_size=self.block_size)

    def load(self, inputs: DecodeInputs) -> None:
        """Copy a padded step's inputs into the static buffers (stream-ordered before the replay)."""
        b = inputs.batch
        for dst, src in ((self.input_ids, inputs.input_ids), (self.positions, inputs.positions),
                         (self.slot_mapping, inputs.slot_mapping), (self.seq_slots, inputs.seq_slots),
                         (self.block_tables, inputs.block_tables), (self.context_lens, inputs.context_lens)):
            dst[:b].copy_(torch.from_numpy(src), non_blocking=True)

    def _step(self, bucket: int, fills: int = 0) -> torch.Tensor:
        """The captured step: the model over the static buffers -> logits [bucket, V] fp32."""
        ctx = self.context(bucket, fills)
        with self.step_scope() if self.step_scope is not None else contextlib.nullcontext():
            hidden = self.model(self.input_ids[:bucket], ctx)
        if self.after_forward is not None:
            self.after_forward(ctx)
        return self.model.compute_logits(hidden)  # [bucket, V] fp32

    def capture(self, bucket: int, fills: int = 0, upload: bool = True) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then capture. Every
        row is a padding row meanwhile (and every fill the scratch slot into the scratch page), so
        warm-up and capture touch only the scratch page/slot. upload=False leaves the graph's first
        launch to `upload` (several ranks: it runs the collectives, so only once every rank has
        captured). With use_graphs=False (emulated) the warm-up step runs once and nothing is
        captured: the variant is recorded, and `replay` runs the step function."""
        if (bucket, fills) in self.graphs:
            return
        self.load(self.pad([], [], [], [], [], [], bucket))
        self.load_fills([], [], fills)
        if self.counted_rows is not None:
            self.counted_rows(0)
        if not self.use_graphs:
            self._step(bucket, fills)
            self.graphs[(bucket, fills)] = (None, None)
            self.num_captures += 1
            return
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            # thread_local: a server's other threads may touch CUDA (metrics) while this one captures
            graph, logits = capture_after_warmup(lambda: self._step(bucket, fills), warmups=2, pool=self.pool,
                                                 capture_error_mode="thread_local")
        self.graphs[(bucket, fills)] = (graph, logits)
        self.num_captures += 1
        log.info("captured the decode step for batch bucket %d, %d page fills", bucket, fills)
        if upload:
            self.upload(bucket, fills)

    def upload(self, bucket: int, fills: int = 0) -> None:
        """A graph's first launch also uploads it to the device: done on the padding rows still in the
        buffers (after capture), not inside the first step that needs the graph."""
        graph, _ = self.graphs[(bucket, fills)]
        if graph is not None:
            with torch.cuda.device(self.device):
                graph.replay()

    def reset(self) -> None:
        """Forget every graph (several ranks: the compute group they captured was rebuilt after a failed
        step, so their collectives would run on a destroyed communicator); recaptured on use."""
        self.graphs.clear()
        self.pool = None

    def variants(self) -> list[tuple[int, int]]:
        """Every (batch bucket, fill bucket) a step may need, largest batch first."""
        return [(bucket, fills) for bucket in reversed(self.buckets)
                for fills in (fill_buckets(bucket) if self.fill_variants else [0])]

    def capture_all(self, progress: bool = True) -> int:
        """Capture every variant now (start-up instead of first use, so no request waits for a
        capture); -> how many were new."""
        from tqdm import tqdm

        before = len(self.graphs)
        for bucket, fills in tqdm(self.variants(), desc="capturing decode graphs", disable=not progress):
            self.capture(bucket, fills)
        return len(self.graphs) - before

    def variant_for(self, batch: int, num_fills: int) -> tuple[int, int]:
        """The (batch bucket, fill bucket) of a step of `batch` sequences filling `num_fills` pages."""
        bucket = bucket_for(batch, self.buckets)
        if bucket is None:
            raise ValueError(f"batch {batch} is larger than the largest bucket {self.max_batch}")
        return bucket, self.fill_bucket(num_fills, bucket)

    def capture_for(self, batch: int, num_fills: int) -> tuple[int, int]:
        """variant_for, its graph captured if it is not yet (with use_graphs)."""
        bucket, fills = self.variant_for(batch, num_fills)
        if self.use_graphs:
            self.capture(bucket, fills)
        return bucket, fills

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], context_lens: list[int], seq_slots: list[int],
            fill_slots: list[int] = (), fill_pages: list[int] = (),
            input_ids_device: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the step for these sequences -> their logits [B, V] fp32 (a view of the graph's
        output: queue what reads it before the next replay). fill_slots / fill_pages: the pages the
        step fills (decode_fills), for a format that quantizes them (fill_variants).
        input_ids_device: the tokens [B] int64 as a device tensor (a follow-on step: sampled by the
        step before, not yet on the host), in place of input_ids."""
        batch = len(input_ids)
        bucket, fills = self.capture_for(batch, len(fill_slots))
        self.load_step(input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots, fill_slots,
                       fill_pages, bucket, fills, input_ids_device)
        return self.replay(bucket, fills, batch)

    def load_step(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                  block_tables: list[list[int]], context_lens: list[int], seq_slots: list[int],
                  fill_slots: list[int], fill_pages: list[int], bucket: int, fills: int,
                  input_ids_device: torch.Tensor | None = None) -> None:
        """A step's inputs into the static buffers of variant (bucket, fills), padded."""
        self.load(self.pad(input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots, bucket))
        if fills:
            self.load_fills(fill_slots, fill_pages, fills)
        if input_ids_device is not None:  # device to device, queued after the step that samples them
            self.input_ids[:len(input_ids)].copy_(input_ids_device)
        if self.counted_rows is not None:
            self.counted_rows(len(input_ids))

    def replay(self, bucket: int, fills: int, batch: int) -> torch.Tensor:
        """Run the captured step of variant (bucket, fills) on the static buffers (load_step first) ->
        the first `batch` rows of its logits. use_graphs=False: the same step function, eagerly."""
        if self.use_graphs:
            graph, logits = self.graphs[(bucket, fills)]
            with torch.cuda.device(self.device):
                graph.replay()
        else:
            logits = self._step(bucket, fills)
        self.num_replays += 1
        self.replayed.append((bucket, fills))
        return logits[:batch]
