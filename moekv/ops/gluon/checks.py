"""What the Gluon decode kernels accept, checked in one place (the reference and the launchers share it)."""
from __future__ import annotations

import torch

from moekv.ops.gluon.nuq2_layout import HEAD_DIM, Nuq2FragmentPages

MMA_N = 8  # the query heads of a group are the MMA's N (m16n8k16): groups up to 8


def check_inputs(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 num_splits: int) -> tuple[int, int, int]:
    """(B, Hkv, G), or ValueError naming what does not fit."""
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"nuq2 Gluon decode: q must be [B, Hq, head_dim={HEAD_DIM}], got {tuple(q.shape)}")
    B, Hq, _ = q.shape
    Hkv = frag.k_codes.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq or G > MMA_N or G & (G - 1):
        raise ValueError(f"nuq2 Gluon decode: needs Hq = G * Hkv with G in 1, 2, 4, 8 (Hq={Hq}, Hkv={Hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"nuq2 Gluon decode: block_tables [B={B}, pages] and context_lens [B] expected, got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if num_splits < 1:
        raise ValueError(f"nuq2 Gluon decode: num_splits={num_splits} must be >= 1")
    return B, Hkv, G
