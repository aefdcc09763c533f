"""nuq2's 2-bit code packing in its slabs (the planar order moekv/kvcache/formats/nuq2.py stores and
the Triton decode readers expect), shared with the Gluon layout (moekv/ops/gluon/nuq2_layout.py)
without an import of the format module."""
from __future__ import annotations

import torch

CODES_PER_BYTE = 4
NO_OUTLIER = 0xFFFF  # out_idx of an unused slot; page-heads hold fewer than 65535 elements


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., P, D] in 0..3 -> bytes [..., P, D/4]. Channel s*D/4 + j sits in bits 2s..2s+1 of
    byte j: one wide load of a row and four uniform shifts yield four contiguous channel runs."""
    quarters = codes.to(torch.uint8).chunk(CODES_PER_BYTE, dim=-1)  # 4 x [..., P, D/4]
    out = quarters[0].clone()
    for s in range(1, CODES_PER_BYTE):
        out |= quarters[s] << (2 * s)
    return out


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., P, D/4] -> codes [..., P, D] (int64)."""
    return torch.cat([(packed >> (2 * s)) & 3 for s in range(CODES_PER_BYTE)], dim=-1).long()
