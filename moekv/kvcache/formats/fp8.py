"""fp8_e4m3: FP8 E4M3 codes with one fp16 scale per (token, KV head)."""
from __future__ import annotations

import torch

from moekv.kvcache.formats.base import Field, PagedQuantFormat, PageLayout

FP8_MAX = 448.0  # largest finite E4M3 value


class FP8Format(PagedQuantFormat):
    name = "fp8_e4m3"

    def layout(self, kind, block_size, head_dim) -> PageLayout:
        return PageLayout([Field("codes", torch.float8_e4m3fn, (block_size, head_dim)),
                           Field("scale", torch.float16, (block_size,))])

    def quantize(self, x, kind, layer=None):
        amax = x.abs().amax(dim=-1)  # [n, Hkv, P]
        scale = (amax / FP8_MAX).to(torch.float16).float()  # what the slab stores
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero (or tiny) rows: 0/0 would be NaN
        codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"codes": codes, "scale": scale}

    def dequantize(self, fields, kind, layer=None):
        return fields["codes"].float() * fields["scale"].float()[..., None]

    def decode_spec(self, block_size, head_dim):
        from moekv.ops.decode_tiles import fp8_spec

        return fp8_spec(self, block_size, head_dim)
