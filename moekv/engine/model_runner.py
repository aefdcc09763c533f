"""ModelRunner: the only part of the engine that touches tensors.

Loads the model, allocates each layer's KV page pool in the chosen format, turns a
SchedulerOutput into one Context + input tensors, runs the model, and samples.

Every pool holds one page more than the block manager hands out (the scratch page, id
num_blocks) and one staging slot more than max_num_seqs (the scratch slot): padded rows of a
CUDA-graph replay write and read only there (engine/cuda_graphs.py).
"""
from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, field

import torch

from moekv import envs
from moekv.config import EngineConfig, parse_dtype
from moekv.context import Context, HostLists, MixedSplit, filling_rows, to_device
from moekv.engine.cpu_threads import set_cpu_threads
from moekv.engine.cuda_graphs import (
    DecodeGraphs,
    decode_fills,
    graphs_unsupported_reason,
    step_fits_graph,
)
from moekv.engine.parallel import (
    GraphStep,
    ParallelGroup,
    ParallelStepError,
    StepInputs,
    expert_parallel_bytes,
    expert_parallel_layers,
    placement_of,
    shard_model,
    start_ranks,
)
from moekv.engine.scheduler import SchedulerOutput
from moekv.engine.sequence import Sequence
from moekv.kvcache.formats import GraphStepHooks, KVFormat, get_kv_format, nonfinite_verdict, raise_nonfinite
from moekv.kvcache.formats.fragment import decode_kernel_for_model
from moekv.kvcache.formats.latent_choice import latent_format_for
from moekv.layers.parallel import StaticDispatch, kv_heads_of_rank, shard_plan
from moekv.layers.sampler import PendingSample, SampleResult, SamplingRow, sample_async, to_host_async, top_logprobs_of
from moekv.models.decoder import MoEDecoder
from moekv.models.gptq import BlockwiseStats, CalibrationRecord, round_blockwise
from moekv.models.loader import Shard, install_routers, load_model, moe_layers
from moekv.models.model_config import ModelConfig
from moekv.models.quantize import quantize_model, weight_bytes, weight_quantization
from moekv.routing.cluster_map import ClusterMap
from moekv.routing.placement import LocalityCounter, Placement

log = logging.getLogger("moekv")

@dataclass
class SeqStepResult:
    seq: Sequence
    sample: SampleResult | None = None  # set when the step reached the end of seq's tokens
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # new prompt positions
    prompt_logits: torch.Tensor | None = None  # [n, V] fp32 on the CPU, when the sequence asks for them


@dataclass
class SeqRows:
    """One sequence's share of a step's logits: its result, and where its rows sit among the rows
    whose logits the step computes (indices into StepPlan.logits_rows)."""

    result: SeqStepResult
    prompt_rows: list[int]  # rows scored for prompt logprobs (row p predicts prompt token p + 1)
    sample_row: int | None  # the row sampled for the next token; None: the sequence is still mid-prompt
    logit_rows: list[int]  # rows returned as prompt logits


@dataclass
class StepPlan:
    """One step's host-side inputs: per token (input_ids, positions, slots; T entries) and per
    sequence (the rest; B entries), and each sequence's SeqRows in `rows`, rows counted in
    logits_rows (the step's rows whose logits are needed)."""

    seqs: list[Sequence]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    query_start: list[int]  # [B + 1]
    num_tokens: list[int]
    seq_slots: list[int]
    logits_rows: list[int]
    rows: list[SeqRows]
    # a follow-on step: its input tokens [B] int64 on the device, sampled by the step still
    # running before it (input_ids then holds placeholders)
    input_ids_device: torch.Tensor | None = None
    # ... and that step: a grammar sequence's bitmask needs the token it samples (read on the host
    # once the follow-on's forward is queued)
    after: "PendingStep | None" = None


def every_row_samples(plan: StepPlan) -> bool:
    """Each sequence samples (its sample row = its place in the step) and wants no prompt
    logprobs or logits: a step the engine may follow on before the host has seen its tokens."""
    return all(r.sample_row == i and not r.prompt_rows and not r.logit_rows for i, r in enumerate(plan.rows))


def follow_grammars(seqs: list[Sequence], prev: "PendingStep") -> None:
    """A follow-on step's grammar sequences: advance each matcher by the token prev sampled for it,
    which the host has not appended yet (GrammarState.accept_at: the engine's own append of it later
    finds it accepted)."""
    token_of = prev.sampled_token_ids()
    for seq in seqs:
        if seq.grammar is not None:
            seq.grammar.accept_at(len(seq.output_token_ids), token_of[seq.request_id])


class PendingStep:
    """A launched step: its model work, its sampling and the host copy of both are queued on the
    device. `tokens` ([S] int64, on the device) may feed a follow-on step at once; wait() blocks
    until the host copy has landed and gives the results."""

    def __init__(self, results: list[SeqStepResult], device: torch.device, caches: list,
                 sample_targets: list[SeqStepResult] = (),
                 sampled: PendingSample | None = None, nonfinite: torch.Tensor | None = None,
                 followable: bool = False) -> None:
        self.results = results
        self._caches = caches
        self._targets = list(sample_targets)
        self._sampled = sampled
        self._nonfinite = nonfinite  # host copy of the step's non-finite verdict (graph fill steps)
        self.followable = followable and sampled is not None
        self._event = None
        if device.type == "cuda":  # after everything the step queued, its host copies included
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        self._done = False

    @property
    def tokens(self) -> torch.Tensor:
        return self._sampled.tokens

    def sampled_token_ids(self) -> dict[str, int]:
        """request_id -> the token sampled for it, on the host: waits for the step's device work, but
        leaves its verdicts (a non-finite page, the results) to wait()."""
        if self._event is not None:
            self._event.synchronize()
        return {target.seq.request_id: r.token_id for target, r in zip(self._targets, self._sampled.results())}

    def wait(self) -> list[SeqStepResult]:
        if not self._done:
            self._done = True
            if self._event is not None:
                self._event.synchronize()
            if self._nonfinite is not None and bool(self._nonfinite):
                raise_nonfinite(self._caches)
            if self._sampled is not None:
                for result, sampled in zip(self._targets, self._sampled.results()):
                    result.sample = sampled
        return self.results


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
        t = lambda values, dtype: to_device(values, dtype, device)  # noqa: E731
        ctx = Context(positions=t([positions[r] for r in rows], torch.long),
                      slot_mapping=t([slots[r] for r in rows], torch.long),
                      block_tables=t([tables[b] for b in seqs], torch.int32),
                      context_lens=t([context_lens[b] for b in seqs], torch.int32),
                      query_start_loc=t(query_start, torch.int32),
                      logits_indices=t([], torch.long), seq_slots=t([seq_slots[b] for b in seqs], torch.long),
                      max_query_len=max(num_tokens[b] for b in seqs),
                      host=HostLists([context_lens[b] for b in seqs], query_start, [seq_slots[b] for b in seqs],
                                     [tables[b] for b in seqs]))
        parts += [ctx, t(rows, torch.long)]
    return MixedSplit(*parts)


def resolve_dtype(config: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    """'auto' = the checkpoint's dtype on CUDA; float32 on CPU, where half precision is slow."""
    if config.dtype != "auto":
        return parse_dtype(config.dtype)
    return model_cfg.torch_dtype if config.torch_device.type == "cuda" else torch.float32


def kv_format_for(config: EngineConfig, dtype: torch.dtype, model_cfg: ModelConfig | None = None) -> KVFormat:
    """The KV format config.cache.kv_cache_dtype names, with its kv_* options (for a model with multi-head
    latent attention, its latent-cache form; decode_kernel 'auto' laid out for the Triton kernel when the
    model's head groups are not the Gluon kernels'); refused when prefix caching is on and the format
    cannot share pages."""
    if model_cfg is not None and model_cfg.mla is not None:
        kv_format = latent_format_for(config.cache.kv_cache_dtype, dtype, model_cfg.mla.kv_lora_rank,
                                      config.cache.kv_options).with_decode_mma(config.cache.mla_decode_mma)
    else:
        decode_kernel = config.cache.decode_kernel
        if model_cfg is not None:
            decode_kernel = decode_kernel_for_model(decode_kernel, model_cfg.num_heads, model_cfg.num_kv_heads)
        kv_format = get_kv_format(config.cache.kv_cache_dtype, dtype, decode_kernel=decode_kernel,
                                  **config.kv_format_options())
    if config.cache.enable_prefix_caching:
        reason = kv_format.prefix_caching_unsupported()
        if reason is not None:
            raise ValueError(f"enable_prefix_caching=True does not work with kv_cache_dtype="
                             f"{config.cache.kv_cache_dtype!r}: {reason}")
    return kv_format


def start_runner(config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> ModelRunner:
    """The engine's ModelRunner (rank 0's). With tensor_parallel_size > 1 the other ranks come first
    (engine/parallel.start_ranks: spawned here, or joined under torchrun, where a worker rank serves
    rank 0 inside this call and leaves with SystemExit). The KV format is refused before any rank starts."""
    kv_format = kv_format_for(config, resolve_dtype(config, model_cfg), model_cfg)
    parallel = start_ranks(config, model_cfg, max_model_len, ModelRunner)
    return ModelRunner(config, model_cfg, max_model_len, parallel, kv_format)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 parallel: ParallelGroup | None = None, kv_format: KVFormat | None = None) -> None:
        """One rank's runner, built in phases: load the weights, shard what the rank keeps, install
        the engine's behaviours in the layers, allocate the KV pools, set up decode-graph capture.
        parallel: this rank's group when config.parallel.tensor_parallel_size > 1 (the ranks are started
        first: start_runner, engine/parallel.start_ranks); kv_format: the format when the caller
        built it already (kv_format_for)."""
        if parallel is None and config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={config.parallel.tensor_parallel_size} needs this rank's group: "
                             "start the ranks first (start_runner)")
        self.config = config
        self.model_cfg = model_cfg
        self.parallel = parallel
        self.device = config.torch_device if parallel is None else parallel.device
        self.dtype = resolve_dtype(config, model_cfg)
        self.kv_format = kv_format if kv_format is not None else kv_format_for(config, self.dtype, model_cfg)
        self._calibration: CalibrationRecord | None = None  # the GPTQ calibration pass being recorded
        self.model = self._load()
        self.quantization = self._quantize()
        self.weight_bytes = weight_bytes(self.model)  # this rank's: parameters, codes, scales
        if self.device.type == "cpu":  # this rank's shard, the ranks sharing the host's cores
            set_cpu_threads(config.parallel.cpu_threads, sum(p.numel() for p in self.model.parameters()),
                            config.parallel.tensor_parallel_size)
        self._shard()
        self._install()
        self._allocate(max_model_len)
        self._set_up_capture(max_model_len)

    # -- construction phases -----------------------------------------------------------------
    def _load(self) -> MoEDecoder:
        """Phase 1, load: the checkpoint's weights. One rank: the whole model on the device (on the
        host with expert offload, whose install moves all but the experts). Several: each rank reads
        only its shard's rows of the checkpoint, straight into its device (shard_model cuts the
        modules, shard_plan names the rows)."""
        config, model_cfg = self.config, self.model_cfg
        # expert parallel: MoE layer -> [E] rank of each expert (None: experts are not spread)
        self.expert_placement: dict[int, torch.Tensor] | None = None
        if self.parallel is None:
            load_device = torch.device("cpu") if config.experts.expert_offload else self.device
            # weights to be GPTQ-rounded (quantization_calibration) load 16-bit
            return load_model(config.model, self.dtype, load_device, model_cfg, config.load_format,
                              quantization=None if config.quantization_calibration else config.quantization)
        tp = self.parallel.tp
        placement = placement_of(config, model_cfg, [i for i, moe in enumerate(model_cfg.moe_layers) if moe])
        self.expert_placement = placement
        shard = Shard(cut=lambda m: shard_model(m, model_cfg, tp, placement),
                      plan=lambda m: shard_plan(m, model_cfg, tp, placement))
        return load_model(config.model, self.dtype, self.device, model_cfg, config.load_format, shard)

    def _quantize(self) -> str | None:
        """Phase 1 ends with weight quantization: config.quantization quantizes the 16-bit weights of
        the experts, attention projections and LM head (one rank: as load_model reads them; several:
        this rank's loaded shard; 'dummy': the random weights); returns the model's weight
        quantization (a pre-quantized checkpoint's too), None for 16-bit weights."""
        method = self.config.quantization
        loaded = weight_quantization(self.model)
        if method is not None and loaded is not None and loaded != method:
            raise ValueError(f"quantization={method!r} was asked for, but the checkpoint holds {loaded} weights; "
                             f"give quantization={loaded!r} or None")
        if loaded is not None and self.config.experts.expert_offload:
            raise ValueError(f"expert_offload=True is not supported with quantized weights (the checkpoint holds "
                             f"{loaded} weights): its expert caches copy 16-bit expert tensors")
        if method is not None and self.config.quantization_calibration is None:
            # with quantization_calibration the weights wait, 16-bit, for the engine's calibration (GPTQ)
            quantize_model(self.model, method)
        return method or loaded

    def start_weight_calibration(self) -> None:
        """Until finish_weight_calibration, the steps are recorded for GPTQ block by block
        (models/gptq.py): each step's input to the first decoder layer and its Context, through the
        decoder's before_layer hook, and the pages freed between steps."""
        if self.model.hooks.before_layer is not None:
            raise ValueError("quantization_calibration cannot record the calibration steps: the decoder's "
                             "before_layer hook is taken (expert offload or the expert L2 prefetch)")
        self._calibration = CalibrationRecord(self.model)
        self.model.hooks.before_layer = self._calibration.before_layer

    def finish_weight_calibration(self, round_weights: bool = True) -> BlockwiseStats | None:
        """Stop recording; with round_weights, replace the 16-bit experts (w13, w2), attention
        projections and LM head by their GPTQ-rounded int4, one decoder layer at a time on the
        recorded steps (models/gptq.round_blockwise: progress on stderr); a weight the text never
        reached is rounded to nearest."""
        record, self._calibration = self._calibration, None
        self.model.hooks.before_layer = None
        self.model.step_ctx = None
        if not round_weights:
            return None
        stats = round_blockwise(self.model, record)
        del record
        quantize_model(self.model, "int4")  # anything left 16-bit that int4 takes (none on the models above)
        self.weight_bytes = weight_bytes(self.model)
        return stats

    def _shard(self) -> None:
        """Phase 2, shard: what a rank's loaded shard still needs (the expert-parallel tables on its
        device, the calibrated KV tables cut to its KV heads); then the format checks the page
        layout of this rank's KV heads."""
        model_cfg = self.model_cfg
        if self.parallel is not None:
            for ep in expert_parallel_layers(self.model).values():
                ep.to(self.device)
            _, kv_heads = kv_heads_of_rank(model_cfg.num_heads, model_cfg.num_kv_heads, self.parallel.rank,
                                           self.parallel.world_size)
            self.kv_format.shard_tables(kv_heads, model_cfg.num_kv_heads)  # calibrated tables per KV head
        self.num_kv_heads = self.model.attention_layers[0].num_kv_heads  # this rank's
        self.kv_format.check_layout(self.num_kv_heads, self.config.cache.block_size, model_cfg.head_dim)
        windows = sorted({w for w in model_cfg.layer_windows if w is not None})
        if windows and (reason := self.kv_format.sliding_window_unsupported()) is not None:
            raise ValueError(f"kv_cache_dtype={self.kv_format.name!r} {reason}; {model_cfg.architecture} has "
                             f"sliding-window layers (window {windows[0]}): choose another kv_cache_dtype")

    def _install(self) -> None:
        """Phase 3, install: the engine's behaviours in the layers: expert offload (before the
        routers, which may copy router rows on the device), the routers, the expert L2 prefetch, and
        with a cluster map the routing-locality counters (on the device, before any graph is captured)."""
        config, model_cfg = self.config, self.model_cfg
        self.experts = None  # ExpertOffload: expert caches, prefetch and their counters
        if config.experts.expert_offload:
            from moekv.experts.offload import install_expert_offload

            self.experts = install_expert_offload(self.model, model_cfg, config, self.device)
        self.routing = install_routers(self.model, model_cfg, **config.router.routing_options())
        self.l2_prefetch = None  # ExpertL2Prefetch: predicted experts into L2 beside the attention
        if config.experts.expert_l2_prefetch:
            from moekv.experts.l2_prefetch import install_l2_prefetch

            self.l2_prefetch = install_l2_prefetch(self.model, config, self.device)
        self.locality: LocalityCounter | None = None
        if config.router.cluster_map is not None and self.rank == 0:
            cmap = ClusterMap.load(config.router.cluster_map)
            self.locality = LocalityCounter(Placement.from_clusters(cmap), self.device)
            for i, moe in moe_layers(self.model).items():
                moe.hooks.observer = self.locality.observer(i)

    def _allocate(self, max_model_len: int) -> None:
        """Phase 4, allocate: one KV pool per attention layer, sized from the memory budget (the
        smallest any rank can hold), plus the per-sequence state: staging slots and sampling seeds."""
        config, model_cfg = self.config, self.model_cfg
        self.block_size = config.cache.block_size
        # mixed steps' decodes take the fused decode kernel (on CUDA; the CPU's path is the same reference)
        self.split_mixed_steps = self.device.type == "cuda"
        self.num_blocks = self._plan_num_blocks(max_model_len)  # pages the block manager hands out
        if self.parallel is not None:  # the same pool on every rank: the smallest one
            self.num_blocks = min(self.parallel.gather(self.num_blocks))
        self.scratch_page = self.num_blocks  # + 1 page per pool, never handed out (padded graph rows)
        self.scratch_slot = config.scheduler.max_num_seqs  # + 1 staging slot, likewise
        self.kv_caches = []
        if getattr(self.kv_format, "keys_before_rope", False) and (
                model_cfg.rotary_dim != model_cfg.head_dim or getattr(model_cfg, "yarn", None) is not None):
            # the readers rotate by plain RoPE over the whole head (ops/decode/rope.py)
            raise ValueError(f"kv_keys_before_rope needs plain RoPE over the whole head; {model_cfg.architecture} "
                             f"rotates {model_cfg.rotary_dim} of {model_cfg.head_dim} elements"
                             + (" with YaRN" if getattr(model_cfg, "yarn", None) is not None else "")
                             + "; accepted: kv_keys_before_rope=False for this model")
        for i, hooks in enumerate(self.model.hooks.layers):
            hooks.kv_format = self.kv_format
            hooks.kv_cache = self.kv_format.allocate(self.num_blocks + 1, self.num_kv_heads, self.block_size,
                                                     model_cfg.head_dim, self.device, config.scheduler.max_num_seqs + 1,
                                                     self.dtype)
            hooks.kv_cache.layer = i
            hooks.kv_cache.rope_theta = model_cfg.rope_theta  # keys stored before RoPE are rotated by it
            self.kv_caches.append(hooks.kv_cache)
        # each request's sampling seed: its own, or one drawn from the engine seed's stream the first time it samples
        self._seed_source = random.Random(config.seed)
        self._seeds: dict[str, int] = {}
        # staging slot (partly filled newest page) of each running sequence
        self._free_slots = list(range(config.scheduler.max_num_seqs - 1, -1, -1))
        self._slots: dict[str, int] = {}

    def _set_up_capture(self, max_model_len: int) -> None:
        """Phase 5, capture: the decode graphs (captured per batch bucket on first use, or all at once
        by capture_decode_graphs), or None with the reason logged: every step runs eagerly. With
        several ranks, expert-parallel layers dispatch shape-statically inside a captured step, and a
        rebuilt compute group drops the graphs."""
        config, model_cfg = self.config, self.model_cfg
        self.static_dispatch: StaticDispatch | None = None
        if self.parallel is not None:
            eps = [ep for ep in expert_parallel_layers(self.model).values() if ep.dispatch]
            if eps:
                self.static_dispatch = StaticDispatch(self.device)
                for ep in eps:
                    ep.static = self.static_dispatch
            self.parallel.on_rebuild.append(self._drop_graphs)
        # MOEKV_EMULATE_CUDA_GRAPHS=1 (moekv/envs.py; tests): the graph path without graphs, each replay the same
        # static-buffer step run eagerly, on any device and dtype
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        self.graphs: DecodeGraphs | None = None
        emulated = envs.emulate_cuda_graphs()
        if config.enforce_eager:
            reason = "enforce_eager=True"
        elif emulated:
            reason = None if self.kv_format.graph_support.replays_decode else (
                f"kv_cache_dtype={self.kv_format.name!r} runs decode steps eagerly")
        else:
            reason = graphs_unsupported_reason(self.device, config.enforce_eager, self.kv_format, self.dtype,
                                               self.block_size, model_cfg.head_dim)
        if reason is None and self.experts is not None:
            reason = "expert_offload=True reads each MoE layer's routing on the host (cache misses, prefetch)"
        if reason is None:
            counted = self._count_rows if self.locality is not None or self.static_dispatch is not None else None
            self.graphs = DecodeGraphs(self.model, self.device, config.scheduler.max_num_seqs, self.max_pages_per_seq,
                                       self.block_size, self.scratch_page, self.scratch_slot,
                                       use_graphs=not emulated,
                                       fill_variants=self.kv_format.graph_support.lists_fills,
                                       after_forward=self.quantize_filled_pages, counted_rows=counted,
                                       step_scope=None if self.static_dispatch is None else self._static_step)
        elif self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", reason)

    def _count_rows(self, rows: int) -> None:
        """Before a captured step (capture: 0, replay: its batch): how many leading rows are real, for the
        in-graph counters (routing locality, expert-parallel bytes)."""
        if self.locality is not None:
            self.locality.count_rows(rows)
        if self.static_dispatch is not None:
            self.static_dispatch.count_rows(rows)

    @contextlib.contextmanager
    def _static_step(self):
        """Inside a captured (or emulated) decode step: expert-parallel dispatch is shape-static."""
        self.static_dispatch.active = True
        try:
            yield
        finally:
            self.static_dispatch.active = False

    def _drop_graphs(self) -> None:
        """The compute group was rebuilt (a failed step): graphs captured on the old one are void."""
        if self.graphs is not None and self.graphs.graphs:
            log.info("rank %d: compute group rebuilt; dropping %d captured decode graphs", self.rank,
                     len(self.graphs.graphs))
            self.graphs.reset()

    # -- KV pool sizing ----------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model_cfg
        return c.num_layers * self.kv_format.page_bytes(self.num_kv_heads, self.block_size, c.head_dim)

    def _plan_num_blocks(self, max_model_len: int) -> int:
        """Pages the block manager may hand out; the scratch page comes on top of an explicit
        num_kv_blocks, and out of a memory budget."""
        blocks_per_seq = -(-max_model_len // self.block_size)
        if self.config.cache.num_kv_blocks is not None:
            num_blocks = self.config.cache.num_kv_blocks
            source = f"num_kv_blocks={num_blocks}"
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # keep (1 - utilization) of the card free for activations and the allocator's slack
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = free - (1 - self.config.cache.gpu_memory_utilization) * total
            num_blocks = max(int(max(budget, 0) // self.kv_bytes_per_block) - 1, 0)
            source = f"gpu_memory_utilization={self.config.cache.gpu_memory_utilization}"
        else:
            num_blocks = max(int(self.config.cache.kv_cache_memory_gb * 2**30 // self.kv_bytes_per_block) - 1, 0)
            source = f"kv_cache_memory_gb={self.config.cache.kv_cache_memory_gb}"
        if self.config.cache.num_kv_blocks is None:
            # no point holding more than every sequence at full length (and a second engine in the
            # same process still finds room on the card)
            num_blocks = min(num_blocks, blocks_per_seq * self.config.scheduler.max_num_seqs)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool ({source}) holds {num_blocks} pages of {self.block_size} tokens, but one sequence "
                f"of max_model_len={max_model_len} needs {blocks_per_seq}: lower max_model_len or give the cache "
                f"more room")
        return num_blocks

    # -- one step ----------------------------------------------------------------------------
    def seed_for(self, seq: Sequence) -> int:
        """The seed of seq's sampling noise (layers/sampler.row_key): the request's own, else one drawn
        from the engine seed's stream when the request first samples, kept until it finishes."""
        seed = seq.sampling_params.seed
        if seed is not None:
            return seed
        seed = self._seeds.get(seq.request_id)
        if seed is None:
            seed = self._seeds[seq.request_id] = self._seed_source.getrandbits(64)
        return seed

    def quantize_filled_pages(self, ctx: Context) -> None:
        """After the last layer of a decode step: the format quantizes the pages it filled, in every
        layer at once (they were read from staging until now)."""
        self.kv_format.quantize_filled_pages(self.kv_caches, ctx)

    def release(self, seq: Sequence) -> None:
        """Forget per-request state (its drawn seed, its staging slot) once the request is finished."""
        self._seeds.pop(seq.request_id, None)
        self._release_slot(seq)

    @property
    def rank(self) -> int:
        return 0 if self.parallel is None else self.parallel.rank

    def release_pages(self, pages: list[int]) -> None:
        """Tell each layer's format that these pages are free again (before they are reused), on
        every rank."""
        if pages:
            if self.parallel is not None and self.rank == 0:
                with self.parallel.lock:
                    self.parallel.send("release_pages", pages)
            for cache in self.kv_caches:
                self.kv_format.release_pages(cache, pages)
            if self._calibration is not None:  # GPTQ's replay frees them at the same point
                self._calibration.release(pages)

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
        """Whether this step may be replayed from a CUDA graph (the engine allows graphs, the step
        is a decode step that fits one, and nothing observes the model's internals from Python);
        the format's prepare_graph_step has the last word (_prepare_graph_step)."""
        if self.graphs is None:
            return False
        if not step_fits_graph(num_tokens, context_lens, logits_rows,
                               self.block_size, self.graphs.max_batch, self.kv_format.graph_support.replays_fills):
            return False
        return not self._model_is_observed()

    def _prepare_graph_step(self, plan: StepPlan, fill_pages: list[int], block_tables: list[list[int]]) -> bool:
        """The format's host-side work before a replayed step (prepare_graph_step), after the step's
        graph is captured when it fills pages (a capture's warm-up must not see their slots);
        False: run eagerly."""
        context_lens = plan.context_lens
        if fill_pages:
            try:
                self.graphs.capture_for(len(context_lens), len(fill_pages))
            except Exception:  # as a failed replay: stay eager from now on
                log.exception("capturing the decode step failed; decode steps run eagerly from now on")
                self.graphs = None
                return False
        return self._format_prepares(context_lens, plan.query_start, plan.seq_slots, block_tables, fill_pages)

    def _format_prepares(self, context_lens: list[int], query_start: list[int], seq_slots: list[int],
                         block_tables: list[list[int]], fill_pages: list[int]) -> bool:
        """The KV format's verdict on replaying a decode step, its host-side work for the replay done
        when True (GraphStepHooks.prepare_graph_step; several ranks: each on its own pools); True for
        a format without hooks."""
        if not isinstance(self.kv_format, GraphStepHooks):
            return True
        # the first page of each fill's sequence (decode_fills' rows, in its order)
        first_pages = ([block_tables[b][0] for b in filling_rows(context_lens, self.block_size)]
                       if fill_pages else [])
        host = HostLists(context_lens, query_start, seq_slots, block_tables)
        return self.kv_format.prepare_graph_step(self.kv_caches, host, fill_pages, first_pages)

    def _graph_step_not_replayed(self) -> None:
        """The format prepared a replay that does not happen (the step runs eagerly, or fails)."""
        if isinstance(self.kv_format, GraphStepHooks):
            self.kv_format.graph_step_not_replayed(self.kv_caches)

    def _graph_step_replayed(self) -> None:
        """The format's host-side effects of a replayed step."""
        if isinstance(self.kv_format, GraphStepHooks):
            self.kv_format.after_graph_replay(self.kv_caches)

    def _model_is_observed(self) -> bool:
        """A K/V observer (calibration) or a router tap runs Python inside the step: a replay would skip it.
        (The engine's own routing counters are device ops that a graph captures: they do not count.)"""
        hooks = self.model.hooks.layers
        if any(h.kv_observer is not None for h in hooks):
            return True
        return any(getattr(h.router, "runs_python", False) for h in hooks)

    def execute(self, out: SchedulerOutput, blocked_ids: dict[str, list[int]]) -> list[SeqStepResult]:
        """launch, then wait: the step's results with their samples."""
        return self.launch(out, blocked_ids).wait()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, blocked_ids: dict[str, list[int]]) -> PendingStep:
        """Queue the model over the scheduled tokens, and the sampling of sequences whose tokens are
        then all computed; PendingStep.wait() gives the results.

        blocked_ids: request_id -> token ids that may not be sampled this step (min_tokens).
        """
        for seq in out.preempted:  # recomputed from scratch later, in whatever slot is free then
            self._release_slot(seq)
        return self._launch(self._plan(out), blocked_ids)

    @torch.inference_mode()
    def launch_follow_on(self, prev: PendingStep, seqs: list[Sequence],
                         blocked_ids: dict[str, list[int]]) -> PendingStep:
        """Queue the decode step after `prev` (still running) for `seqs`, some or all of prev's
        sequences: each one's input token is the one prev samples for it, read on the device. The
        host has not seen those tokens, so a sequence's num_tokens is one short here: the token
        at position num_tokens goes in, the context is num_tokens + 1 long (pages allocated).
        blocked_ids as in launch, counting prev's token as generated."""
        bs = self.block_size
        row_of = {r.seq.request_id: i for i, r in enumerate(prev.results)}  # followable: sample row i = result i
        rows = [row_of[seq.request_id] for seq in seqs]
        tokens = prev.tokens if rows == list(range(prev.tokens.shape[0])) else prev.tokens[
            to_device(rows, torch.long, self.device)]
        positions = [seq.num_tokens for seq in seqs]
        plan = StepPlan(
            seqs=seqs, input_ids=[0] * len(seqs), positions=positions,
            slots=[seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)],
            context_lens=[p + 1 for p in positions], query_start=list(range(len(seqs) + 1)),
            num_tokens=[1] * len(seqs), seq_slots=[self._slots[seq.request_id] for seq in seqs],
            logits_rows=list(range(len(seqs))),
            rows=[SeqRows(SeqStepResult(seq), [], i, []) for i, seq in enumerate(seqs)], input_ids_device=tokens,
            after=prev)
        return self._launch(plan, blocked_ids)

    def _run_step(self, inputs: StepInputs, input_ids_device: torch.Tensor | None = None):
        """The forward of one step, on every rank when there are several (rank 0 sends the inputs,
        then all ranks report how their forward went: parallel.finish_step raises if one failed)."""
        if self.parallel is None:
            return self.run_model(inputs, input_ids_device)
        with self.parallel.lock:
            self.parallel.send("step", inputs)
            error, out = None, None
            try:
                out = self.run_model(inputs, input_ids_device)
            except Exception as e:
                error = e
            self.parallel.finish_step(error)
        return out

    def run_model(self, inputs: StepInputs, input_ids_device: torch.Tensor | None = None):
        """The model over one step's inputs (this rank's shard): (final hidden states [T, H], Context)."""
        dev = self.device
        ctx = Context(
            positions=to_device(inputs.positions, torch.long, dev),
            slot_mapping=to_device(inputs.slots, torch.long, dev),
            block_tables=to_device(inputs.block_tables, torch.int32, dev),
            context_lens=to_device(inputs.context_lens, torch.int32, dev),
            query_start_loc=to_device(inputs.query_start, torch.int32, dev),
            logits_indices=to_device(inputs.logits_rows, torch.long, dev),
            seq_slots=to_device(inputs.seq_slots, torch.long, dev),
            max_query_len=inputs.max_query_len,
            fills_no_page=inputs.fills_no_page,
            fill_slots=to_device(inputs.fill_slots, torch.long, dev) if inputs.fill_slots else None,
            fill_pages=to_device(inputs.fill_pages, torch.long, dev) if inputs.fill_slots else None,
            host=HostLists(inputs.context_lens, inputs.query_start, inputs.seq_slots, inputs.block_tables),
        )
        if inputs.split_mixed:
            num_tokens = [b - a for a, b in zip(inputs.query_start, inputs.query_start[1:])]
            ctx.mixed = mixed_split(num_tokens, inputs.positions, inputs.slots, inputs.block_tables,
                                    inputs.context_lens, inputs.seq_slots, dev)
        input_ids = input_ids_device
        if inputs.tokens_on_device and self.parallel is not None:  # rank 0's sampled tokens, to every rank
            if input_ids is None:  # a worker
                input_ids = torch.empty(len(inputs.input_ids), dtype=torch.long, device=dev)
            else:
                input_ids = input_ids.to(torch.long).contiguous()
            self.parallel.tp.broadcast(input_ids)
        if input_ids is None:
            input_ids = to_device(inputs.input_ids, torch.long, dev)
        hidden = self.model(input_ids, ctx)
        self.quantize_filled_pages(ctx)
        return hidden, ctx

    # -- decode graphs over several ranks (rank 0 commands, every rank runs) ---------------------
    def _parallel_graph_step(self, plan: StepPlan, block_tables: list[list[int]], fill_slots: list[int],
                             fill_pages: list[int]) -> torch.Tensor | None:
        """Rank 0: the decode step replayed on every rank from the graph of the variant its batch
        needs (captured on every rank first if it is not yet) -> logits [B, V] fp32; None: run the
        step eagerly (the capture failed and graphs are off, or a rank's KV format turned the step
        down: run_graph_step)."""
        bucket, fills = self.graphs.variant_for(len(plan.input_ids), len(fill_slots))
        if (bucket, fills) not in self.graphs.graphs and not self._capture_everywhere(bucket, fills):
            return None
        step = GraphStep(bucket, fills, plan.input_ids, plan.positions, plan.slots, block_tables, plan.context_lens,
                         plan.seq_slots, fill_slots, fill_pages, tokens_on_device=plan.input_ids_device is not None)
        with self.parallel.lock:
            self.parallel.send("graph_step", step)
            return self.run_graph_step(step, plan.input_ids_device)

    def _capture_everywhere(self, bucket: int, fills: int) -> bool:
        """Rank 0: every rank captures variant (bucket, fills); False when a rank failed to (graphs
        are then off on every rank)."""
        with self.parallel.lock:
            self.parallel.send("capture_graph", (bucket, fills))
            try:
                self.capture_graph(bucket, fills)
            except ParallelStepError:
                if self.parallel.broken is not None:
                    raise
                log.exception("capturing the decode step failed on a rank; decode steps run eagerly from now on")
                return False
        return True

    def capture_graph(self, bucket: int, fills: int) -> None:
        """Every rank, on rank 0's command: capture variant (bucket, fills), report, then launch it once
        (the upload runs its collectives: only once every rank has captured). A failure anywhere turns
        graphs off on every rank (ParallelStepError)."""
        error = None
        try:
            if self.graphs is None:
                raise RuntimeError(f"rank {self.rank} runs decode steps eagerly (no graphs)")
            self.graphs.capture(bucket, fills, upload=False)
        except Exception as e:
            error = e
        try:
            self.parallel.finish_step(error)
        except ParallelStepError:
            self.graphs = None
            raise
        try:
            self.graphs.upload(bucket, fills)
        except Exception as e:
            self._replay_failed(e)

    def run_graph_step(self, step: GraphStep, input_ids_device: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every rank, on rank 0's command: load the step's inputs into the static buffers (rank 0's
        sampled tokens broadcast for a follow-on step), let the KV format do its host-side work for
        the replay (prepare_graph_step: each rank on its own pools, tiered's FP8 slots, step count and
        re-ranking), report with the format's verdict, and replay the variant only if every rank is
        ready: a collective inside a graph waits without a timeout. -> the step's logits [B, V] fp32
        (a view of the graph's output); None, on every rank alike, when some rank's format turned the
        step down: nobody replays, and rank 0 sends the step eagerly next (a format that had prepared
        keeps what it did, graph_step_not_replayed: its eager step does not redo it). With emulated
        graphs (the CPU) the replay is the same step function run eagerly, whose collectives time
        out: a second status round follows."""
        graphs, batch, error = self.graphs, len(step.input_ids), None
        ready = prepared = False  # this rank's verdict; whether its format did the step's host-side work
        try:
            if graphs is None or (step.bucket, step.fills) not in graphs.graphs:
                raise RuntimeError(f"rank {self.rank} has no graph of batch bucket {step.bucket}, "
                                   f"{step.fills} page fills")
            graphs.load_step(step.input_ids, step.positions, step.slots, step.block_tables, step.context_lens,
                             step.seq_slots, step.fill_slots, step.fill_pages, step.bucket, step.fills,
                             input_ids_device)
            if step.tokens_on_device:  # rank 0's sampled tokens (already in its buffer) to every rank
                self.parallel.tp.broadcast(graphs.input_ids[:batch])
            ready = prepared = self._format_prepares(step.context_lens, list(range(batch + 1)), step.seq_slots,
                                                     step.block_tables, step.fill_pages)
        except Exception as e:
            error = e
        try:  # raises on every rank if one is not ready: nobody replays
            replay = self.parallel.finish_step(error, ready)
        except ParallelStepError:
            if prepared:
                self._graph_step_not_replayed()
            raise
        if not replay:  # a rank's format turned the step down: every rank runs it eagerly
            if prepared:
                self._graph_step_not_replayed()
            return None
        if graphs.use_graphs:
            try:
                logits = graphs.replay(step.bucket, step.fills, batch)
            except Exception as e:
                self._replay_failed(e)
            self._graph_step_replayed()
            return logits
        logits = None
        try:
            logits = graphs.replay(step.bucket, step.fills, batch)
        except Exception as e:
            error = e
        try:
            self.parallel.finish_step(error)
        except ParallelStepError:
            self._graph_step_not_replayed()
            raise
        self._graph_step_replayed()
        return logits

    def _replay_failed(self, e: Exception):
        """A graph launch raised on this rank: the other ranks' captured collectives wait for it with no
        timeout, so the ranks cannot go on."""
        self.parallel.broken = f"rank {self.rank} failed to launch a captured decode step ({type(e).__name__}: {e})"
        raise ParallelStepError(self.parallel.broken) from e

    def capture_decode_graphs(self, progress: bool = True) -> int:
        """Capture every decode-graph variant now (`moekv serve` at start-up), on every rank when
        there are several; -> how many were new."""
        if self.graphs is None:
            return 0
        if self.parallel is None:
            return self.graphs.capture_all(progress)
        from tqdm import tqdm

        new = 0
        for bucket, fills in tqdm(self.graphs.variants(), desc="capturing decode graphs", disable=not progress):
            if self.graphs is None or (bucket, fills) in self.graphs.graphs:
                continue
            if not self._capture_everywhere(bucket, fills):
                break
            new += 1
        return new

    def graph_stats(self) -> dict:
        """This rank's decode graphs: variants captured, the latest replays in order, captures so far,
        the expert-parallel bytes its static (replayed) steps counted, and the steps each layer's KV
        format counted (a format with a step count, tiered: replayed steps count in prepare_graph_step;
        None for the others)."""
        g = self.graphs
        static = sum(int(ep.static_bytes.item()) for ep in expert_parallel_layers(self.model).values())
        return {"captured": None if g is None else sorted(g.graphs), "replayed": [] if g is None else list(g.replayed),
                "num_captures": 0 if g is None else g.num_captures, "static_ep_bytes": static,
                "format_steps": [getattr(c.state, "steps", None) for c in self.kv_caches]}

    def parallel_graph_stats(self) -> list[dict]:
        """Rank 0: every rank's graph_stats (tests)."""
        if self.parallel is None:
            return [self.graph_stats()]
        with self.parallel.lock:
            self.parallel.send("graph_stats")
            return self.parallel.gather(self.graph_stats())

    def expert_parallel_bytes(self) -> dict[int, list[int]] | None:
        """Expert-parallel traffic so far, summed over the ranks: MoE layer -> [bytes sent, bytes
        received] (None without expert parallelism)."""
        if self.parallel is None or not expert_parallel_bytes(self.model):
            return None
        with self.parallel.lock:
            self.parallel.send("ep_bytes")
            per_rank = self.parallel.gather(expert_parallel_bytes(self.model))
        return {i: [sum(r[i][0] for r in per_rank), sum(r[i][1] for r in per_rank)] for i in per_rank[0]}

    def call_on_rank(self, rank: int, fn) -> None:
        """The test seam (tests/faults.py injects faults through it): fn(runner) on rank `rank`'s
        runner, between steps; fn must pickle (it travels to a worker rank as a command)."""
        if rank == self.rank:
            fn(self)
        else:
            with self.parallel.lock:
                self.parallel.send("call", (rank, fn))

    def shutdown(self) -> None:
        """Stop the worker ranks, if any."""
        if self.parallel is not None and self.rank == 0:
            self.release_graphs()
            self.parallel.shutdown()

    def release_graphs(self) -> None:
        """Before a rank leaves its groups: finish the device's work and drop the captured graphs, so
        that no graph holding the compute group's collectives outlives the group (destroying a NCCL
        group after capture is reported to hang in some torch versions: pytorch#115388)."""
        if self.graphs is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.graphs.reset()

    def _plan(self, out: SchedulerOutput) -> StepPlan:
        """The host-side inputs of a scheduled step."""
        plan = StepPlan(seqs=[item.seq for item in out.scheduled], input_ids=[], positions=[], slots=[],
                        context_lens=[], query_start=[0], num_tokens=[item.num_tokens for item in out.scheduled],
                        seq_slots=[self._slot_for(item.seq) for item in out.scheduled], logits_rows=[], rows=[])
        bs = self.block_size
        logits_rows = plan.logits_rows
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            base = len(plan.input_ids)
            plan.input_ids += seq.token_ids(start, end)
            plan.positions += range(start, end)
            plan.slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            plan.context_lens.append(end)
            plan.query_start.append(len(plan.input_ids))
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
            plan.rows.append(SeqRows(SeqStepResult(seq), prompt_rows, sample_row, logit_rows))
        return plan

    def _launch(self, plan: StepPlan, blocked_ids: dict[str, list[int]]) -> PendingStep:
        num_tokens, context_lens, seq_slots = plan.num_tokens, plan.context_lens, plan.seq_slots
        logits_rows = plan.logits_rows
        results = [row.result for row in plan.rows]
        block_tables = [seq.block_table for seq in plan.seqs]
        bs = self.block_size
        decode_only = all(n == 1 for n in num_tokens)
        fill_slots, fill_pages = [], []  # decode steps: the pages this step's tokens complete
        if decode_only and self.kv_format.graph_support.lists_fills:
            fill_slots, fill_pages = decode_fills(context_lens, seq_slots, block_tables, bs)
        logits, nonfinite = None, None
        if self.parallel is not None and self.step_uses_graph(num_tokens, context_lens, logits_rows):
            # every rank replays the variant rank 0 picks (ParallelStepError: the step failed on a rank)
            logits = self._parallel_graph_step(plan, block_tables, fill_slots, fill_pages)  # [B, V] fp32
            if logits is not None and fill_slots:
                nonfinite = nonfinite_verdict(self.kv_caches)  # (rank 0's pages)
        elif (self.graphs is not None and self.step_uses_graph(num_tokens, context_lens, logits_rows)
                and self._prepare_graph_step(plan, fill_pages, block_tables)):
            try:
                logits = self.graphs.run(plan.input_ids, plan.positions, plan.slots, block_tables, context_lens,
                                         seq_slots, fill_slots, fill_pages,
                                         input_ids_device=plan.input_ids_device)  # [B, V] fp32
            except Exception:  # a host sync or an unsupported op in the step: stay eager from now on
                log.exception("replaying the decode step from a CUDA graph failed; "
                              "decode steps run eagerly from now on")
                self.graphs = None
                self._graph_step_not_replayed()
            if logits is not None:  # replayed: the format's host-side bookkeeping for the step
                if fill_slots:  # what check_finite would have raised in an eager step, read in wait()
                    nonfinite = nonfinite_verdict(self.kv_caches)
                self._graph_step_replayed()
        if logits is None:
            max_pages = max(len(table) for table in block_tables)
            tables = [table + [0] * (max_pages - len(table)) for table in block_tables]
            inputs = StepInputs(
                input_ids=plan.input_ids, positions=plan.positions, slots=plan.slots, block_tables=tables,
                context_lens=context_lens, query_start=plan.query_start, logits_rows=logits_rows,
                seq_slots=seq_slots, max_query_len=max(num_tokens), fills_no_page=all(n % bs for n in context_lens),
                fill_slots=fill_slots, fill_pages=fill_pages,
                split_mixed=self.split_mixed_steps and not decode_only and 1 in num_tokens,
                tokens_on_device=plan.input_ids_device is not None)
            if self.locality is not None:
                self.locality.count_rows(len(plan.positions))
            hidden, ctx = self._run_step(inputs, plan.input_ids_device)
            if not logits_rows:
                return PendingStep(results, self.device, self.kv_caches)
            logits = self.model.compute_logits(hidden[ctx.logits_indices])  # [S, V] fp32

        if plan.after is not None and any(seq.grammar is not None for seq in plan.seqs):
            follow_grammars(plan.seqs, plan.after)  # (the forward is queued: this overlaps it)
        rows, sample_rows, sample_targets = [], [], []
        for plan_rows, context_len in zip(plan.rows, context_lens):
            result, prompt_rows, sample_row = plan_rows.result, plan_rows.prompt_rows, plan_rows.sample_row
            seq = result.seq
            if plan_rows.logit_rows:
                result.prompt_logits = logits[plan_rows.logit_rows].cpu()
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
                # (the sampled token's position is the context's length: under a follow-on step the host
                # has not appended the input token yet, so the sequence's own lists are one short)
                rows.append(SamplingRow(seq.sampling_params, self.seed_for(seq), context_len, seq.prompt_token_ids,
                                        seq.output_token_ids,
                                        [t for t in blocked_ids.get(seq.request_id, ()) if t < vocab],
                                        seq.grammar))
        sampled = None
        if sample_rows:
            every_row = sample_rows == list(range(logits.shape[0]))  # a decode step: no gather copy
            sampled = sample_async(logits if every_row else logits[sample_rows], rows)
        return PendingStep(results, self.device, self.kv_caches, sample_targets, sampled,
                           to_host_async(nonfinite) if nonfinite is not None else None,
                           followable=every_row_samples(plan))

