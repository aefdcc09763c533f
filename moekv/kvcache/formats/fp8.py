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

from moekv.kvcache.formats.base import Field, FragmentPagedFormat, PageLayout, gluon_pages_wanted, per_shape

FP8_MAX = 448.0  # largest finite E4M3 value


# whether decode_kernel='auto' gives fp8_e4m3 pools the Gluon kernel's fragment order on sm_90
# ('gluon' always does for covered shapes): not until a benchmark shows it beating the Triton kernel
GLUON_BY_DEFAULT = False


class FP8Format(FragmentPagedFormat):
    name = "fp8_e4m3"

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

    # -- the Gluon decode kernel's page layout (moekv/ops/gluon/fp8_layout.py) ---------------------------
    fragment_marker = "k_slabs"

    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape keep their slabs with the codes in the Gluon fp8 kernel's fragment
        order (fp8_layout.py): decode_kernel 'gluon', or 'auto' on sm_90 once GLUON_BY_DEFAULT
        (base.gluon_pages_wanted). Covered: block_size 64, head_dim 128."""
        covered = (block_size, head_dim) == (64, 128)
        return gluon_pages_wanted(self.decode_kernel, covered, device,
                                  "fp8_e4m3's Gluon kernel covers block_size 64, head_dim 128, "
                                  f"got {block_size} and {head_dim}", by_default=GLUON_BY_DEFAULT)

    def fragment_layout(self):
        from moekv.ops.gluon import fp8_layout

        return fp8_layout

    def fragment_view(self, cache, page_ids=None):
        return self.fragment_layout().fragment_view(self, cache, page_ids)

    def gluon_decode(self, q, cache, ctx, scale, sliding_window, staged):
        from moekv.ops.gluon.fp8_decode import fp8_decode_attention

        return fp8_decode_attention(q, self.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
                                    staged=staged, sliding_window=sliding_window)
