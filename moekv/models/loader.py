"""Hugging Face checkpoint folder -> MoEDecoder, without importing transformers.

Reads config.json, picks the architecture module, builds the engine's own modules and streams the
safetensors tensors (single file, or shards listed in model.safetensors.index.json) straight into
them: q/k/v into one qkv matrix, per-expert gate/up/down into stacked [E, ...] tensors.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open

from moekv.layers.moe import SparseMoE, local_experts
from moekv.models import deepseek, glm4_moe, gpt_oss, mixtral, olmoe, qwen_moe
from moekv.models.decoder import MoEDecoder
from moekv.models.load_formats import LOAD_FORMATS
from moekv.models.model_config import ModelConfig, UnsupportedModelError, apply_routing_fields
from moekv.models.prequantized import (
    CheckpointQuantization,
    check_not_ignored,
    checkpoint_quantization,
    copy_part,
    install_placeholders,
    split_name,
)
from moekv.models.quantize import install_empty_quantized, quantize_stacked
from moekv.ops.quantized_weight import QuantizedWeight, quantize
from moekv.routing import ROUTING_MODES, HierarchicalRouter, checkpoint_router, group_limited_router, resolve_routing
from moekv.routing.cluster_map import ClusterMap

ARCH_MODULES: dict[str, ModuleType] = {name: mod for mod in (mixtral, qwen_moe, olmoe, deepseek, glm4_moe, gpt_oss)
                                       for name in mod.ARCHITECTURES}
SUPPORTED_ARCHITECTURES = tuple(ARCH_MODULES)


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match its config (names which and why)."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (a Hugging Face checkpoint folder needs it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def check_model_dir(model_dir: Path) -> None:
    if not model_dir.exists():
        raise FileNotFoundError(f"model folder not found: {model_dir}")
    if not model_dir.is_dir():
        raise CheckpointError(f"model={model_dir} must be a folder holding config.json, *.safetensors, tokenizer.json")


def load_model_config(model_dir: Path) -> ModelConfig:
    check_model_dir(model_dir)
    hf = read_json(model_dir / "config.json", "config.json")
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in ARCH_MODULES:
        raise UnsupportedModelError(
            f"architecture {archs[0] if archs else '(none given in config.json)'!r} is not supported; "
            f"accepted: {list(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r} is not supported; accepted: 'silu'")
    try:
        return apply_routing_fields(ARCH_MODULES[archs[0]].config_from_hf(hf), hf)
    except (TypeError, KeyError) as e:
        raise CheckpointError(f"{model_dir / 'config.json'} is malformed for {archs[0]}: {e!r}") from e


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (other weight formats are not read)")
    return files


# Canonical tensor name (Qwen/OLMoE style, after the architecture's renaming) -> our parameter and
# the slice of it the tensor fills. Each rule: regex, target template, slicer(cfg, match) -> index.
_Index = tuple  # a tuple of ints / slices into the target parameter
_RULES: list[tuple[re.Pattern, str, Any]] = []


def _rule(pattern: str, target: str, index=lambda cfg, m: ()):
    _RULES.append((re.compile(pattern + "$"), target, index))


_L = r"model\.layers\.(?P<l>\d+)"
_rule(r"model\.embed_tokens\.weight", "embed_tokens")
_rule(r"model\.norm\.weight", "norm.weight")
_rule(r"lm_head\.weight", "lm_head")
_rule(_L + r"\.input_layernorm\.weight", "layers.{l}.input_layernorm.weight")
_rule(_L + r"\.post_attention_layernorm\.weight", "layers.{l}.post_attention_layernorm.weight")
_rule(_L + r"\.self_attn\.q_proj\.weight", "layers.{l}.self_attn.qkv_proj", lambda c, m: (slice(0, c.q_size),))
_rule(_L + r"\.self_attn\.k_proj\.weight", "layers.{l}.self_attn.qkv_proj",
      lambda c, m: (slice(c.q_size, c.q_size + c.kv_size),))
_rule(_L + r"\.self_attn\.v_proj\.weight", "layers.{l}.self_attn.qkv_proj",
      lambda c, m: (slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),))
_rule(_L + r"\.self_attn\.q_proj\.bias", "layers.{l}.self_attn.qkv_bias", lambda c, m: (slice(0, c.q_size),))
_rule(_L + r"\.self_attn\.k_proj\.bias", "layers.{l}.self_attn.qkv_bias",
      lambda c, m: (slice(c.q_size, c.q_size + c.kv_size),))
_rule(_L + r"\.self_attn\.v_proj\.bias", "layers.{l}.self_attn.qkv_bias",
      lambda c, m: (slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),))
_rule(_L + r"\.self_attn\.o_proj\.weight", "layers.{l}.self_attn.o_proj")
_rule(_L + r"\.self_attn\.o_proj\.bias", "layers.{l}.self_attn.o_bias")
_rule(_L + r"\.self_attn\.q_norm\.weight", "layers.{l}.self_attn.q_norm.weight")
_rule(_L + r"\.self_attn\.k_norm\.weight", "layers.{l}.self_attn.k_norm.weight")
_rule(_L + r"\.mlp\.gate\.weight", "layers.{l}.mlp.gate")
_rule(_L + r"\.mlp\.gate\.e_score_correction_bias", "layers.{l}.mlp.e_score_correction_bias")
_rule(_L + r"\.mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight", "layers.{l}.mlp.w13",
      lambda c, m: (int(m["e"]), slice(0, c.moe_intermediate_size)))
_rule(_L + r"\.mlp\.experts\.(?P<e>\d+)\.up_proj\.weight", "layers.{l}.mlp.w13",
      lambda c, m: (int(m["e"]), slice(c.moe_intermediate_size, 2 * c.moe_intermediate_size)))
_rule(_L + r"\.mlp\.experts\.(?P<e>\d+)\.down_proj\.weight", "layers.{l}.mlp.w2", lambda c, m: (int(m["e"]),))
# transformers >= 5 may also store experts already stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I].
_rule(_L + r"\.mlp\.experts\.gate_up_proj", "layers.{l}.mlp.w13")
_rule(_L + r"\.mlp\.experts\.down_proj", "layers.{l}.mlp.w2")
_rule(_L + r"\.mlp\.shared_expert\.gate_proj\.weight", "layers.{l}.mlp.shared_expert.gate_up_proj",
      lambda c, m: (slice(0, c.shared_expert_intermediate_size),))
_rule(_L + r"\.mlp\.shared_expert\.up_proj\.weight", "layers.{l}.mlp.shared_expert.gate_up_proj",
      lambda c, m: (slice(c.shared_expert_intermediate_size, 2 * c.shared_expert_intermediate_size),))
_rule(_L + r"\.mlp\.shared_expert\.down_proj\.weight", "layers.{l}.mlp.shared_expert.down_proj")
_rule(_L + r"\.mlp\.shared_expert_gate\.weight", "layers.{l}.mlp.shared_expert_gate")
# Dense MLP layers (Qwen2-MoE's mlp_only_layers)
_rule(_L + r"\.mlp\.gate_proj\.weight", "layers.{l}.mlp.gate_up_proj",
      lambda c, m: (slice(0, c.dense_intermediate_size),))
_rule(_L + r"\.mlp\.up_proj\.weight", "layers.{l}.mlp.gate_up_proj",
      lambda c, m: (slice(c.dense_intermediate_size, 2 * c.dense_intermediate_size),))
_rule(_L + r"\.mlp\.down_proj\.weight", "layers.{l}.mlp.down_proj")
# gpt-oss: attention sinks, the router's logit bias, expert biases
_rule(_L + r"\.self_attn\.sinks", "layers.{l}.self_attn.sinks")
_rule(_L + r"\.mlp\.gate_bias", "layers.{l}.mlp.gate_bias")
_rule(_L + r"\.mlp\.experts\.gate_up_proj_bias", "layers.{l}.mlp.w13_bias")
_rule(_L + r"\.mlp\.experts\.down_proj_bias", "layers.{l}.mlp.w2_bias")
_rule(r"moekv:(?P<name>[\w.]+)", "{name}")  # an architecture's canonical_name gave the engine's own parameter name

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _resolve(name: str, cfg: ModelConfig) -> tuple[str, _Index] | None:
    for pattern, target, index in _RULES:
        m = pattern.match(name)
        if m:
            return target.format(**m.groupdict()), index(cfg, m)
    return None


DUMMY_STD = 0.02  # the usual initializer range of these architectures' configs


@dataclass
class Shard:
    """One rank's part of the model, for load_model: `cut(model)` cuts the modules down to it (run on
    the meta device, before anything is allocated); `plan(model)` says, for each parameter it cuts,
    by its name in the whole model, (dim, the indices kept along it, ascending): the checkpoint's
    tensors are read for those rows only (engine/parallel.py's shard_model, layers/parallel.py's shard_plan)."""

    cut: Callable[[MoEDecoder], None]
    plan: Callable[[MoEDecoder], dict[str, tuple[int, torch.Tensor]]]


def _meta_model(cfg: ModelConfig, dtype: torch.dtype) -> MoEDecoder:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return MoEDecoder(cfg)
    finally:
        torch.set_default_dtype(default)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                cut: Callable[[MoEDecoder], None] | None = None) -> MoEDecoder:
    """The modules with uninitialised parameters allocated once, in `dtype`, on `device`: built on
    the meta device first, so a model in bf16 never exists in fp32 (Mixtral-8x7B would need 187 GB).
    cut: a rank's Shard.cut, applied before anything is allocated."""
    model = _meta_model(cfg, dtype)
    for moe in moe_layers(model).values():  # the rank's cut may choose another (expert parallelism)
        moe.hooks.experts = local_experts(device)
    if cut is not None:
        cut(model)
    model = model.to_empty(device=device)
    install_routers(model, cfg)  # the checkpoint's own routing until the engine asks for another
    return model


def moe_layers(model: MoEDecoder) -> dict[int, SparseMoE]:
    """Layer index -> its SparseMoE, for the layers that have experts."""
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}


def install_routers(model: MoEDecoder, model_cfg: ModelConfig, routing: str = "auto", cluster_map=None,
                    clusters_per_token: int | None = None, admit_margin: float | None = None,
                    n_group: int | None = None, topk_group: int | None = None) -> str:
    """Give every MoE layer of a model the chosen router; returns the resolved mode.

    cluster_map: a ClusterMap or the path of one (checked against the model, layer by layer)."""
    mode = resolve_routing(routing, model_cfg)
    if mode not in ROUTING_MODES[1:]:
        raise ValueError(f"routing={routing!r} is unknown; accepted: {list(ROUTING_MODES)}")
    layers = moe_layers(model)
    if mode == "hierarchical":
        if model_cfg.router_logit_bias:
            raise ValueError(f"routing='hierarchical' reads router rows without a logit bias; {model_cfg.architecture}'s "
                             "router has one: accepted routing for it: 'auto', 'flat', 'group_limited'")
        if cluster_map is None:
            raise ValueError("routing='hierarchical' needs cluster_map (a file from `moekv cluster`)")
        source = "" if isinstance(cluster_map, ClusterMap) else str(cluster_map)
        cmap = cluster_map if isinstance(cluster_map, ClusterMap) else ClusterMap.load(cluster_map)
        cmap.check_model(model_cfg, {i: moe.gate for i, moe in layers.items()}, source=source)
        per_token = min(clusters_per_token or cmap.clusters_per_token or cmap.num_clusters, cmap.num_clusters)
        for i, moe in layers.items():
            margin = cmap.layers[i].admit_margin if admit_margin is None else admit_margin
            moe.hooks.router = HierarchicalRouter(cmap.layers[i], moe.gate, model_cfg.top_k, model_cfg.norm_topk_prob,
                                            per_token, margin, model_cfg.scoring_func, model_cfg.routed_scaling_factor)
        return mode
    for moe in layers.values():
        moe.hooks.router = (group_limited_router(model_cfg, n_group, topk_group) if mode == "group_limited"
                      else checkpoint_router(model_cfg))
    return mode


@torch.no_grad()
def init_dummy_weights(model: MoEDecoder, seed: int = 0) -> MoEDecoder:
    """Random weights (vLLM's load_format='dummy'): N(0, 0.02) for matrices, 1 for norms, 0 for
    biases; drawn on the model's device, so an 87 GiB model takes seconds, not a checkpoint."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, DUMMY_STD, generator=gen)
    return model.eval()


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               cfg: ModelConfig | None = None, load_format: str = "auto", shard: Shard | None = None,
               quantization: str | None = None, keep_quantized: bool | None = None) -> MoEDecoder:
    """The checkpoint's weights (load_format 'auto' / 'safetensors'), or random ones of its
    config.json's shape ('dummy': for benchmarks of a model whose weights are not on the machine).
    shard: one rank's part only (tensor / expert parallel): only its rows are read and allocated
    (with 'dummy', random weights of the part's shape: not the rows of a whole random model).
    quantization: 'fp8' / 'int4' quantize each 16-bit tensor of the weights quantize_model takes as
    it is read (models/quantize.py: the same result as quantizing the loaded model, without the 16-bit
    model ever on the device); ignored with a shard, 'dummy', or a pre-quantized checkpoint (whose
    own layout is read: models/prequantized.py). keep_quantized: whether an architecture that reads its
    own quantized layout (READS_QUANTIZATION: gpt-oss's MXFP4 experts) keeps it quantized (on one rank,
    without `quantization`) or dequantizes it; None: keep it on CUDA, where the fused kernels read it."""
    model_dir = Path(model_dir)
    cfg = cfg or load_model_config(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; accepted: {list(LOAD_FORMATS)}")
    cut = None if shard is None else shard.cut
    if load_format == "dummy":
        return init_dummy_weights(empty_model(cfg, dtype, device, cut))
    keep, full_shapes = {}, {}
    if shard is not None:
        whole = _meta_model(cfg, dtype)
        keep = shard.plan(whole)
        full_shapes = {name: tuple(p.shape) for name, p in whole.named_parameters()}
    arch = ARCH_MODULES[cfg.architecture]
    files = safetensors_files(model_dir)
    # an architecture that reads its checkpoint's own quantized layout (gpt-oss: MXFP4 experts, by its
    # TensorReader) declares it in READS_QUANTIZATION; any other layout goes through prequantized.py.
    # On one CUDA device without quantize-on-load its quantized experts stay quantized (the fused
    # kernels read them); elsewhere the reader dequantizes them
    hf = read_json(model_dir / "config.json", "config.json")
    own = (hf.get("quantization_config") or {}).get("quant_method") in getattr(arch, "READS_QUANTIZATION", ())
    if keep_quantized is None:
        keep_quantized = torch.device(device).type == "cuda"
    keep_own = own and keep_quantized and shard is None and quantization is None
    scheme = None if own else checkpoint_quantization(hf)
    targets = _quantized_targets(files, arch, cfg, scheme)
    if targets and shard is not None:
        raise CheckpointError(f"{model_dir} holds pre-quantized weights, which load on one rank only "
                              "(tensor_parallel_size=1)")
    on_load: set[str] = set()
    if keep_own:
        targets = set()
        cut = lambda m: targets.update(arch.install_mxfp4_experts(m))  # noqa: E731
    elif targets:
        cut = lambda m: install_placeholders(m, targets, scheme, dtype)  # noqa: E731
    elif quantization is not None and shard is None:
        cut = lambda m: install_empty_quantized(m, quantization, dtype)  # noqa: E731
    model = empty_model(cfg, dtype, device, cut)  # every parameter is filled below, or the load fails
    if cut is not None and not targets and shard is None:
        on_load = {name for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    params = dict(model.named_parameters())
    quantized = {name: model.get_submodule(name) for name in targets | on_load}
    parts_seen: dict[tuple[str, str], int] = {}
    for name, (dim, kept) in keep.items():
        if params[name].shape[dim] != len(kept):
            raise RuntimeError(f"the shard plan keeps {len(kept)} rows of {name} along dim {dim}; the cut "
                               f"model holds {params[name].shape[dim]}")
    filled: dict[str, int] = {name: 0 for name in params}
    # an architecture whose tensors need more than a rename (gpt-oss: transposed experts, MXFP4 pairs)
    reader = ((arch.TensorReader(dtype, keep_mxfp4=True) if keep_own else arch.TensorReader(dtype))
              if hasattr(arch, "TensorReader") else None)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"cannot read {path}: {e}") from e
        with handle as f:
            for raw_name in f.keys():
                if _IGNORED.match(raw_name) or getattr(arch, "ignored_tensor", lambda *_: False)(raw_name, cfg):
                    continue
                tensor = None
                if reader is not None:
                    read = reader.read(raw_name, f)
                    if read is None:  # half of a pair, kept until the other half comes
                        continue
                    raw_name, tensor = read
                weight_name, part = split_name(raw_name, scheme)
                name = arch.canonical_name(weight_name)
                resolved = _resolve(name, cfg)
                if resolved is not None and resolved[0] in on_load:  # 16-bit, quantized as it is read
                    _quantize_into(quantized[resolved[0]], resolved[1],
                                   f.get_tensor(raw_name) if tensor is None else tensor, dtype, raw_name, path)
                    for part in ("codes", "scales", "zeros"):
                        parts_seen[(resolved[0], part)] = parts_seen.get((resolved[0], part), 0) + 1
                    continue
                if isinstance(tensor, QuantizedWeight):  # a quantized weight the reader assembled (MXFP4)
                    if resolved is None or resolved[0] not in quantized:
                        raise CheckpointError(f"{path.name}: {raw_name!r} is quantized ({tensor.method}) where "
                                              f"the model keeps a 16-bit weight")
                    _copy_quantized(quantized[resolved[0]], resolved[1], tensor, raw_name, path)
                    for part in ("codes", "scales"):
                        parts_seen[(resolved[0], part)] = parts_seen.get((resolved[0], part), 0) + 1
                    continue
                if resolved is not None and resolved[0] in quantized:  # a part of a pre-quantized weight
                    part = part or "codes"
                    copy_part(quantized[resolved[0]], resolved[1], part,
                              f.get_tensor(raw_name) if tensor is None else tensor, raw_name, scheme)
                    parts_seen[(resolved[0], part)] = parts_seen.get((resolved[0], part), 0) + 1
                    continue
                if part is not None:
                    raise CheckpointError(f"{path.name}: {raw_name!r} is a quantized part of a weight moekv "
                                          "does not read quantized")
                if resolved is None or resolved[0] not in params:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store the head
                    raise CheckpointError(f"{path.name}: tensor {raw_name!r} does not belong to a "
                                          f"{cfg.architecture} with this config.json")
                target, index = resolved
                if target in keep:
                    if tensor is not None:
                        raise CheckpointError(f"{path.name}: {raw_name!r} is transformed on load, which a "
                                              f"sharded (tensor / expert parallel) load does not support")
                    filled[target] += _copy_kept(params[target], index, keep[target], full_shapes[target], f,
                                                 raw_name, path)
                else:
                    _copy_into(params[target], index, f.get_tensor(raw_name) if tensor is None else tensor,
                               raw_name, path)
                    filled[target] += 1
    if reader is not None:
        try:
            reader.finish()
        except ValueError as e:
            raise CheckpointError(f"{model_dir}: {e}") from e
    missing = [name for name, count in filled.items() if count == 0]
    for name, qw in quantized.items():
        needed = ("codes", "scales") + (("zeros",) if qw.zeros is not None else ())
        if scheme is not None and scheme.desc_act:  # act-order GPTQ: each g_idx is checked trivial
            needed += ("g_idx",)
        missing += [f"{name} ({part})" for part in needed if (name, part) not in parts_seen]
    if missing:
        raise CheckpointError(f"{model_dir}: no weights found for {len(missing)} parameters, e.g. {missing[:5]}")
    model.eval()
    return model


def _quantized_targets(files: list[Path], arch: ModuleType, cfg: ModelConfig,
                       scheme: CheckpointQuantization | None) -> set[str]:
    """The model parameters a pre-quantized checkpoint stores quantized: those with a scale tensor
    (models/prequantized.py). Reads tensor names only."""
    if scheme is None:
        return set()
    targets = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for raw_name in f.keys():
                weight_name, part = split_name(raw_name, scheme)
                if part in ("scales", "codes"):
                    check_not_ignored(raw_name, scheme)
                    resolved = _resolve(arch.canonical_name(weight_name), cfg)
                    if resolved is None:
                        raise CheckpointError(f"{path.name}: tensor {raw_name!r} does not belong to a "
                                              f"{cfg.architecture} with this config.json")
                    targets.add(resolved[0])
    return targets


@torch.no_grad()
def _copy_kept(param: torch.Tensor, index: _Index, kept: tuple[int, torch.Tensor], full_shape: tuple[int, ...],
               f, name: str, path: Path) -> bool:
    """Copy the rows of checkpoint tensor `name` (the region `index` of the whole parameter) that a
    shard keeps (kept: (dim of the whole parameter, indices)) into the cut parameter; read only
    those rows when they are one contiguous run, and nothing when none is kept. True if it copied."""
    dim, rows = kept
    region = tuple(torch.empty(full_shape, device="meta")[index].shape) if index else full_shape
    dest = list(index)
    src_dim = dim - sum(isinstance(i, int) for i in index[:dim])  # ints drop their dimension
    if dim < len(index) and isinstance(index[dim], int):  # the tensor is one row of dim: kept or not
        hit = torch.nonzero(rows == index[dim]).flatten()
        if not len(hit):
            return False
        dest[dim] = int(hit[0])
        _copy_into(param, tuple(dest), f.get_tensor(name), name, path)
        return True
    if dim < len(index):  # the tensor fills rows start..stop of dim
        start, stop = index[dim].start or 0, index[dim].stop
        inside = (rows >= start) & (rows < stop)
        if not inside.any():
            return False
        first = int(torch.nonzero(inside).flatten()[0])
        src = rows[inside] - start
        dest[dim] = slice(first, first + len(src))
    else:  # the tensor spans dim whole
        src = rows
    stored = f.get_slice(name)
    shape = tuple(stored.get_shape())
    if shape == region and int(src[-1]) - int(src[0]) + 1 == len(src):  # one run: read just it
        window = [slice(None)] * len(shape)
        window[src_dim] = slice(int(src[0]), int(src[-1]) + 1)
        tensor = stored[tuple(window)]
    else:
        tensor = f.get_tensor(name)
        if shape != region and len(shape) == 3 and shape == region[:1] + region[1:][::-1]:
            tensor = tensor.transpose(1, 2)  # stacked experts saved as [E, in, out]
        if tuple(tensor.shape) != region:
            raise CheckpointError(f"{path.name}: tensor {name!r} has shape {shape}, config.json implies {region}")
        tensor = tensor.index_select(src_dim, src)
    _copy_into(param, tuple(dest), tensor, name, path)
    return True


@torch.no_grad()
def _quantize_into(qw: QuantizedWeight, index: _Index, tensor: torch.Tensor, dtype: torch.dtype, name: str,
                   path: Path) -> None:
    """Quantize a 16-bit checkpoint tensor (the region `index` of the whole weight: rows, or one
    expert) into a QuantizedWeight of quantize-on-load's layout: rows and groups along K are
    quantized independently, so each region gets what quantizing the whole weight gives it."""
    region = tuple(torch.empty(qw.shape, device="meta")[index].shape) if index else tuple(qw.shape)
    if tuple(tensor.shape) != region and len(region) == 3 and tuple(tensor.shape) == region[:1] + region[1:][::-1]:
        tensor = tensor.transpose(1, 2)  # stacked experts saved as [E, in, out]
    if tuple(tensor.shape) != region:
        raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                              f"config.json implies {region}")
    tensor = tensor.to(device=qw.device, dtype=dtype)  # rounded to the model's dtype first, as a loaded weight is
    part = quantize_stacked(tensor, qw.method) if tensor.dim() == 3 else quantize(tensor, qw.method)
    for buffer in ("codes", "scales", "zeros"):
        dest = getattr(qw, buffer)
        if dest is not None:
            (dest[index] if index else dest).copy_(getattr(part, buffer))


@torch.no_grad()
def _copy_quantized(qw: QuantizedWeight, index: _Index, part: QuantizedWeight, name: str, path: Path) -> None:
    """A whole quantized tensor of the checkpoint (the region `index` of qw: all of it, or one
    expert) into the model's QuantizedWeight of the same kind."""
    dest = qw[index[0]] if index else qw
    if len(index) > 1 or part.method != dest.method or tuple(part.shape) != tuple(dest.shape):
        raise CheckpointError(f"{path.name}: {name!r} is {part.method} {tuple(part.shape)}, the model's "
                              f"{qw.method} weight needs {tuple(dest.shape)} there")
    for buffer in ("codes", "scales"):
        getattr(dest, buffer).copy_(getattr(part, buffer))


@torch.no_grad()
def _copy_into(param: torch.Tensor, index: _Index, tensor: torch.Tensor, name: str, path: Path) -> None:
    dest = param[index] if index else param
    if dest.shape != tensor.shape and dest.dim() == 3 and dest.shape == tensor.shape[:1] + tensor.shape[1:][::-1]:
        tensor = tensor.transpose(1, 2)  # stacked experts saved as [E, in, out]
    if dest.shape != tensor.shape:
        raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                              f"config.json implies {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))
