"""Registry of KV formats. A format is one file here: a spec (bytes per page, bits per element)
plus how it writes a step's K/V into pages and how attention reads them back."""
from __future__ import annotations

import torch

from moekv.kvcache.formats.base import KVFormat, LayerKVCache
from moekv.kvcache.formats.plain import PlainKVFormat

# "auto" stores K/V in the model's dtype.
KV_FORMAT_NAMES = ("auto", "bf16", "fp16", "fp32")


def get_kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    if name == "auto":
        return PlainKVFormat(model_dtype)
    plain = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name in plain:
        return PlainKVFormat(plain[name])
    raise ValueError(f"kv_cache_dtype={name!r} is unknown; accepted: {list(KV_FORMAT_NAMES)}")


__all__ = ["KV_FORMAT_NAMES", "KVFormat", "LayerKVCache", "get_kv_format"]
