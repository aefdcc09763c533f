"""ModelRunner: the only part of the engine that touches tensors.

Loads the model, allocates each layer's KV page pool in the chosen format, turns a
SchedulerOutput into one Context + input tensors, runs the model, and samples.

Every pool holds one page more than the block manager hands out (the scratch page, id
num_blocks) and one staging slot more than max_num_seqs (the scratch slot): padded rows of a
CUDA-graph replay write and read only there (engine/cuda_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import logging

import torch

from moekv.config import EngineConfig, parse_dtype
from moekv.context import Context, MixedSplit
from moekv.engine.cuda_graphs import DecodeGraphs, decode_fills, graphs_unsupported_reason, step_fits_graph
from moekv.engine.scheduler import SchedulerOutput
from moekv.engine.sequence import Sequence
from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.base import raise_if_nonfinite
from moekv.layers.sampler import SampleResult, SamplingRow, sample, top_logprobs_of
from moekv.models.loader import load_model
from moekv.models.model_config import ModelConfig
from moekv.routing import install_routers

log = logging.getLogger("moekv")

@dataclass
class SeqStepResult:
    seq: Sequence
    sample: SampleResult | None = None  # set when the step reached the end of seq's tokens
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # new prompt positions
    prompt_logits: torch.Tensor | None = None  # [n, V] fp32 on the CPU, when the sequence asks for them


def mixed_split(num_tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                context_lens: list[int], seq_slots: list[int], device: torch.device) -> MixedSplit:
    """A step's sequences of one query token and the others, each as a Context of its own (host
    lists of the whole step in; tables padded to one width)."""
    starts = [0]
    for n in num_tokens:
        starts.append(starts[-1] + n)
    parts = []
    for want_decode in (True, False):
        seqs = [b for b, n in enumerate(num_tokens) if (n == 1) == want_decode]
        rows = [t for b in seqs for t in range(starts[b], starts[b + 1])]
        query_start = [0]
        for b in seqs:
            query_start.append(query_start[-1] + num_tokens[b])
        t = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        ctx = Context(positions=t([positions[r] for r in rows], torch.long),
                      slot_mapping=t([slots[r] for r in rows], torch.long),
                      block_tables=t([tables[b] for b in seqs], torch.int32),
                      context_lens=t([context_lens[b] for b in seqs], torch.int32),
                      query_start_loc=t(query_start, torch.int32),
                      logits_indices=t([], torch.long), seq_slots=t([seq_slots[b] for b in seqs], torch.long),
                      max_query_len=max(num_tokens[b] for b in seqs))
        parts += [ctx, t(rows, torch.long)]
    return MixedSplit(*parts)


def resolve_dtype(config: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    """'auto' = the checkpoint's dtype on CUDA; float32 on CPU, where half precision is slow."""
    if config.dtype != "auto":
        return parse_dtype(config.dtype)
    return model_cfg.torch_dtype if config.torch_device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = config.torch_device
        self.dtype = resolve_dtype(config, model_cfg)
        self.kv_format = get_kv_format(config.kv_cache_dtype, self.dtype, **config.kv_format_options())
        self.kv_format.check_layout(model_cfg.num_kv_heads, config.block_size, model_cfg.head_dim)
        self.model = load_model(config.model, self.dtype, self.device, model_cfg, config.load_format)
        self.routing = install_routers(self.model, model_cfg, **config.routing_options())
        self.block_size = config.block_size
        # mixed steps' decodes take the fused decode kernel (on CUDA; the CPU's path is the same reference)
        self.split_mixed_steps = self.device.type == "cuda"
        self.num_blocks = self._plan_num_blocks(max_model_len)  # pages the block manager hands out
        self.scratch_page = self.num_blocks  # + 1 page per pool, never handed out (padded graph rows)
        self.scratch_slot = config.max_num_seqs  # + 1 staging slot, likewise
        self.kv_caches = []
        for attn in self.model.attention_layers:
            attn.kv_format = self.kv_format
            attn.kv_cache = self.kv_format.allocate(self.num_blocks + 1, model_cfg.num_kv_heads, self.block_size,
                                                    model_cfg.head_dim, self.device, config.max_num_seqs + 1,
                                                    self.dtype)
            attn.kv_cache.layer = attn.layer_idx
            self.kv_caches.append(attn.kv_cache)
        self.default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}
        # staging slot (partly filled newest page) of each running sequence
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slots: dict[str, int] = {}
        # CUDA graphs of the decode step (None: every step runs eagerly, for the reason logged)
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        self.graphs: DecodeGraphs | None = None
        reason = graphs_unsupported_reason(self.device, config.enforce_eager, self.kv_format, self.dtype,
                                           self.block_size, model_cfg.head_dim)
        if reason is None:
            self.graphs = DecodeGraphs(self.model, self.device, config.max_num_seqs, self.max_pages_per_seq,
                                       self.block_size, self.scratch_page, self.scratch_slot,
                                       fill_variants=self.kv_format.quantizes_filled_pages,
                                       after_forward=self.quantize_filled_pages)
        elif self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", reason)

    # -- KV pool sizing ----------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model_cfg
        return c.num_layers * self.kv_format.page_bytes(c.num_kv_heads, self.block_size, c.head_dim)

    def _plan_num_blocks(self, max_model_len: int) -> int:
        """Pages the block manager may hand out; the scratch page comes on top of an explicit
        num_kv_blocks, and out of a memory budget."""
        blocks_per_seq = -(-max_model_len // self.block_size)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
            source = f"num_kv_blocks={num_blocks}"
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # keep (1 - utilization) of the card free for activations and the allocator's slack
            budget = free - (1 - self.config.gpu_memory_utilization) * torch.cuda.get_device_properties(self.device).total_memory
            num_blocks = max(int(max(budget, 0) // self.kv_bytes_per_block) - 1, 0)
            source = f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
        else:
            num_blocks = max(int(self.config.kv_cache_memory_gb * 2**30 // self.kv_bytes_per_block) - 1, 0)
            source = f"kv_cache_memory_gb={self.config.kv_cache_memory_gb}"
        if self.config.num_kv_blocks is None:
            # no point holding more than every sequence at full length (and a second engine in the
            # same process still finds room on the card)
            num_blocks = min(num_blocks, blocks_per_seq * self.config.max_num_seqs)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool ({source}) holds {num_blocks} pages of {self.block_size} tokens, but one sequence "
                f"of max_model_len={max_model_len} needs {blocks_per_seq}: lower max_model_len or give the cache "
                f"more room")
        return num_blocks

    # -- one step ----------------------------------------------------------------------------
    def generator_for(self, seq: Sequence) -> torch.Generator:
        seed = seq.sampling_params.seed
        if seed is None:
            return self.default_generator
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = torch.Generator(self.device).manual_seed(seed)
        return gen

    def quantize_filled_pages(self, ctx: Context) -> None:
        """After the last layer of a decode step: the format quantizes the pages it filled, in every
        layer at once (they were read from staging until now)."""
        self.kv_format.quantize_filled_pages(self.kv_caches, ctx)

    def release(self, seq: Sequence) -> None:
        """Forget per-request state (its generator, its staging slot) once the request is finished."""
        self._generators.pop(seq.request_id, None)
        self._release_slot(seq)

    def release_pages(self, pages: list[int]) -> None:
        """Tell each layer's format that these pages are free again (before they are reused)."""
        if pages:
            for cache in self.kv_caches:
                self.kv_format.release_pages(cache, pages)

    def _release_slot(self, seq: Sequence) -> None:
        slot = self._slots.pop(seq.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _slot_for(self, seq: Sequence) -> int:
        slot = self._slots.get(seq.request_id)
        if slot is None:
            slot = self._slots[seq.request_id] = self._free_slots.pop()
        return slot

    def step_uses_graph(self, num_tokens: list[int], context_lens: list[int], logits_rows: list[int]) -> bool:
        """Whether this step is replayed from a CUDA graph (the engine allows graphs, the step is a
        decode step that fits one, the KV format has no host-side work in it, and nothing observes
        the model's internals from Python)."""
        if self.graphs is None:
            return False
        if not step_fits_graph(num_tokens, context_lens, logits_rows,
                               self.block_size, self.graphs.max_batch, self.kv_format.graph_fills_pages):
            return False
        if not self.kv_format.graph_step_ok(self.kv_caches):
            return False
        return not self._model_is_observed()

    def _model_is_observed(self) -> bool:
        """A K/V observer (calibration) or a router tap runs Python inside the step: a replay would skip it."""
        from moekv.routing.tap import RouterTap

        if any(attn.kv_observer is not None for attn in self.model.attention_layers):
            return True
        return any(isinstance(getattr(getattr(layer, "mlp", None), "router", None), RouterTap)
                   for layer in getattr(self.model, "layers", ()))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, blocked_ids: dict[str, list[int]]) -> list[SeqStepResult]:
        """Run the model over the scheduled tokens; sample for sequences whose tokens are all computed.

        blocked_ids: request_id -> token ids that may not be sampled this step (min_tokens).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        plans: list[tuple[SeqStepResult, list[int], int | None, list[int]]] = []
        # per sequence: result, prompt-logprob rows, sample row, prompt-logit rows
        bs = self.block_size
        for seq in out.preempted:  # recomputed from scratch later, in whatever slot is free then
            self._release_slot(seq)
        seq_slots = [self._slot_for(item.seq) for item in out.scheduled]
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            base = len(input_ids)
            input_ids += seq.token_ids(start, end)
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            context_lens.append(end)
            query_start.append(len(input_ids))
            prompt_rows = []
            if seq.sampling_params.prompt_logprobs is not None:
                # row p predicts prompt token p + 1; skip targets already scored before a preemption
                first = max(start, len(seq.prompt_logprobs) - 1)
                for p in range(first, min(end, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(len(logits_rows))
                    logits_rows.append(base + p - start)
            logit_rows = []
            if seq.prompt_logits is not None:
                for p in range(start, min(end, seq.num_prompt_tokens)):
                    logit_rows.append(len(logits_rows))
                    logits_rows.append(base + p - start)
            sample_row = None
            if end == seq.num_tokens:
                sample_row = len(logits_rows)
                logits_rows.append(base + item.num_tokens - 1)
            plans.append((SeqStepResult(seq), prompt_rows, sample_row, logit_rows))

        results = [plan[0] for plan in plans]
        num_tokens = [item.num_tokens for item in out.scheduled]
        block_tables = [item.seq.block_table for item in out.scheduled]
        decode_only = all(n == 1 for n in num_tokens)
        fill_slots, fill_pages = [], []  # decode steps: the pages this step's tokens complete
        if decode_only and self.kv_format.quantizes_filled_pages:
            fill_slots, fill_pages = decode_fills(context_lens, seq_slots, block_tables, bs)
        logits = None
        if self.graphs is not None and self.step_uses_graph(num_tokens, context_lens, logits_rows):
            try:
                logits = self.graphs.run(input_ids, positions, slots, block_tables,
                                         context_lens, seq_slots, fill_slots, fill_pages)  # [B, V] fp32
            except Exception:  # a host sync or an unsupported op in the step: stay eager from now on
                log.exception("replaying the decode step from a CUDA graph failed; decode steps run eagerly from now on")
                self.graphs = None
            if logits is not None:  # replayed: the format's host-side bookkeeping for the step
                if fill_slots:
                    raise_if_nonfinite(self.kv_caches)  # what check_finite would have raised in an eager step
                self.kv_format.after_graph_replay(self.kv_caches)
        if logits is None:
            max_pages = max(len(table) for table in block_tables)
            tables = [table + [0] * (max_pages - len(table)) for table in block_tables]
            dev = self.device
            ctx = Context(
                positions=torch.tensor(positions, dtype=torch.long, device=dev),
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
                context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
                query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
                logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
                seq_slots=torch.tensor(seq_slots, dtype=torch.long, device=dev),
                max_query_len=max(num_tokens),
                fills_no_page=all(n % bs for n in context_lens),
                fill_slots=torch.tensor(fill_slots, dtype=torch.long, device=dev) if fill_slots else None,
                fill_pages=torch.tensor(fill_pages, dtype=torch.long, device=dev) if fill_slots else None,
            )
            if self.split_mixed_steps and not decode_only and 1 in num_tokens:
                ctx.mixed = mixed_split(num_tokens, positions, slots, tables, context_lens, seq_slots, dev)
            hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev), ctx)
            self.quantize_filled_pages(ctx)
            if not logits_rows:
                return results
            logits = self.model.compute_logits(hidden[ctx.logits_indices])  # [S, V] fp32

        rows, sample_rows, sample_targets = [], [], []
        for result, prompt_rows, sample_row, logit_rows in plans:
            seq = result.seq
            if logit_rows:
                result.prompt_logits = logits[logit_rows].cpu()
            if prompt_rows:
                logprobs = torch.log_softmax(logits[prompt_rows], dim=-1)
                first_target = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1) + 1
                for j in range(len(prompt_rows)):
                    target = seq.prompt_token_ids[first_target + j]
                    result.prompt_logprobs.append(
                        top_logprobs_of(logprobs[j], seq.sampling_params.prompt_logprobs, target))
            if sample_row is not None:
                sample_rows.append(sample_row)
                sample_targets.append(result)
                vocab = logits.shape[-1]
                rows.append(SamplingRow(seq.sampling_params, self.generator_for(seq), seq.prompt_token_ids,
                                        seq.output_token_ids,
                                        [t for t in blocked_ids.get(seq.request_id, ()) if t < vocab]))
        if sample_rows:
            every_row = sample_rows == list(range(logits.shape[0]))  # a decode step: no gather copy
            for result, sampled in zip(sample_targets, sample(logits if every_row else logits[sample_rows], rows)):
                result.sample = sampled
        return results
