"""KV cache formats and the per-layer page pools they allocate."""
from moekv.kvcache.formats import KV_FORMAT_NAMES, KVFormat, get_kv_format

__all__ = ["KV_FORMAT_NAMES", "KVFormat", "get_kv_format"]
