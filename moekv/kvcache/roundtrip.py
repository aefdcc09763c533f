"""roundtrip: push K or V through a KV format's page layout and back, for tests and research."""
from __future__ import annotations

from typing import Any

import torch

from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.paged import PagedQuantFormat, check_finite


def roundtrip(name: str, x: torch.Tensor, kind: str = "key", block_size: int = 16, layer: int = 0,
              **options: Any) -> tuple[torch.Tensor, float]:
    """x [tokens, kv_heads, head_dim] -> (x_hat of the same shape and dtype, bits per element).

    Full pages of block_size tokens go through the format's quantize -> pack into the page slab ->
    unpack -> dequantize, exactly as the cache stores them; a trailing partial page stays in 16-bit,
    as the cache's staging page does. Bits count every byte: slabs (with padding) and the tail.
    """
    if kind not in ("key", "value"):
        raise ValueError(f"kind={kind!r} is not accepted; use 'key' or 'value'")
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, kv_heads, head_dim], got shape {tuple(x.shape)}")
    fmt = get_kv_format(name, x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32, **options)
    T, H, D = x.shape
    if not isinstance(fmt, PagedQuantFormat):  # plain formats: a cast
        dtype = getattr(fmt, "dtype", x.dtype)
        return x.to(dtype).to(x.dtype), float(8 * torch.empty((), dtype=dtype).element_size())
    fmt.check_layout(H, block_size, D)
    n_full = T // block_size
    parts, bits = [], 0
    if n_full:
        pages = x[:n_full * block_size].float().reshape(n_full, block_size, H, D).transpose(1, 2)  # [n, H, P, D]
        check_finite(pages, kind + "s")
        layout = fmt.layout(kind, block_size, D)
        slab = layout.pack(fmt.quantize(pages, kind, layer))
        bits += 8 * slab.numel()
        x_hat = fmt.dequantize(layout.unpack(slab), kind, layer)
        parts.append(x_hat.transpose(1, 2).reshape(n_full * block_size, H, D))
    tail = x[n_full * block_size:]
    if tail.shape[0]:
        parts.append(tail.to(torch.bfloat16).float())
        bits += 16 * tail.numel()
    return torch.cat(parts).to(x.dtype), bits / x.numel()
