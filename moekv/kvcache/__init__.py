"""KV cache formats and the per-layer page pools they allocate."""
from moekv.kvcache.formats import KV_FORMAT_NAMES, KVFormat, get_kv_format
from moekv.kvcache.roundtrip import roundtrip

__all__ = ["KV_FORMAT_NAMES", "KVFormat", "get_kv_format", "roundtrip"]
