"""What the Gluon decode kernels accept, checked in one place (the reference and the launchers share it)."""
from __future__ import annotations

import torch

from moekv.ops.gluon.tables import HEAD_DIM, PAGE_TOKENS

MMA_N = 8  # the query heads of a group are the MMA's N (m16n8k16): groups up to 8
Staged = tuple  # (k_stage [S, Hkv, 64, 128], v_stage, seq_slots [B])


def check_inputs(q: torch.Tensor, frag, block_tables: torch.Tensor, context_lens: torch.Tensor, num_splits: int,
                 fmt: str = "nuq2") -> tuple[int, int, int]:
    """(B, Hkv, G), or ValueError naming what does not fit; frag: a format's fragment pages (their
    num_kv_heads, or k_codes [N, Hkv, ...]), fmt: its name in the messages."""
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"{fmt} Gluon decode: q must be [B, Hq, head_dim={HEAD_DIM}], got {tuple(q.shape)}")
    B, Hq, _ = q.shape
    Hkv = frag.num_kv_heads if hasattr(frag, "num_kv_heads") else frag.k_codes.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq or G > MMA_N or G & (G - 1):
        raise ValueError(f"{fmt} Gluon decode: needs Hq = G * Hkv with G in 1, 2, 4, 8 (Hq={Hq}, Hkv={Hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"{fmt} Gluon decode: block_tables [B={B}, pages] and context_lens [B] expected, got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if num_splits < 1:
        raise ValueError(f"{fmt} Gluon decode: num_splits={num_splits} must be >= 1")
    return B, Hkv, G


def check_extras(staged: Staged | None, sliding_window: int | None, B: int, Hkv: int) -> None:
    """ValueError when the staged tail or the window does not fit."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"nuq2 Gluon decode: sliding_window must be a positive int or None, got {sliding_window!r}")
    if staged is None:
        return
    if len(staged) != 3:
        raise ValueError("nuq2 Gluon decode: staged must be (k_stage, v_stage, seq_slots)")
    k_stage, v_stage, seq_slots = staged
    want = (Hkv, PAGE_TOKENS, HEAD_DIM)
    if k_stage.dim() != 4 or tuple(k_stage.shape[1:]) != want or v_stage.shape != k_stage.shape:
        raise ValueError(f"nuq2 Gluon decode: staging tensors must be [S, {Hkv}, {PAGE_TOKENS}, {HEAD_DIM}], got "
                         f"{tuple(k_stage.shape)} and {tuple(v_stage.shape)}")
    if k_stage.stride(-1) != 1 or v_stage.stride() != k_stage.stride():
        raise ValueError("nuq2 Gluon decode: staging tensors need unit channel stride and equal strides")
    if seq_slots.shape != (B,):
        raise ValueError(f"nuq2 Gluon decode: seq_slots must be [B={B}], got {tuple(seq_slots.shape)}")


Residual = tuple  # (k_ring [S, Hkv, R, 128], v_ring): a residual window's ring at the staging's slots


def check_residual(residual: Residual | None, staged: Staged | None, Hkv: int, fmt: str, multiple: int = 1) -> int:
    """R, the ring's rows (0 without one), or ValueError when the ring does not fit: it needs the staged
    tail (its seq_slots), the staging's slots, Hkv and head_dim, and R a multiple of `multiple`."""
    if residual is None:
        return 0
    if staged is None:
        raise ValueError(f"{fmt} Gluon decode: the residual ring comes with the staged tail (its seq_slots)")
    k_ring, v_ring = residual
    if (k_ring.dim() != 4 or k_ring.shape[1] != Hkv or k_ring.shape[3] != HEAD_DIM or v_ring.shape != k_ring.shape
            or k_ring.shape[0] != staged[0].shape[0]):
        raise ValueError(f"{fmt} Gluon decode: residual rings must be [S, {Hkv}, R, {HEAD_DIM}] like the staging, "
                         f"got {tuple(k_ring.shape)} and {tuple(v_ring.shape)}")
    if k_ring.stride(-1) != 1 or v_ring.stride() != k_ring.stride():
        raise ValueError(f"{fmt} Gluon decode: residual rings need unit channel stride and equal strides")
    R = k_ring.shape[2]
    if R % multiple:
        raise ValueError(f"{fmt} Gluon decode: the residual window R={R} must be a multiple of {multiple}")
    return R


def check_tail_splits(tail_splits: int, R: int) -> int:
    """tail_splits, or ValueError: at least 1, and 1 without a residual ring (R = 0: the staged page
    alone, which the kernels without a ring read in one program)."""
    if tail_splits < 1 or (tail_splits > 1 and R <= 0):
        raise ValueError(f"Gluon decode: tail_splits={tail_splits} must be >= 1, and 1 without a residual ring")
    return tail_splits
