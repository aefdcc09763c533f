"""What the fragment-order layouts (nuq2, int4, kivi2, fp8_e4m3, vq *_layout.py) share: the page shape
every order is defined for, bit fields of an index, reading a kind's slabs, the pool tables' bytes,
allocation and page views, and the version check."""
from __future__ import annotations

import math

import torch

PAGE_TOKENS = 64  # every fragment order is defined for pages of 64 tokens ...
HEAD_DIM = 128  # ... and head_dim 128


def bit_fields(n: int, *widths: int) -> list[torch.Tensor]:
    """Split 0..n-1 into bit fields of the given widths, most significant first."""
    i = torch.arange(n)
    out = []
    shift = sum(widths)
    for w in widths:
        shift -= w
        out.append((i >> shift) & ((1 << w) - 1))
    return out


def check_kind(kind: str) -> None:
    if kind not in ("key", "value"):
        raise ValueError(f"kind={kind!r}: expected 'key' or 'value'")


def slab_fields(what: str, fmt, kind: str, slabs: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]]:
    """One kind's slabs [N, H, slab] uint8 in fmt's layout -> ('k' or 'v', their unpacked fields), or
    ValueError (what: the order's name in the message)."""
    check_kind(kind)
    name = "k" if kind == "key" else "v"
    layout = fmt.layout(kind, PAGE_TOKENS, HEAD_DIM)
    if slabs.dtype != torch.uint8 or slabs.dim() != 3 or slabs.shape[2] != layout.slab_bytes:
        raise ValueError(f"{what}: {name}_pages must be uint8 [N, H, {layout.slab_bytes}], "
                         f"got {slabs.dtype} {tuple(slabs.shape)}")
    return name, layout.unpack(slabs)


def check_version(what: str, version: int, current: int) -> None:
    if version != current:
        raise ValueError(f"{what}: pages of version {version}, this code reads {current}")


def table_bytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of one (page, kv head) of tables {name: (trailing shape, dtype)}."""
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in shapes.values())


def allocate_tables(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], num_blocks: int, num_kv_heads: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed pools [num_blocks, num_kv_heads, *shape] of tables {name: (trailing shape, dtype)}."""
    return {name: torch.zeros(num_blocks, num_kv_heads, *shape, dtype=dt, device=device)
            for name, (shape, dt) in shapes.items()}


def pick_pages(tensors, fields, page_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A pool's tables `fields` (a LayerKVCache or dict), all pages or page_ids only."""
    return {name: tensors[name] if page_ids is None else tensors[name][page_ids] for name in fields}
