"""Pre-quantized Hugging Face checkpoints: which layout config.json's `quantization_config` names,
and how its tensors fill the model's QuantizedWeights (ops/quantized_weight.py).

Accepted layouts:
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (DeepSeek-V3, the Qwen3 `-FP8` releases):
  `<module>.weight` float8_e4m3fn [N, K] and `<module>.weight_scale_inv` fp32
  [ceil(N / 128), ceil(K / 128)], the weight being weight * weight_scale_inv per block (the name is
  historical: it multiplies).
- `quant_method: "compressed-tensors"`, `format: "pack-quantized"`, 4-bit int weights with
  `strategy: "group"` (llm-compressor's W4A16): `<module>.weight_packed` int32 [N, K / 8] (8 features
  per word, lowest nibble first, each the signed value + 8), `weight_scale` [N, K / G], with
  `symmetric: false` also `weight_zero_point` int32 [ceil(N / 8), K / G] (8 rows per word, packed
  along N the same way, signed + 8), the weight being (q - zero) * scale; `weight_shape` is checked.

Which modules are quantized is read from the tensors present (a module with a scale tensor beside
its weight): the experts, attention projections and LM head take QuantizedWeights; anything else a
checkpoint quantized (a dense MLP, a shared expert) is refused by name. The fused qkv and w13
matrices need all their parts quantized alike, and with 128-row fp8 blocks, parts that start on a
block row. Pre-quantized checkpoints load on one rank (tensor parallelism refuses them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moekv.ops.quantized_weight import QuantizedWeight, unpack_int4

ACCEPTED = ("fp8 with weight_block_size [128, 128]", "compressed-tensors pack-quantized 4-bit int groups")
# the tensors a quantized module stores beside (or instead of) its weight: suffix -> part
_PARTS = {"weight_scale_inv": "scales", "weight_packed": "codes", "weight_scale": "scales",
          "weight_zero_point": "zeros", "weight_shape": "shape"}
_SUFFIX = re.compile(r"^(?P<module>.*)\.(?P<suffix>weight_scale_inv|weight_packed|weight_scale|weight_zero_point|"
                     r"weight_shape)$")
QUANTIZABLE = re.compile(r"^(layers\.\d+\.self_attn\.(qkv_proj|o_proj)|layers\.\d+\.mlp\.(w13|w2)|lm_head)$")


class QuantizationConfigError(ValueError):
    """config.json's quantization_config names a layout moekv does not read (names the accepted ones)."""


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "fp8" | "int4"
    scale_block: tuple[int, int] | None  # fp8's (SN, SK); None: int4 groups (SK = group_size)
    group_size: int | None = None
    zero_point: bool = False

    def block(self, K: int) -> tuple[int, int]:
        return self.scale_block if self.scale_block is not None else (1, self.group_size)


def _refuse(qc: dict, why: str) -> QuantizationConfigError:
    return QuantizationConfigError(f"quantization_config {qc!r} is not supported: {why}; accepted: {list(ACCEPTED)}")


def checkpoint_quantization(hf: dict[str, Any]) -> CheckpointQuantization | None:
    """The layout config.json's quantization_config names, None if it has none."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationConfigError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise _refuse(qc, f"fp8 weight_block_size {block!r} (per-tensor fp8 scales are not read)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(qc, f"fp8 fmt {qc.get('fmt')!r}")
        return CheckpointQuantization("fp8", (128, 128))
    if method == "compressed-tensors":
        if qc.get("format") != "pack-quantized":
            raise _refuse(qc, f"compressed-tensors format {qc.get('format')!r}")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise _refuse(qc, f"{len(groups)} config_groups (one scheme for every quantized module is read)")
        w = groups[0].get("weights") or {}
        if groups[0].get("input_activations") is not None:
            raise _refuse(qc, "quantized input activations (only weight-only W4A16 is read)")
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group") or w.get("actorder"):
            raise _refuse(qc, f"weights {w!r} (4-bit int, strategy 'group', no actorder)")
        group = w.get("group_size")
        if not isinstance(group, int) or group < 8 or group % 8:
            raise _refuse(qc, f"group_size {group!r} (a multiple of 8)")
        return CheckpointQuantization("int4", None, group, not w.get("symmetric", True))
    raise _refuse(qc, f"quant_method {method!r}")


def split_name(raw_name: str, scheme: CheckpointQuantization | None) -> tuple[str, str | None]:
    """A checkpoint tensor name -> (the name of the weight it belongs to, its part: 'codes',
    'scales', 'zeros', 'shape'; None for a plain tensor). An fp8 checkpoint's `<module>.weight` is
    'codes' only when the module is quantized: load_model decides that (quantized_modules)."""
    m = _SUFFIX.match(raw_name) if scheme is not None else None
    if m is None:
        return raw_name, None
    return m["module"] + ".weight", _PARTS[m["suffix"]]


def placeholder(scheme: CheckpointQuantization, shape: tuple[int, ...], scale_dtype: torch.dtype) -> QuantizedWeight:
    """An empty QuantizedWeight of the checkpoint's layout for a [*batch, N, K] weight (meta tensors
    until the model is allocated)."""
    *batch, N, K = shape
    SN, SK = scheme.block(K)
    scale_shape = (*batch, -(-N // SN), -(-K // SK))
    meta = dict(device="meta")
    if scheme.method == "fp8":
        codes = torch.empty(*shape, dtype=torch.float8_e4m3fn, **meta)
        return QuantizedWeight("fp8", shape, codes, torch.empty(scale_shape, dtype=torch.float32, **meta), (SN, SK))
    codes = torch.empty(*batch, N, K // 8, dtype=torch.int32, **meta)
    zeros = torch.empty(scale_shape, dtype=scale_dtype, **meta) if scheme.zero_point else None
    return QuantizedWeight("int4", shape, codes, torch.empty(scale_shape, dtype=scale_dtype, **meta), (SN, SK), zeros)


def install_placeholders(model: nn.Module, targets: set[str], scheme: CheckpointQuantization,
                         dtype: torch.dtype) -> dict[str, QuantizedWeight]:
    """Replace each target parameter (by name, e.g. 'layers.0.mlp.w13') of a meta model with an
    empty QuantizedWeight of the same logical shape; returns them by name."""
    out = {}
    for name in sorted(targets):
        if not QUANTIZABLE.match(name):
            raise QuantizationConfigError(f"the checkpoint quantizes {name}; moekv reads quantized experts, "
                                          "attention projections and LM head only")
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        param = getattr(owner, attr)
        qw = placeholder(scheme, tuple(param.shape), dtype if dtype in (torch.bfloat16, torch.float16)
                         else torch.float32)
        owner._parameters.pop(attr)
        setattr(owner, attr, qw)
        out[name] = qw
    return out


def _rows(index: tuple, block_rows: int, what: str) -> tuple:
    """A parameter index (ints and one row slice) -> the index of its scale rows (blocks of block_rows)."""
    out = []
    for i, part in enumerate(index):
        if isinstance(part, slice) and i == len(index) - 1:
            start, stop = part.start or 0, part.stop
            if start % block_rows:
                raise QuantizationConfigError(f"{what} starts at row {start} of its fused matrix, inside a "
                                              f"{block_rows}-row scale block")
            part = slice(start // block_rows, -(-stop // block_rows))
        out.append(part)
    return tuple(out)


def _unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """compressed-tensors' zero points, packed 8 rows per int32 along dim 0 -> unsigned codes [rows, G]."""
    return unpack_int4(packed.T.contiguous()).T[:rows]


@torch.no_grad()
def copy_part(qw: QuantizedWeight, index: tuple, part: str, tensor: torch.Tensor, name: str) -> None:
    """Copy one checkpoint tensor (a part of a quantized module) into the region `index` (rows of
    the fused parameter, as the loader's rules give it) of a QuantizedWeight."""
    SN, _ = qw.scale_block
    if part == "shape":
        region = torch.empty(qw.shape, device="meta")[index] if index else torch.empty(qw.shape, device="meta")
        if tuple(tensor.tolist()) != tuple(region.shape):
            raise QuantizationConfigError(f"{name} says {tuple(tensor.tolist())}; the model implies "
                                          f"{tuple(region.shape)}")
        return
    if part == "codes":
        dest = qw.codes[index] if index else qw.codes
    elif part == "scales":
        dest = qw.scales[_rows(index, SN, name)] if index else qw.scales
    else:
        if qw.zeros is None:
            raise QuantizationConfigError(f"{name}: zero points in a checkpoint whose quantization_config says "
                                          "symmetric")
        dest = qw.zeros[index] if index else qw.zeros
        tensor = _unpack_rows(tensor, dest.shape[-2]) if tensor.dtype == torch.int32 else tensor
    if part == "codes" and tensor.dtype != dest.dtype:
        raise QuantizationConfigError(f"{name} holds {tensor.dtype}; this layout stores {dest.dtype} codes")
    if tuple(tensor.shape) != tuple(dest.shape):
        raise QuantizationConfigError(f"{name} has shape {tuple(tensor.shape)}, the model implies "
                                      f"{tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))
