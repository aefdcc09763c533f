"""Tile reader of uncompressed 16-bit pages (moekv/kvcache/formats/plain.py) for the paged decode kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.decode.common import DecodeSpec, TileReader
from moekv.ops.decode.launch import spec_launch


@triton.jit
def plain_tile(pool, base, tok, page_base, tok0, valid, D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
               ASM: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
               P4: tl.constexpr, P5: tl.constexpr):
    """Uncompressed pages [N, Hkv, P, D] in bf16 / fp16."""
    d = tl.arange(0, D)
    x = tl.load(pool + (base + tok * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return x, valid


def plain_spec(dtype: torch.dtype) -> DecodeSpec | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 pages keep the reference path
    reader = TileReader(plain_tile)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return DecodeSpec(key=reader, value=reader, dot_dtype=dtype, **spec_launch(name, 0))
