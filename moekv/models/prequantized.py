"""Pre-quantized Hugging Face checkpoints: which layout config.json's `quantization_config` names,
and how its tensors fill the model's QuantizedWeights (ops/quantized_weight.py). Every layout maps
onto the two kinds the kernels read, fp8 (per-channel or 128x128-block scales) and int4 groups
(moekv's nibble order, [N, K / 8] codes, [N, K / G] scales and zero points), on load: the tensors
are converted as they are read and nothing else changes.

Accepted layouts (N = output features, K = input features, G = group size):
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (DeepSeek-V3, the Qwen3 `-FP8` releases):
  `<module>.weight` float8_e4m3fn [N, K] and `<module>.weight_scale_inv` fp32
  [ceil(N / 128), ceil(K / 128)], the weight being weight * weight_scale_inv per block (the name is
  historical: it multiplies).
- `quant_method: "compressed-tensors"`, `format: "pack-quantized"`, 4-bit int weights with
  `strategy: "group"` (llm-compressor's W4A16): `<module>.weight_packed` int32 [N, K / 8] (8 features
  per word, lowest nibble first, each the signed value + 8), `weight_scale` [N, K / G], with
  `symmetric: false` also `weight_zero_point` int32 [ceil(N / 8), K / G] (8 rows per word, packed
  along N the same way, signed + 8), the weight being (q - zero) * scale; `weight_shape` is checked.
- `quant_method: "compressed-tensors"`, `format: "float-quantized"`, 8-bit float weights
  (llm-compressor's FP8 / W8A8-FP8, FP8_DYNAMIC): `<module>.weight` float8_e4m3fn [N, K] and
  `weight_scale` [N, 1] (`strategy: "channel"`), one value ([1] or [], `"tensor"`: spread over the
  module's rows, so fused q/k/v and gate/up parts keep their own) or [ceil(N / 128), ceil(K / 128)]
  (`"block"`, `block_structure: [128, 128]`). Input activations dynamic fp8 per token or none: moekv
  runs these checkpoints weight-only (16-bit activations); static activation scales are refused.
- `quant_method: "awq"`, `version: "gemm"`, 4 bits with zero points (AutoAWQ): `<module>.qweight` int32
  [K, N / 8], eight output features per word in AWQ's order (nibble i of word j holds feature
  8j + AWQ_ORDER[i]), `qzeros` int32 [K / G, N / 8] packed alike, `scales` fp16 [K / G, N]; the
  weight is (q - zero) * scale. Unpacked, reordered and transposed to moekv's [N, K / 8] on load.
- `quant_method: "gptq"`, 4 bits (AutoGPTQ / GPTQModel): `<module>.qweight` int32 [K / 8, N] (input
  feature 8j + i in nibble i of word j: moekv's order along K, so transposed as stored), `qzeros` int32
  [K / G, N / 8] (output feature 8j + i in nibble i), `scales` fp16 [K / G, N], `g_idx` int32 [K];
  `checkpoint_format: "gptq"` stores each zero point minus one (read back + 1, as GPTQ's kernels do),
  `"gptq_v2"` as it is. `sym: true` needs every zero point 8 and loads as symmetric int4 (no zero
  points stored); `sym: false` keeps them. `desc_act: true` is read only where every `g_idx` is
  trivial (g_idx[k] = k // G, as with static groups): a permuted g_idx would need the activations
  permuted per module, which the kernels do not do, so it is refused by name.
AWQ and GPTQ groups (and compressed-tensors') may be any multiple of 8 features: the kernels take any
(1, G) scale block. AWQ / GPTQ scales stay fp16 for a 16-bit model (bf16 would round them).

Which modules are quantized is read from the tensors present (a module with a scale tensor beside
its weight): the experts, attention projections and LM head take QuantizedWeights; anything else a
checkpoint quantized (a router, a dense MLP, a shared expert) is refused by name. The config's lists
of modules left alone (compressed-tensors' `ignore`, AWQ's `modules_to_not_convert`, GPTQ's
`lm_head: false`) must agree: a module they name that holds quantized tensors is refused. The fused
qkv and w13 matrices need all their parts quantized alike, and with 128-row fp8 blocks, parts that
start on a block row. Pre-quantized checkpoints load on one rank (tensor parallelism refuses them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moekv.ops.quantized_weight import INT4_SYMMETRIC_ZERO, QuantizedWeight, unpack_int4

ACCEPTED = (
    "fp8 with weight_block_size [128, 128]",
    "compressed-tensors pack-quantized 4-bit int groups (group_size a multiple of 8)",
    "compressed-tensors float-quantized 8-bit float weights, strategy channel, tensor or block [128, 128], "
    "input activations dynamic or none (run weight-only)",
    "awq bits 4, version gemm, zero_point true, group_size a multiple of 8",
    "gptq bits 4, group_size a multiple of 8, checkpoint_format gptq or gptq_v2, desc_act false "
    "(or true with trivial g_idx)",
)
QUANTIZABLE = re.compile(r"^(layers\.\d+\.self_attn\.(qkv_proj|o_proj)|layers\.\d+\.mlp\.(w13|w2)|lm_head)$")
# AutoAWQ's GEMM packing: nibble i of a word holds output feature 8j + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNORDER = tuple(AWQ_ORDER.index(m) for m in range(8))  # feature 8j + m is in nibble _AWQ_UNORDER[m]

# each layout's tensors beside (or instead of) a quantized module's weight: suffix -> part
_SUFFIXES = {
    "fp8-block": {"weight_scale_inv": "scales"},
    "ct-int4": {"weight_packed": "codes", "weight_scale": "scales", "weight_zero_point": "zeros",
                "weight_shape": "shape"},
    "ct-fp8": {"weight_scale": "scales"},
    "awq": {"qweight": "codes", "qzeros": "zeros", "scales": "scales"},
    "gptq": {"qweight": "codes", "qzeros": "zeros", "scales": "scales", "g_idx": "g_idx"},
}


class QuantizationConfigError(ValueError):
    """config.json's quantization_config names a layout moekv does not read (names the accepted ones)."""


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "fp8" | "int4": the QuantizedWeight kind it loads as
    scale_block: tuple[int, int] | None  # fp8's (SN, SK); None: per output channel (fp8) or int4 groups
    group_size: int | None = None
    zero_point: bool = False  # int4 zero points stored in the QuantizedWeight
    layout: str = "fp8-block"  # a key of _SUFFIXES
    zero_offset: int = 0  # GPTQ's v1 checkpoints store each zero point minus one
    desc_act: bool = False
    ignore: tuple[str, ...] = field(default=())  # modules the config leaves unquantized (its own syntax)

    def block(self, K: int) -> tuple[int, int]:
        if self.scale_block is not None:
            return self.scale_block
        return (1, self.group_size) if self.method == "int4" else (1, K)

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """int4 scales' dtype for a model in dtype: AWQ / GPTQ store fp16 scales, kept exact."""
        if dtype not in (torch.bfloat16, torch.float16):
            return torch.float32
        return torch.float16 if self.layout in ("awq", "gptq") else dtype

    def ignores(self, module: str) -> bool:
        """Whether the config's list of unquantized modules names checkpoint module `module`."""
        for entry in self.ignore:
            if self.layout in ("ct-int4", "ct-fp8"):  # names, or "re:" regexes matched from the start
                hit = re.match(entry[3:], module) is not None if entry.startswith("re:") else entry == module
            else:  # transformers' rule: a pattern from the start up to a module boundary, or a suffix
                hit = re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", module) is not None or module.endswith(entry)
            if hit:
                return True
        return False


def _refuse(qc: dict, why: str) -> QuantizationConfigError:
    return QuantizationConfigError(f"quantization_config {qc!r} is not supported: {why}; accepted: {list(ACCEPTED)}")


def _group_size(qc: dict, group: Any) -> int:
    if not isinstance(group, int) or isinstance(group, bool) or group < 8 or group % 8:
        raise _refuse(qc, f"group_size {group!r} (a multiple of 8; per-channel -1 is not read)")
    return group


def _compressed_tensors(qc: dict) -> CheckpointQuantization:
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "float-quantized"):
        raise _refuse(qc, f"compressed-tensors format {fmt!r}")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(qc, f"{len(groups)} config_groups (one scheme for every quantized module is read)")
    w = groups[0].get("weights") or {}
    acts = groups[0].get("input_activations")
    ignore = tuple(qc.get("ignore") or ())
    if fmt == "pack-quantized":
        if acts is not None:
            raise _refuse(qc, "quantized input activations (only weight-only W4A16 is read)")
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group") or w.get("actorder"):
            raise _refuse(qc, f"weights {w!r} (4-bit int, strategy 'group', no actorder)")
        return CheckpointQuantization("int4", None, _group_size(qc, w.get("group_size")),
                                      not w.get("symmetric", True), "ct-int4", ignore=ignore)
    if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("dynamic"):
        raise _refuse(qc, f"weights {w!r} (8-bit float, static)")
    if acts is not None and not (acts.get("dynamic") and (acts.get("num_bits"), acts.get("type")) == (8, "float")):
        raise _refuse(qc, f"input_activations {acts!r} (dynamic fp8 or none: moekv runs the weights alone)")
    strategy = w.get("strategy")
    if strategy in ("channel", "tensor"):
        return CheckpointQuantization("fp8", None, layout="ct-fp8", ignore=ignore)
    if strategy == "block" and list(w.get("block_structure") or ()) == [128, 128]:
        return CheckpointQuantization("fp8", (128, 128), layout="ct-fp8", ignore=ignore)
    raise _refuse(qc, f"fp8 weights strategy {strategy!r} with block_structure {w.get('block_structure')!r}")


def _awq(qc: dict) -> CheckpointQuantization:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(qc, f"awq bits {bits!r}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(qc, f"awq version {version!r} (its packing differs from GEMM's)")
    if not qc.get("zero_point", True):
        raise _refuse(qc, "awq zero_point false")
    group = _group_size(qc, qc.get("group_size", qc.get("q_group_size")))
    return CheckpointQuantization("int4", None, group, True, "awq",
                                  ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict) -> CheckpointQuantization:
    if qc.get("bits") != 4:
        raise _refuse(qc, f"gptq bits {qc.get('bits')!r}")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(qc, f"gptq checkpoint_format {fmt!r}")
    if qc.get("dynamic"):
        raise _refuse(qc, "gptq per-module overrides ('dynamic')")
    group = _group_size(qc, qc.get("group_size"))
    sym = qc.get("sym", True)
    return CheckpointQuantization("int4", None, group, not sym, "gptq", zero_offset=1 if fmt == "gptq" else 0,
                                  desc_act=bool(qc.get("desc_act")),
                                  ignore=() if qc.get("lm_head") else ("lm_head",))


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
        return CheckpointQuantization("fp8", (128, 128), ignore=tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    raise _refuse(qc, f"quant_method {method!r}")


def split_name(raw_name: str, scheme: CheckpointQuantization | None) -> tuple[str, str | None]:
    """A checkpoint tensor name -> (the name of the weight it belongs to, its part: 'codes',
    'scales', 'zeros', 'shape', 'g_idx'; None for a plain tensor). An fp8 checkpoint's
    `<module>.weight` is 'codes' only when the module is quantized: load_model decides that."""
    if scheme is None:
        return raw_name, None
    module, _, suffix = raw_name.rpartition(".")
    part = _SUFFIXES[scheme.layout].get(suffix)
    if part is None or not module:
        return raw_name, None
    return module + ".weight", part


def check_not_ignored(raw_name: str, scheme: CheckpointQuantization) -> None:
    """A quantized part of a module that the config's list of unquantized modules names: refused."""
    module = split_name(raw_name, scheme)[0].removesuffix(".weight")
    if scheme.ignores(module):
        raise QuantizationConfigError(f"{raw_name} is quantized, but quantization_config leaves {module} "
                                      f"unquantized ({list(scheme.ignore)})")


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
        qw = placeholder(scheme, tuple(param.shape), scheme.scale_dtype(dtype))
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


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> its little-endian bytes uint8 [..., W, 4]: byte b holds nibbles 2b (low) and 2b + 1."""
    return words.contiguous().view(torch.uint8).reshape(*words.shape, 4)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's GEMM packing, int32 [R, N / 8] (feature 8j + AWQ_ORDER[i] in nibble i) -> uint8 codes [R, N].
    Byte-wise (uint8 ops, no int64 intermediate): ~7x faster than unpacking every nibble by shifts."""
    b = _bytes(packed)
    lo, hi = b & 0xF, b >> 4  # nibbles 0, 2, 4, 6 and 1, 3, 5, 7
    nibble = lambda i: (lo if i % 2 == 0 else hi)[..., i // 2]  # noqa: E731
    return torch.stack([nibble(i) for i in _AWQ_UNORDER], dim=-1).reshape(*packed.shape[:-1], -1)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (0..15) -> int32 [..., K / 8], feature 8j + i in nibble i (pack_int4's
    order, built from bytes)."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)


def _int32(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype != torch.int32:
        raise QuantizationConfigError(f"{name} holds {tensor.dtype}; this layout packs int32 words")
    return tensor


def _check_g_idx(g_idx: torch.Tensor, qw: QuantizedWeight, scheme: CheckpointQuantization, name: str) -> None:
    """GPTQ's g_idx [K] (the group of each input feature) must be k // G: the kernels read groups of
    G consecutive features. desc_act's permuted groups would need the activations permuted per module."""
    K = qw.shape[-1]
    trivial = torch.arange(K, device=g_idx.device) // scheme.group_size
    if tuple(g_idx.shape) != (K,) or not torch.equal(g_idx.long(), trivial):
        why = ("desc_act (act-order) groups permuted by g_idx" if scheme.desc_act
               else "g_idx that is not k // group_size although desc_act is false")
        raise QuantizationConfigError(f"{name}: {why}; moekv reads GPTQ groups of consecutive input features "
                                      f"only (g_idx[k] = k // {scheme.group_size}, as desc_act false or static "
                                      "groups store)")


def to_moekv_layout(scheme: CheckpointQuantization | None, part: str, tensor: torch.Tensor,
                    dest: torch.Tensor | None, qw: QuantizedWeight, name: str) -> torch.Tensor | None:
    """One checkpoint tensor of a quantized module -> the part in QuantizedWeight's layout (codes
    [N, K / 8] or [N, K], scales and zeros [N, K / G]); None where nothing is stored (a checked g_idx,
    GPTQ's symmetric zero points)."""
    layout = scheme.layout if scheme is not None else None
    if layout in ("awq", "gptq"):
        if part == "g_idx":
            _check_g_idx(tensor, qw, scheme, name)
            return None
        if part == "scales":
            return tensor.transpose(-1, -2)
        if part == "codes":
            tensor = _int32(tensor, name)
            # AWQ packs along N (in its order), GPTQ along K (in moekv's): both [N, K / 8] after this
            return _pack_rows(unpack_awq(tensor).transpose(-1, -2)) if layout == "awq" else tensor.transpose(-1, -2)
        if part == "zeros":
            tensor = _int32(tensor, name)
            codes = unpack_awq(tensor) if layout == "awq" else unpack_int4(tensor)
            zeros = (codes.to(torch.int16) + scheme.zero_offset).transpose(-1, -2)  # [N, K / G]
            if qw.zeros is None:  # GPTQ sym: every zero point is the implicit 8
                if not bool((zeros == INT4_SYMMETRIC_ZERO).all()):
                    raise QuantizationConfigError(f"{name}: zero points other than {INT4_SYMMETRIC_ZERO} in a "
                                                  "checkpoint whose quantization_config says sym true")
                return None
            return zeros
    if layout == "ct-fp8" and part == "scales" and scheme.scale_block is None and tensor.numel() == 1:
        return tensor.reshape(1, 1).expand(dest.shape)  # per tensor: one scale for each of its rows
    if part == "zeros" and tensor.dtype == torch.int32 and dest is not None:  # compressed-tensors, 8 rows a word
        return _unpack_rows(tensor, dest.shape[-2])
    return tensor


@torch.no_grad()
def copy_part(qw: QuantizedWeight, index: tuple, part: str, tensor: torch.Tensor, name: str,
              scheme: CheckpointQuantization | None = None) -> None:
    """Copy one checkpoint tensor (a part of a quantized module, in the scheme's layout) into the
    region `index` (rows of the fused parameter, as the loader's rules give it) of a QuantizedWeight."""
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
    elif part == "zeros" and qw.zeros is not None:
        dest = qw.zeros[index] if index else qw.zeros
    elif part == "zeros" and (scheme is None or scheme.layout != "gptq"):
        raise QuantizationConfigError(f"{name}: zero points in a checkpoint whose quantization_config says "
                                      "symmetric")
    else:
        dest = None
    stored = tuple(tensor.shape)
    if dest is not None:  # converted where it is stored (the unpacking is faster on a GPU)
        tensor = tensor.to(dest.device)
    tensor = to_moekv_layout(scheme, part, tensor, dest, qw, name)
    if tensor is None:
        return
    if part == "codes" and tensor.dtype != dest.dtype:
        raise QuantizationConfigError(f"{name} holds {tensor.dtype}; this layout stores {dest.dtype} codes")
    if tuple(tensor.shape) != tuple(dest.shape):
        how = "" if stored == tuple(tensor.shape) else f" (stored {stored})"
        raise QuantizationConfigError(f"{name} has shape {tuple(tensor.shape)}{how} in moekv's layout, the model "
                                      f"implies {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))
