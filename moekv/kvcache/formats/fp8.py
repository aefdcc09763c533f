"""fp8_e4m3: FP8 E4M3 codes with one fp16 scale per (token, KV head).

Slab of one (page, kv_head), P = block_size, D = head_dim:
    key:   codes e4m3 [P, D], scale fp16 [P]
    value: codes e4m3 [D, P] (token-major), scale fp16 [P]
Values are stored transposed because the decode kernel multiplies probabilities by them, which
reduces over tokens: 8-bit MMA operands must be contiguous along the reduced dimension, and a
[P, D] value tile was read back from shared memory one byte at a time (SASS of the sm_90 build).
"""
from __future__ import annotations

import torch

from moekv.kvcache.formats.fragment import FragmentPagedFormat, GluonKernel
from moekv.kvcache.formats.paged import Field, PageLayout, per_shape

FP8_MAX = 448.0  # largest finite E4M3 value


# whether decode_kernel='auto' gives fp8_e4m3 pools the Gluon kernel's fragment order on sm_90
# ('gluon' always does for covered shapes): not until a benchmark shows it beating the Triton kernel
GLUON_BY_DEFAULT = False


def _gluon_covers(fmt, block_size: int, head_dim: int) -> str | None:
    if (block_size, head_dim) == (64, 128):
        return None
    return f"fp8_e4m3's Gluon kernel covers block_size 64, head_dim 128, got {block_size} and {head_dim}"


class FP8Format(FragmentPagedFormat):
    name = "fp8_e4m3"
    # the Gluon kernel's pools keep the slabs with their codes in fragment order (fp8_layout.py)
    gluon_kernel = GluonKernel("moekv.ops.gluon.fp8_layout", "moekv.ops.gluon.fp8_decode:fp8_decode_attention",
                               _gluon_covers, default_on=GLUON_BY_DEFAULT, marker="k_slabs")

    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        codes = (block_size, head_dim) if kind == "key" else (head_dim, block_size)
        return PageLayout([Field("codes", torch.float8_e4m3fn, codes),
                           Field("scale", torch.float16, (block_size,))])

    def quantize(self, x, kind, layer=None):
        amax = x.abs().amax(dim=-1)  # [n, Hkv, P]
        scale = (amax / FP8_MAX).to(torch.float16).float()  # what the slab stores
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero (or tiny) rows: 0/0 would be NaN
        codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [n, Hkv, P, D]
        if kind != "key":
            codes = codes.transpose(-1, -2)  # values token-major: [n, Hkv, D, P]
        return {"codes": codes, "scale": scale}

    def dequantize(self, fields, kind, layer=None):
        codes = fields["codes"].float()
        if kind != "key":
            codes = codes.transpose(-1, -2)
        return codes * fields["scale"].float()[..., None]

    def decode_spec(self, block_size, head_dim):
        from moekv.ops.decode.fp8 import fp8_spec

        return fp8_spec(self, block_size, head_dim)
