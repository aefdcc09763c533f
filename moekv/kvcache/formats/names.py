"""The KV format names the registry (kvcache/formats/__init__.py) accepts, in a module that imports
nothing, so that the configuration can check a name without loading any format."""

KV_FORMAT_NAMES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "int4", "nuq2", "vq", "kivi2", "tiered")
