"""The KV format names the registry (kvcache/formats/__init__.py) accepts, and the decode kernels a
format's pools can be laid out for, in a module that imports nothing, so that the configuration can
check a name without loading any format."""

# the plain formats store K and V in a 16/32-bit float ("auto": the model's dtype); the others compress them
PLAIN_KV_FORMAT_NAMES = ("auto", "bf16", "fp16", "fp32")
KV_FORMAT_NAMES = (*PLAIN_KV_FORMAT_NAMES, "fp8_e4m3", "int4", "nuq2", "vq", "kivi2", "tiered")
# EngineConfig.cache.decode_kernel / get_kv_format(decode_kernel=...): 'auto' the Gluon kernels on sm_90 for
# the shapes they cover (and formats whose Gluon kernel is their default), the Triton kernels elsewhere;
# 'triton' slab pools everywhere; 'gluon' fragment order wherever a Gluon kernel covers the shape
DECODE_KERNELS = ("auto", "triton", "gluon")
DEFAULT_DECODE_KERNEL = "auto"


def check_decode_kernel(choice: str) -> str:
    """`choice` if it names a decode kernel (DECODE_KERNELS), else a ValueError listing them."""
    if choice not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={choice!r} is not supported; accepted: {list(DECODE_KERNELS)}")
    return choice
