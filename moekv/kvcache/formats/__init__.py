"""Registry of KV formats. A format is one file here: a spec (bytes per page, bits per element)
plus how it writes a step's K/V into pages and how attention reads them back."""
from __future__ import annotations

from typing import Any, Callable

import torch

from moekv.kvcache.formats.base import KVFormat, LayerKVCache, PagedQuantFormat
from moekv.kvcache.formats.fp8 import FP8Format
from moekv.kvcache.formats.names import KV_FORMAT_NAMES
from moekv.kvcache.formats.plain import PlainKVFormat

_PLAIN = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# name -> factory(model_dtype, **options). "auto" stores K/V in the model's dtype.
_FACTORIES: dict[str, Callable[..., KVFormat]] = {
    "auto": lambda model_dtype, **_: PlainKVFormat(model_dtype),
    **{name: (lambda dt: lambda model_dtype, **_: PlainKVFormat(dt))(dt) for name, dt in _PLAIN.items()},
    "fp8_e4m3": lambda model_dtype, **_: FP8Format(),
    "int4": lambda model_dtype, **o: _lazy("int4", "Int4Format")(**o),
    "nuq2": lambda model_dtype, **o: _lazy("nuq2", "NUQ2Format")(**o),
    "vq": lambda model_dtype, **o: _lazy("vq", "VQFormat")(**o),
    "kivi2": lambda model_dtype, **o: _lazy("kivi", "KIVI2Format")(**o),
    "tiered": lambda model_dtype, **o: _lazy("tiered", "TieredFormat")(**o),
}
if tuple(_FACTORIES) != KV_FORMAT_NAMES:  # the configuration checks names against the list in names.py
    raise ImportError(f"kvcache/formats/names.py lists {KV_FORMAT_NAMES}, the registry has {tuple(_FACTORIES)}")


def _lazy(module: str, cls: str):
    """Import a format's module only when it is asked for (keeps start-up light)."""
    import importlib

    return getattr(importlib.import_module(f"moekv.kvcache.formats.{module}"), cls)


def get_kv_format(name: str, model_dtype: torch.dtype = torch.bfloat16, **options: Any) -> KVFormat:
    """The format called `name`; options (group_size, outlier_sigma, calibration, ...) go to its
    constructor, and each format ignores the ones it does not use."""
    if name not in _FACTORIES:
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; accepted: {list(KV_FORMAT_NAMES)}")
    return _FACTORIES[name](model_dtype, **options)


__all__ = ["KV_FORMAT_NAMES", "KVFormat", "LayerKVCache", "PagedQuantFormat", "get_kv_format"]
