"""Registry of KV formats. A format is one file here: a spec (bytes per page, bits per element)
plus how it writes a step's K/V into pages and how attention reads them back.

Options reach a format as keyword arguments of its constructor, and only those: an option a format
does not take is an error naming the ones it does (kv_format_options), never silently ignored. The
decode kernel its pools are laid out for (decode_kernel: EngineConfig.decode_kernel) is not an
option: every format takes it, and the registry gives it to the format it builds."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from moekv import envs
from moekv.kvcache.formats.base import (
    GraphStepHooks,
    GraphSupport,
    KVFormat,
    LayerKVCache,
    PagedQuantFormat,
)
from moekv.kvcache.formats.names import DECODE_KERNELS, DEFAULT_DECODE_KERNEL, KV_FORMAT_NAMES, check_decode_kernel
from moekv.kvcache.formats.plain import PlainKVFormat

# plain formats, by the dtype they store ("auto": the model's); they take no options
_PLAIN: dict[str, torch.dtype | None] = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                         "fp32": torch.float32}
# compressed formats: (module in this package, class), imported when first asked for (keeps start-up light)
_COMPRESSED: dict[str, tuple[str, str]] = {
    "fp8_e4m3": ("fp8", "FP8Format"),
    "int4": ("int4", "Int4Format"),
    "nuq2": ("nuq2", "NUQ2Format"),
    "vq": ("vq", "VQFormat"),
    "kivi2": ("kivi2", "KIVI2Format"),
    "tiered": ("tiered", "TieredFormat"),
}
if (*_PLAIN, *_COMPRESSED) != KV_FORMAT_NAMES:  # the configuration checks names against names.py's list
    raise ImportError(f"kvcache/formats/names.py lists {KV_FORMAT_NAMES}, the registry has {(*_PLAIN, *_COMPRESSED)}")


def _check_name(name: str) -> None:
    if name not in KV_FORMAT_NAMES:
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; accepted: {list(KV_FORMAT_NAMES)}")


def _format_class(name: str) -> type[KVFormat]:
    module, cls = _COMPRESSED[name]
    return getattr(importlib.import_module(f"moekv.kvcache.formats.{module}"), cls)


def kv_format_options(name: str) -> tuple[str, ...]:
    """The options format `name` takes: its constructor's keyword arguments, in their order."""
    _check_name(name)
    if name in _PLAIN:
        return ()
    return tuple(inspect.signature(_format_class(name)).parameters)


def kv_options_for(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of `options` that format `name` takes: for callers that hold one set of options
    for several formats on purpose (EngineConfig, `moekv info`) and have checked it themselves."""
    taken = kv_format_options(name)
    return {key: value for key, value in options.items() if key in taken}


def get_kv_format(name: str, model_dtype: torch.dtype = torch.bfloat16, *,
                  decode_kernel: str = DEFAULT_DECODE_KERNEL, **options: Any) -> KVFormat:
    """The format called `name`, built with `options` (group_size, outlier_sigma, calibration, ...), its
    pools laid out for `decode_kernel` (DECODE_KERNELS: 'auto', 'triton', 'gluon'); ValueError for an
    unknown name or kernel, or an option the format does not take."""
    envs.check_decode_kernel_unset()
    check_decode_kernel(decode_kernel)
    taken = kv_format_options(name)
    unknown = sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"kv_cache_dtype={name!r} does not take the option(s) {unknown}; "
                         f"it takes: {list(taken) if taken else 'no options'}")
    fmt = PlainKVFormat(_PLAIN[name] or model_dtype) if name in _PLAIN else _format_class(name)(**options)
    fmt.decode_kernel = decode_kernel
    return fmt


__all__ = ["DECODE_KERNELS", "KV_FORMAT_NAMES", "GraphStepHooks", "GraphSupport", "KVFormat", "LayerKVCache",
           "PagedQuantFormat", "get_kv_format", "kv_format_options", "kv_options_for"]
