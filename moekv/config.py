"""Engine configuration: validated dataclasses, one per part of the engine.

EngineConfig holds what the model is and how it runs (checkpoint, tokenizer, dtype, device, ...)
and one group per part of the engine: `cache` (CacheConfig: the KV format, its pages and their
pool), `scheduler` (SchedulerConfig), `router` (RoutingConfig), `experts` (ExpertConfig: offload,
prediction, L2 prefetch) and `parallel` (ParallelConfig: several processes). Each group checks its
own fields when it is built; EngineConfig checks what spans groups.

Construction is flat, as the command line is: EngineConfig(kv_cache_dtype="nuq2", max_model_len=512)
and LLM(model, **kwargs) give each keyword to the group that holds it (a whole group may be given
too: cache=CacheConfig(...)); code reads the grouped names (config.cache.kv_cache_dtype). A KV
format's own options (kv_group_size, ...) are declared by the formats (KVFormat.engine_options)
and held, by the format's keyword, in cache.kv_options.

Every field is checked at construction, before any weight is read, and a bad value raises
`ValueError` naming the field (its flat name), the value and what would be accepted.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from moekv import envs
from moekv.kvcache.formats import engine_options, format_engine_options
from moekv.kvcache.formats.names import (
    DECODE_KERNELS,
    DEFAULT_DECODE_KERNEL,
    KV_FORMAT_NAMES,
    PLAIN_KV_FORMAT_NAMES,
    check_decode_kernel,
    kv_format_names,
)
from moekv.models.load_formats import LOAD_FORMATS
from moekv.ops.quantized_weight import QUANT_METHODS
from moekv.ops.reference import MLA_DECODE_MMAS
from moekv.routing.modes import ROUTING_MODES

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEVICES = ("cpu", "cuda")


def default_model_path() -> Path:
    """The small model the repository ships (models/domain-moe), used when no --model is given."""
    return Path(__file__).resolve().parent.parent / "models" / "domain-moe"


def default_block_size(kv_cache_dtype: str) -> int:
    """Tokens per page when block_size is not given: 16 for the plain formats, 64 for the compressed
    ones (their per-page scales, codebooks and 128-byte slab padding cost less on longer pages)."""
    return 16 if kv_cache_dtype in PLAIN_KV_FORMAT_NAMES else 64


def shipped_kv_calibration(model: str | Path) -> Path | None:
    """The checkpoint's own `kv_calibration/` folder (written by `moekv calibrate`), if it has one."""
    folder = Path(model) / "kv_calibration"
    return folder if (folder / "kv_calibration.safetensors").is_file() else None


def option(help: str, default: Any = None, *, default_factory: Callable[[], Any] | None = None,
           choices: tuple[str, ...] | None = None, flag: str | None = None, aliases: tuple[str, ...] = (),
           cuda_only: bool = False):
    """A config field with what its command-line flag needs (cli/engine_args.py builds the flags from
    these): help text, accepted choices, the flag's name when it is not --field-name, other names
    of the flag (left out by a command that gives the name a meaning of its own), and whether it
    matters only on CUDA (--help lists those under a heading of their own)."""
    metadata = {"help": help, "choices": choices, "flag": flag, "aliases": aliases, "cuda_only": cuda_only}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_default(f) -> Any:
    """The default of a dataclass field, calling its default_factory if it has one."""
    return f.default_factory() if f.default is MISSING else f.default


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def parse_dtype(name: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        _check(name in DTYPES.values(), f"{field_name}={name} is not supported; accepted: {sorted(set(DTYPES))}")
        return name
    _check(name in DTYPES, f"{field_name}={name!r} is not supported; accepted: {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class CacheConfig:
    """The KV cache: its format, the kernel its pages are laid out for, the pages and their pool.

    decode_kernel: which decode attention kernel the compressed formats' pools are laid out for, and
        with it their bytes per page and how many tokens fit (the format object carries it): 'auto' =
        the Gluon kernels (moekv/ops/gluon/) on an sm_90 GPU for the shapes they cover (int4, kivi2,
        nuq2, vq, tiered with page codebooks; 64-token pages, head_dim 128), pages in their fragment
        order, the Triton kernels over slab pages elsewhere; 'triton' = slab pages everywhere; 'gluon' =
        fragment order for a format with a Gluon kernel (fp8_e4m3's too) wherever it covers the shape,
        the CPU included (where the reference path reads it), and a ValueError where it does not (the
        plain formats have none and are the same under every choice).
    block_size: tokens per KV page; None = default_block_size(kv_cache_dtype).
    num_kv_blocks: pages in the KV pool; None = sized from kv_cache_memory_gb (CPU) or from
        gpu_memory_utilization (CUDA). Each pool holds one page more (and one staging slot more
        than max_num_seqs): the scratch page that padded rows of a CUDA-graph replay use.
    enable_prefix_caching: full KV pages of identical prompt prefixes are computed once and shared
        by later requests (chained content hash, reference counts, unreferenced cached pages evicted
        least recently used first), as vLLM's flag. Refused with tiered (its re-ranking rewrites
        written pages) and with kivi2, nuq2 and vq unless kv_residual=0 (their 16-bit window is per sequence).
    kv_options: the format's options by its keyword (group_size, ...; the flat field and flag are
        kv_<name>: kv_group_size, --kv-group-size), declared by the formats (KVFormat.engine_options).
        Given: any of them; once validated: every option the format takes, at its default where not
        given. One set away from its default for a format that does not take it was meant for another
        format: refused, not ignored (the CLI passes every flag, at its default when not given).
        kv_calibration=None stays None here; EngineConfig.kv_format_options resolves it to the
        checkpoint's shipped folder.
    """

    kv_cache_dtype: str = option("KV format: " + " | ".join(KV_FORMAT_NAMES), "auto")
    decode_kernel: str = option(
        "decode attention kernel the KV pages are laid out for: auto (the Gluon kernels on sm_90 for the shapes they "
        "cover, else Triton) | triton (slab pages) | gluon (fragment order wherever covered)", DEFAULT_DECODE_KERNEL,
        choices=DECODE_KERNELS, cuda_only=True)
    block_size: int | None = option("tokens per KV page (default: 16 for bf16/fp16/fp32, 64 for compressed formats)")
    num_kv_blocks: int | None = option("pages in the KV pool (default: sized from the memory budget)")
    kv_cache_memory_gb: float = option("CPU: GB of KV pages when --num-kv-blocks is not given", 1.0)
    gpu_memory_utilization: float = option(
        "CUDA: share of the card's memory the engine may fill (weights, KV pages, activations)", 0.9, cuda_only=True)
    enable_prefix_caching: bool = option(
        "share the KV pages of identical prompt prefixes across requests (full pages, by content hash)", False)
    mla_decode_mma: str = option(
        "multi-head latent attention models: the absorbed decode's MMA operands: auto (the queries' dtype) | bf16 | "
        "fp8 (queries and probabilities in float8 e4m3; the CUDA kernel's fp8-MMA form on the fp8_e4m3 latent) | "
        "fp8_queries | fp8_probs (one of the two in e4m3: for measuring, on the reference path)", "auto",
        choices=tuple(MLA_DECODE_MMAS))
    kv_options: dict[str, Any] = field(default_factory=dict, metadata={"kv_options": True})

    def __post_init__(self) -> None:
        _check(self.kv_cache_dtype in kv_format_names(),
               f"kv_cache_dtype={self.kv_cache_dtype!r} is unknown; accepted: {list(kv_format_names())}")
        check_decode_kernel(self.decode_kernel)
        envs.check_decode_kernel_unset()
        _check(self.mla_decode_mma in MLA_DECODE_MMAS,
               f"mla_decode_mma={self.mla_decode_mma!r} is unknown; accepted: {list(MLA_DECODE_MMAS)}")
        if self.block_size is None:
            self.block_size = default_block_size(self.kv_cache_dtype)
        self._check_kv_options()
        _check(isinstance(self.block_size, int) and self.block_size >= 1
               and (self.block_size & (self.block_size - 1)) == 0,
               f"block_size={self.block_size!r} must be a power of two >= 1 (e.g. 16)")
        _check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
               f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 1 (or None to size from memory)")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        _check(self.kv_cache_memory_gb > 0, f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} must be > 0")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")

    def _check_kv_options(self) -> None:
        """Each option the format takes checked by the format's own rule; one it does not take set
        away from its default refused, naming those it takes."""
        declared = engine_options()
        given = dict(self.kv_options)
        unknown = [name for name in given if name not in declared]
        _check(not unknown, f"kv_options={given!r}: no format takes {unknown}; the formats' options: {list(declared)}")
        taken = {option.name: option for option in format_engine_options(self.kv_cache_dtype)}
        unused = [f"{declared[name].field}={given[name]!r}" for name in declared
                  if name in given and name not in taken and given[name] != declared[name].default]
        _check(not unused, f"kv_cache_dtype={self.kv_cache_dtype!r} does not take {', '.join(unused)}; it takes: "
                           f"{[declared[name].field for name in declared if name in taken] or 'no kv_* option'}")
        self.kv_options = {name: given.get(name, taken[name].default) for name in declared if name in taken}
        for name, value in self.kv_options.items():
            refusal = taken[name].refusal(value)
            _check(refusal is None, refusal)


@dataclass
class SchedulerConfig:
    """What one engine step batches.

    max_num_seqs: sequences in one batch (running at once).
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    async_scheduling: queue each decode step on the device before the host has read the step
        before it (its input tokens are read on the device), so that the host's work per step
        overlaps the device's (as vLLM's --async-scheduling). A sequence that stops on a token the
        host had not yet seen costs one token of wasted compute. None = on for CUDA, off on the CPU
        (where the host does the model's work itself and nothing would overlap) and with
        tensor_parallel_size > 1 (True works there: rank 0 broadcasts the tokens on the device);
        EngineConfig.async_scheduling_enabled decides.
    """

    max_num_seqs: int = option("sequences in one batch", 64)
    max_num_batched_tokens: int = option("token budget of one step (prefill chunks + decodes)", 2048)
    async_scheduling: bool | None = option(
        "queue each decode step before the host has read the one before it (default: on CUDA)")

    def __post_init__(self) -> None:
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
               f"max_num_seqs={self.max_num_seqs!r} must be an integer >= 1")
        _check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an integer >= 1")
        _check(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
               f"async_scheduling={self.async_scheduling!r} must be True, False or None (on CUDA only)")


@dataclass
class RoutingConfig:
    """How each MoE layer picks its experts (moekv/routing)."""

    routing: str = option(
        " | ".join(ROUTING_MODES) + " (auto: group_limited when the checkpoint has n_group/topk_group, else flat)",
        "auto")
    cluster_map: str | Path | None = option(
        "hierarchical: cluster map file from `moekv cluster` (also counts routing locality under it)")
    clusters_per_token: int | None = option("hierarchical: most clusters per token (default: the map's)")
    cluster_admit_margin: float | None = option(
        "hierarchical: admit a further cluster while its coarse score (log routing mass) is within this of the "
        "best (default: the map's)")
    n_group: int | None = option("group_limited: expert groups (default: the checkpoint's)")
    topk_group: int | None = option("group_limited: groups kept per token (default: the checkpoint's)")

    def __post_init__(self) -> None:
        _check(self.routing in ROUTING_MODES, f"routing={self.routing!r} is unknown; accepted: {list(ROUTING_MODES)}")
        if self.cluster_map is not None:
            self.cluster_map = Path(self.cluster_map)
            _check(self.cluster_map.is_file(), f"cluster_map={str(self.cluster_map)!r}: no such file "
                                               "(make one with `moekv cluster`)")
        _check(self.routing != "hierarchical" or self.cluster_map is not None,
               "routing='hierarchical' needs cluster_map (a file written by `moekv cluster`)")
        _check(self.clusters_per_token is None
               or (isinstance(self.clusters_per_token, int) and self.clusters_per_token >= 1),
               f"clusters_per_token={self.clusters_per_token!r} must be an integer >= 1 (or None for the map's value)")
        _check(self.cluster_admit_margin is None or (isinstance(self.cluster_admit_margin, (int, float))
                                                     and self.cluster_admit_margin == self.cluster_admit_margin),
               f"cluster_admit_margin={self.cluster_admit_margin!r} must be a number (inf: admit up to "
               "clusters_per_token, -inf: one cluster per token; None: the map's per-layer values)")
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 1),
                   f"{name}={value!r} must be an integer >= 1 (or None for the checkpoint's value)")
        _check(self.n_group is None or self.topk_group is None or self.topk_group <= self.n_group,
               f"topk_group={self.topk_group} must be <= n_group={self.n_group}")

    def routing_options(self) -> dict:
        """install_routers' keyword arguments."""
        return {"routing": self.routing, "cluster_map": self.cluster_map, "clusters_per_token": self.clusters_per_token,
                "admit_margin": self.cluster_admit_margin, "n_group": self.n_group, "topk_group": self.topk_group}


# the expert_offload options: given only with expert_offload=True
OFFLOAD_OPTIONS = ("gpu_expert_budget_gb", "expert_cache_slots", "expert_prefetch", "expert_prefetch_per_token",
                   "expert_prefetch_lookahead", "expert_prefetch_async")


@dataclass
class ExpertConfig:
    """Where the experts' weights live and what is copied in ahead of use (moekv/experts):
    expert offload with prediction and prefetch, and the L2 prefetch of resident experts."""

    expert_offload: bool = option(
        "keep the experts that do not fit --gpu-expert-budget in (pinned) host memory, with an on-device expert "
        "cache per MoE layer", False)
    gpu_expert_budget_gb: float | None = option(
        "expert_offload: GiB of device memory for expert weights over all MoE layers (default: half of them)",
        flag="--gpu-expert-budget")
    expert_cache_slots: int | None = option(
        "expert_offload: experts resident per MoE layer (overrides --gpu-expert-budget)")
    expert_prefetch: bool | None = option(
        "expert_offload: copy each MoE layer's predicted experts in before the layer runs (default: on)")
    expert_prefetch_per_token: int | None = option(
        "expert_offload: predicted experts prefetched per token (default: the model's top-k)")
    expert_prefetch_lookahead: int | None = option(
        "expert_offload: predict MoE layer L's experts from the residual stream entering layer L - (N - 1): 1 = "
        "before layer L's own attention, 2 = a whole layer earlier (default: 1)")
    expert_prefetch_async: bool | None = option(
        "expert_offload: read the prediction without a host sync (device -> pinned buffer on a side stream, acted "
        "on once its event is done; a prediction not ready by its layer is dropped or, if made a layer earlier, "
        "waited for) (default: off)")
    expert_predictor: str | Path | None = option(
        "file from `moekv calibrate-experts` (fitted predictor, hot experts); default: pre-gating")
    expert_l2_prefetch: bool = option(
        "CUDA, all experts resident: while each layer's attention runs, a side stream predicts the layer's experts "
        "and prefetches the first bytes of their weights into L2 (moekv/experts/l2_prefetch.py)", False, cuda_only=True)
    expert_l2_prefetch_mb: float | None = option(
        "expert_l2_prefetch: MB prefetched per MoE layer and step (default: min(half the L2, what HBM delivers "
        "in 10 us))", cuda_only=True)

    def __post_init__(self) -> None:
        _check(isinstance(self.expert_offload, bool), f"expert_offload={self.expert_offload!r} must be True or False")
        _check(self.gpu_expert_budget_gb is None
               or (isinstance(self.gpu_expert_budget_gb, (int, float)) and self.gpu_expert_budget_gb > 0),
               f"gpu_expert_budget_gb={self.gpu_expert_budget_gb!r} must be a number of GiB > 0 (or None)")
        _check(self.expert_cache_slots is None
               or (isinstance(self.expert_cache_slots, int) and self.expert_cache_slots >= 1),
               f"expert_cache_slots={self.expert_cache_slots!r} must be an integer >= 1 (or None)")
        _check(self.expert_prefetch is None or isinstance(self.expert_prefetch, bool),
               f"expert_prefetch={self.expert_prefetch!r} must be True, False or None")
        _check(self.expert_prefetch_per_token is None
               or (isinstance(self.expert_prefetch_per_token, int) and self.expert_prefetch_per_token >= 1),
               f"expert_prefetch_per_token={self.expert_prefetch_per_token!r} must be an integer >= 1 (or None)")
        ahead = self.expert_prefetch_lookahead
        _check(ahead is None or (isinstance(ahead, int) and not isinstance(ahead, bool) and ahead >= 1),
               f"expert_prefetch_lookahead={ahead!r} must be an integer >= 1 (or None)")
        _check(self.expert_prefetch_async is None or isinstance(self.expert_prefetch_async, bool),
               f"expert_prefetch_async={self.expert_prefetch_async!r} must be True, False or None")
        if not self.expert_offload:
            given = [name for name in OFFLOAD_OPTIONS if getattr(self, name) is not None]
            _check(not given, f"{', '.join(given)} only apply with expert_offload=True (--expert-offload)")
        _check(isinstance(self.expert_l2_prefetch, bool),
               f"expert_l2_prefetch={self.expert_l2_prefetch!r} must be True or False")
        _check(self.expert_l2_prefetch_mb is None
               or (isinstance(self.expert_l2_prefetch_mb, (int, float))
                   and not isinstance(self.expert_l2_prefetch_mb, bool) and self.expert_l2_prefetch_mb > 0),
               f"expert_l2_prefetch_mb={self.expert_l2_prefetch_mb!r} must be a number of MB > 0 (or None)")
        _check(self.expert_l2_prefetch_mb is None or self.expert_l2_prefetch,
               "expert_l2_prefetch_mb only applies with expert_l2_prefetch=True (--expert-l2-prefetch)")
        _check(not (self.expert_l2_prefetch and self.expert_offload),
               "expert_l2_prefetch=True prefetches resident experts into L2; with expert_offload=True the experts "
               "are copied in from the host instead: use one of them")
        if self.expert_predictor is not None:
            self.expert_predictor = Path(self.expert_predictor)
            _check(self.expert_predictor.is_file(), f"expert_predictor={str(self.expert_predictor)!r}: no such file "
                                                    "(make one with `moekv calibrate-experts`)")


@dataclass
class ParallelConfig:
    """Several processes (engine/parallel.py, layers/parallel.py), and the threads of each on the CPU
    (cpu_threads: torch's intra-op threads per rank; None = engine/cpu_threads.py chooses them for the
    rank's share of the parameters and of the free cores, unless OMP_NUM_THREADS is set)."""

    tensor_parallel_size: int = option(
        "ranks the model is split over: attention heads, MLP and (without expert parallel) experts; rank 0 is this "
        "process, the engine starts the others (one per GPU on CUDA, gloo processes on the CPU)", 1)
    enable_expert_parallel: bool = option(
        "with tensor_parallel_size > 1: whole experts per rank (the cluster map's clusters when one is given, "
        "else contiguous slices), tokens sent to the ranks of their experts", False)
    distributed_timeout: float = option(
        "seconds a collective waits for the other ranks before the step fails", 300.0)
    cpu_threads: int | None = option(
        "CPU: torch intra-op threads per rank (default: chosen for the model's size and the free cores: 1-2 for a "
        "model under 100M parameters, else one per free core up to 32; OMP_NUM_THREADS set is kept)",
        flag="--threads")

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        _check(self.cpu_threads is None or (isinstance(self.cpu_threads, int) and not isinstance(self.cpu_threads, bool)
                                            and self.cpu_threads >= 1),
               f"cpu_threads={self.cpu_threads!r} must be an integer >= 1 (or None to choose for the model and cores)")
        _check(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
               f"tensor_parallel_size={tp!r} must be an integer >= 1")
        _check(isinstance(self.enable_expert_parallel, bool),
               f"enable_expert_parallel={self.enable_expert_parallel!r} must be True or False")
        _check(isinstance(self.distributed_timeout, (int, float)) and self.distributed_timeout > 0,
               f"distributed_timeout={self.distributed_timeout!r} must be a number of seconds > 0")


def group(cls: type, title: str):
    """An EngineConfig field holding one group; `title` heads its flags in --help."""
    return field(default_factory=cls, metadata={"group": title})


@dataclass(init=False)
class EngineConfig:
    """What the engine needs to know before it loads anything.

    model: a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json).
    load_format: 'auto' / 'safetensors' read the checkpoint's weights; 'dummy' draws random ones of
        config.json's shape on the device instead (as vLLM's flag: benchmarks of a model whose
        weights are not on the machine; config.json and tokenizer.json are still read).
    quantization: weight-only quantization of the experts, the attention projections and the LM head
        (as vLLM's flag; docs/quantization.md): 'fp8' or 'int4' quantizes a 16-bit checkpoint on load;
        None takes the checkpoint's own `quantization_config` (pre-quantized weights) or 16-bit. The
        pre-quantized format must agree with a value given.
    quantization_calibration: a text file; with quantization='int4' the experts, attention projections
        and LM head are rounded by GPTQ on the inputs its first tokens give them (the engine runs them at
        start, with the weights still 16-bit: the KV pools are sized beside 16-bit weights; then one
        decoder layer at a time, each on the inputs the layers rounded before it give), instead of
        round-to-nearest; the layout (groups of 128, zero points) is the same.
    max_model_len: prompt + generated tokens of one sequence; None = the model's
        max_position_embeddings.
    enforce_eager: never replay decode steps from CUDA graphs (as vLLM's flag). By default, on CUDA,
        with a KV format whose decode steps take a fused kernel (bf16/fp16, fp8_e4m3, int4, kivi2,
        nuq2, vq, tiered with page codebooks) and an fp16/bf16 model, a decode-only step is padded
        to the next batch bucket (1, 2, 4, ... max_num_seqs) and replayed from a graph captured for
        that bucket (and, for the compressed formats, for its number of page fills) on its first
        use; prefill and mixed steps, tiered's page-filling and re-ranking steps and the CPU run
        eagerly.
    tokenizer: a folder holding tokenizer.json (tokenizer_config.json and a chat template are read
        beside it) or a tokenizer.json file, used instead of the checkpoint's (as vLLM's flag).
    skip_tokenizer_init: load no tokenizer (as vLLM's flag): prompts must be token ids (text or chat
        is a ValueError), outputs carry token ids and empty text, stop strings are refused; a
        checkpoint folder without tokenizer.json loads.
    seed: the flag is --seed in every command, as vLLM's engine seed (--engine-seed is the same flag);
        a request's own seed is `moekv generate --request-seed`, the passkeys' `eval retrieval --key-seed`.
    cache, scheduler, router, experts, parallel: the groups (their classes say what they hold); the
        routing group is `router`, as `routing` is its routing mode's flat name (routing="hierarchical").

    EngineConfig(**kwargs) takes these fields, whole groups, and every group's fields by name
    (flat: kv_cache_dtype=..., max_num_seqs=..., kv_group_size=...); a flat field given with its
    whole group replaces that field of the group.
    """

    model: str | Path = option(
        "Hugging Face checkpoint folder (default: the bundled models/domain-moe)", default_factory=default_model_path)
    dtype: str = option("auto | float32 | bfloat16 | float16", "auto")
    device: str = option("cpu | cuda", "cpu")
    max_model_len: int | None = option("prompt + generated tokens of one sequence (default: the model's limit)")
    seed: int = option("seed of the sampler for requests without their own seed", 0, flag="--seed",
                       aliases=("--engine-seed",))
    enforce_eager: bool = option(
        "never replay decode steps from CUDA graphs (default: graphs on CUDA where the KV format allows)", False,
        cuda_only=True)
    load_format: str = option(
        "dummy: random weights of config.json's shape instead of the checkpoint's (benchmarks)", "auto",
        choices=LOAD_FORMATS)
    quantization: str | None = option(
        "weights: fp8 (e4m3, per-output-channel scales) | int4 (W4A16, groups of 128 with zero points), quantized "
        "on load from 16-bit checkpoints for the experts, attention projections and LM head (default: the "
        "checkpoint's quantization_config if it has one, else 16-bit)", choices=QUANT_METHODS)
    quantization_calibration: str | Path | None = option(
        "text file: with quantization=int4, the experts, attention projections and LM head are rounded by GPTQ on "
        "the inputs this text gives them (its first 8192 tokens, run through the engine at start; one layer at a "
        "time, each on the outputs of the layers rounded before it) instead of to "
        "the nearest code (the same layout); give text that mixes the traffic's domains")
    tokenizer: str | Path | None = option(
        "tokenizer folder or tokenizer.json file to use instead of the checkpoint's (default: the checkpoint's)")
    skip_tokenizer_init: bool = option(
        "load no tokenizer: prompts must be token ids; outputs carry token ids and empty text", False)
    cache: CacheConfig = group(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = group(SchedulerConfig, "scheduler")
    router: RoutingConfig = group(RoutingConfig, "routing")  # not `routing`: that is the routing mode's flat name
    experts: ExpertConfig = group(ExpertConfig, "experts")
    parallel: ParallelConfig = group(ParallelConfig, "parallel")

    def __init__(self, **kwargs: Any) -> None:
        groups = config_groups()
        flat = {f.name: f for f in flat_fields()}
        given: dict[str, dict[str, Any]] = {name: {} for name in groups}
        for key, value in kwargs.items():
            if key in groups:
                continue
            if key not in flat:
                raise TypeError(f"EngineConfig got an unexpected keyword argument {key!r}")
            f = flat[key]
            if f.kv_option is not None:
                given[f.group].setdefault("kv_options", {})[f.kv_option] = value
            elif f.group is not None:
                given[f.group][key] = value
        for f in fields(EngineConfig):
            if f.name not in groups:
                setattr(self, f.name, kwargs[f.name] if f.name in kwargs else field_default(f))
        self._check_own_fields()
        for name, cls in groups.items():
            whole = kwargs.get(name)
            if whole is None:
                setattr(self, name, cls(**given[name]))
                continue
            _check(isinstance(whole, cls), f"{name}={whole!r} must be a {cls.__name__}")
            if given[name].get("kv_options"):
                given[name]["kv_options"] = {**whole.kv_options, **given[name]["kv_options"]}
            setattr(self, name, dataclasses.replace(whole, **given[name]) if given[name] else whole)
        self._check_across_groups()

    def _check_own_fields(self) -> None:
        self.model = Path(self.model)
        _check(self.dtype == "auto" or self.dtype in DTYPES,
               f"dtype={self.dtype!r} is not supported; accepted: 'auto' or one of {sorted(DTYPES)}")
        device_type = str(self.device).split(":")[0]
        _check(device_type in DEVICES,
               f"device={self.device!r} is not supported; accepted: {list(DEVICES)} (optionally 'cuda:N')")
        if device_type == "cuda":
            _check(torch.cuda.is_available(),
                   f"device={self.device!r} was asked for but torch sees no CUDA device; use device='cpu'")
        _check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
               f"max_model_len={self.max_model_len!r} must be an integer >= 2 (or None for the model's limit)")
        _check(isinstance(self.enforce_eager, bool), f"enforce_eager={self.enforce_eager!r} must be True or False")
        _check(isinstance(self.skip_tokenizer_init, bool),
               f"skip_tokenizer_init={self.skip_tokenizer_init!r} must be True or False")
        if self.tokenizer is not None:
            _check(not self.skip_tokenizer_init,
                   f"tokenizer={str(self.tokenizer)!r} and skip_tokenizer_init=True contradict each other; give one")
            self.tokenizer = Path(self.tokenizer)
            _check(self.tokenizer.is_file() or (self.tokenizer / "tokenizer.json").is_file(),
                   f"tokenizer={str(self.tokenizer)!r} is neither a tokenizer.json file nor a folder holding one")
        _check(self.load_format in LOAD_FORMATS,
               f"load_format={self.load_format!r} is not supported; accepted: {list(LOAD_FORMATS)}")
        _check(self.quantization is None or self.quantization in QUANT_METHODS,
               f"quantization={self.quantization!r} is not supported; accepted: None or one of {list(QUANT_METHODS)}")
        if self.quantization_calibration is not None:
            _check(self.quantization == "int4", f"quantization_calibration is for quantization='int4' (GPTQ rounding "
                   f"of the int4 weights); quantization={self.quantization!r}")
            _check(Path(self.quantization_calibration).is_file(),
                   f"quantization_calibration={str(self.quantization_calibration)!r} is not a text file")

    def _check_across_groups(self) -> None:
        tp, experts = self.parallel.tensor_parallel_size, self.experts
        _check(not (experts.expert_offload and tp > 1),
               "expert_offload=True is not supported with tensor_parallel_size > 1 (each rank would need its own "
               "expert cache); use one of them")
        if self.quantization_calibration is not None:
            _check(tp == 1, "quantization_calibration is not supported with tensor_parallel_size > 1")
        if self.quantization is not None:
            _check(not experts.expert_offload and not experts.expert_l2_prefetch,
                   f"quantization={self.quantization!r} is not supported with expert_offload or expert_l2_prefetch "
                   "(their expert caches and prefetch copy 16-bit expert tensors); turn those off")
        if experts.expert_l2_prefetch:
            _check(tp == 1, "expert_l2_prefetch=True is not supported with tensor_parallel_size > 1")
            _check(self.torch_device.type == "cuda",
                   f"expert_l2_prefetch=True needs a CUDA device (it issues the GPU's L2 prefetch instruction from a "
                   f"Triton kernel on a side stream); device={self.device!r}")
        if tp > 1 and self.torch_device.type == "cuda":
            _check(self.torch_device.index in (None, 0),
                   f"device={self.device!r}: with tensor_parallel_size > 1 rank r runs on cuda:r; give device='cuda'")
            env = envs.launcher_env()
            if env is None:  # the engine starts the ranks, one per GPU of this host
                _check(torch.cuda.device_count() >= tp,
                       f"tensor_parallel_size={tp} needs {tp} GPUs; torch sees {torch.cuda.device_count()}")
            else:  # torchrun: this host's ranks, one per GPU of this host
                _check(torch.cuda.device_count() > env.local_rank,
                       f"torchrun gave this process LOCAL_RANK={env.local_rank}, but torch sees "
                       f"{torch.cuda.device_count()} GPUs here: give --nproc-per-node <= the GPUs of each host")

    def kv_format_options(self) -> dict:
        """The options of the chosen format (cache.kv_options), for get_kv_format; kv_calibration=None
        resolves here to the checkpoint's shipped folder (not in validation, which must stay repeatable)."""
        options = dict(self.cache.kv_options)
        if "calibration" in options and options["calibration"] is None:
            options["calibration"] = shipped_kv_calibration(self.model)
        return options

    @property
    def async_scheduling_enabled(self) -> bool:
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        # several ranks: off until measured on GPUs (each step's token broadcast is one more collective)
        return self.torch_device.type == "cuda" and self.parallel.tensor_parallel_size == 1

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)




def config_groups() -> dict[str, type]:
    """EngineConfig's groups: its field's name -> the group's class."""
    return {f.name: f.default_factory for f in fields(EngineConfig) if "group" in f.metadata}


@dataclass(frozen=True)
class FlatField:
    """One keyword of EngineConfig(**kwargs) (and LLM), and one engine flag of the command line."""

    name: str  # the keyword, the flag's dest
    group: str | None  # the EngineConfig field (a group) that holds it; None: EngineConfig's own field
    default: Any
    help: str
    value_type: type  # what the flag's string becomes: bool, int, float or str (paths stay strings)
    choices: tuple | None = None
    flag: str | None = None  # the flag's name when it is not --name-with-dashes
    aliases: tuple[str, ...] = ()
    kv_option: str | None = None  # a KV format's option: its keyword in cache.kv_options
    cuda_only: bool = False  # matters only on a CUDA device


def _value_type(hint: Any) -> type:
    args = typing.get_args(hint) or (hint,)
    for kind in (bool, int, float):
        if kind in args:
            return kind
    return str


def _fields_of(cls: type, group: str | None) -> list[FlatField]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if "group" in f.metadata:
            continue
        if f.metadata.get("kv_options"):  # the formats' options, as they declare them
            out += [FlatField(o.field, group, o.default, o.help, o.value_type, o.choices, kv_option=o.name)
                    for o in engine_options().values()]
            continue
        out.append(FlatField(f.name, group, field_default(f), f.metadata["help"], _value_type(hints[f.name]),
                             f.metadata["choices"], f.metadata["flag"], f.metadata["aliases"],
                             cuda_only=f.metadata["cuda_only"]))
    return out


@functools.cache
def flat_fields() -> tuple[FlatField, ...]:
    """Every flat keyword of EngineConfig: its own fields, then each group's, in declaration order."""
    out = _fields_of(EngineConfig, None)
    for name, cls in config_groups().items():
        out += _fields_of(cls, name)
    names = [f.name for f in out]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(config_groups())))
    if clash:  # one keyword, one meaning
        raise TypeError(f"EngineConfig's flat keywords {clash} are named twice (by two groups, or by a group itself)")
    return tuple(out)
