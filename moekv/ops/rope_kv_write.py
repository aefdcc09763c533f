"""RoPE on q and k and the store of the rotated k and the v into the KV cache, in one launch.

Unfused, a layer runs the RoPE kernel twice (q, k), then two index_puts for K and V plus the
slot_mapping // P and % P kernels: about seven launches that each touch a few KiB at batch 1.
Here one program per (token, head) does it all: heads [0, Hq) rotate a query head into a new
q tensor; heads [Hq, Hq + Hkv) rotate a key head and store it, and copy the value head, straight
into the cache. Two destinations:

- pages [N, Hkv, P, D] at slot_mapping[t] = page * P + offset (plain formats, any step);
- staging pages [S, Hkv, P, D] at (seq_slots[t], position[t] % P) (staged compressed formats on
  a decode step that fills no page: one token per sequence, what `stage_decode_tokens` does),
  optionally also a residual ring [S, Hkv, R, D] at (seq_slots[t], position[t] % R) (kivi2, nuq2, vq).

The rotation is the one of ops/rotary.py, same fp32 expression: the rotated k is rounded to the
model dtype first, then to the cache's dtype, as the unfused path does, so both paths store the
same values. Negative slots are skipped (never produced by the engine: padded graph rows use a
scratch page). Partial RoPE (rotary_dim R < D): the first R elements of each q and k head are
rotated, the rest copied as they are (ops/rotary.py). Scaled RoPE (YaRN): a table of inverse
frequencies and a cos/sin scale, as ops/rotary.py takes them. Shape legend: T = tokens, Hq / Hkv = query /
KV heads, D = head_dim (even), R = rotary dims (even, <= D).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moekv.ops.rotary import check_inv_freq, check_rotary_dim, rope_cos_sin_of, rope_pass_mask, rope_rotate


@triton.jit
def _rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, kc_ptr, vc_ptr, kr_ptr, vr_ptr, pos_ptr, index_ptr, inv_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ot, stride_oh,
                          stride_cn, stride_ch, stride_cp, stride_rn, stride_rh, stride_rp,
                          Hq, P, R, log2_theta, scale,
                          D: tl.constexpr, ROT: tl.constexpr, ROT2: tl.constexpr, BLOCK: tl.constexpr,
                          BLOCK_D: tl.constexpr, STAGED: tl.constexpr, HAS_RING: tl.constexpr,
                          HAS_TABLE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < ROT2
    j, pmask = rope_pass_mask(D, ROT, BLOCK_D)  # the unrotated elements (none when ROT == D)
    pos_i = tl.load(pos_ptr + t).to(tl.int64)
    c, s = rope_cos_sin_of(pos_i.to(tl.float32), i, mask, ROT, log2_theta, inv_ptr, scale, HAS_TABLE)
    if h < Hq:
        qbase = q_ptr + t * stride_qt + h * stride_qh
        q1, q2 = rope_rotate(qbase, i, mask, c, s, ROT2)
        obase = q_out_ptr + t * stride_ot + h * stride_oh
        tl.store(obase + i, q1, mask=mask)
        tl.store(obase + ROT2 + i, q2, mask=mask)
        if ROT < D:  # partial RoPE: the rest of the head unrotated
            tl.store(obase + j, tl.load(qbase + j, mask=pmask, other=0.0), mask=pmask)
    else:
        hk = h - Hq  # kv head
        idx = tl.load(index_ptr + t).to(tl.int64)
        if STAGED:
            row, off = idx, pos_i % P  # staging slot of the sequence, its newest page's offset
        else:
            row, off = idx // P, idx % P  # page, offset
        if idx >= 0:
            # rounded to the model dtype first: the unfused path's rounding
            kbase = k_ptr + t * stride_kt + hk * stride_kh
            k1, k2 = rope_rotate(kbase, i, mask, c, s, ROT2)
            dmask = j < D  # the whole head, for v
            vrow = tl.load(v_ptr + t * stride_vt + hk * stride_vh + j, mask=dmask, other=0.0)
            dst = row * stride_cn + hk * stride_ch + off * stride_cp
            tl.store(kc_ptr + dst + i, k1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc_ptr + dst + ROT2 + i, k2.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + dst + j, vrow.to(vc_ptr.dtype.element_ty), mask=dmask)
            if ROT < D:
                kpass = tl.load(kbase + j, mask=pmask, other=0.0)
                tl.store(kc_ptr + dst + j, kpass.to(kc_ptr.dtype.element_ty), mask=pmask)
            if HAS_RING:
                rdst = idx * stride_rn + hk * stride_rh + (pos_i % R) * stride_rp
                tl.store(kr_ptr + rdst + i, k1.to(kr_ptr.dtype.element_ty), mask=mask)
                tl.store(kr_ptr + rdst + ROT2 + i, k2.to(kr_ptr.dtype.element_ty), mask=mask)
                tl.store(vr_ptr + rdst + j, vrow.to(vr_ptr.dtype.element_ty), mask=dmask)
                if ROT < D:
                    kpass_ring = tl.load(kbase + j, mask=pmask, other=0.0)
                    tl.store(kr_ptr + rdst + j, kpass_ring.to(kr_ptr.dtype.element_ty), mask=pmask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: float,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, staged: bool = False,
                  k_ring: torch.Tensor | None = None, v_ring: torch.Tensor | None = None,
                  rotary_dim: int | None = None, inv_freq: torch.Tensor | None = None,
                  scale: float = 1.0) -> torch.Tensor:
    """Rotate q and k at their positions, store the rotated k and v in the cache; return the rotated q.

    positions [T]; q [T, Hq, D], k, v [T, Hkv, D] (any row and head strides); k_cache, v_cache
    [N, Hkv, P, D] with index = slot_mapping [T] (staged=False), or [S, Hkv, P, D] with index =
    seq_slots [T] (staged=True: one token per sequence, offset position % P); k_ring, v_ring
    [S, Hkv, R, D] (staged only): also store at (seq_slots[t], position % R); rotary_dim: the
    leading elements of each head that are rotated (None: all D); inv_freq [R/2] fp32 (None:
    theta^(-2i/R)) and scale (cos and sin multiplied by it): scaled RoPE (YaRN).
    Returns q rotated [T, Hq, D], contiguous, q's dtype. No host sync (CUDA-graph capturable).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D % 2 or k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"rope_kv_write: head_dim must be even and equal for q, k, v, got {D}, {k.shape[-1]}, "
                         f"{v.shape[-1]}")
    rotary_dim = D if rotary_dim is None else rotary_dim
    check_rotary_dim(D, rotary_dim, "rope_kv_write")
    check_inv_freq(inv_freq, rotary_dim, q.device, "rope_kv_write", scale)
    if k_cache.shape[1] != Hkv or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_kv_write: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold "
                         f"{Hkv} KV heads of head_dim {D}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("rope_kv_write: k and v caches must share one layout with contiguous rows")
    has_ring = k_ring is not None
    if has_ring:
        if not staged or v_ring is None or k_ring.shape != v_ring.shape or k_ring.stride() != v_ring.stride() \
                or k_ring.shape[1] != Hkv or k_ring.shape[3] != D or k_ring.stride(-1) != 1:
            raise ValueError("rope_kv_write: residual rings need staged=True and k_ring, v_ring [S, Hkv, R, D] "
                             "of one layout")
    q, k, v = _rows(q), _rows(k), _rows(v)
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    ring_k, ring_v = (k_ring, v_ring) if has_ring else (k_cache, v_cache)  # unused when not has_ring
    R = k_ring.shape[2] if has_ring else 1
    _rope_kv_write_kernel[(T, Hq + Hkv)](
        q, k, v, q_out, k_cache, v_cache, ring_k, ring_v, positions, index, positions if inv_freq is None else inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        Hq, k_cache.shape[2], R, math.log2(theta), float(scale),
        D, rotary_dim, rotary_dim // 2, triton.next_power_of_2(rotary_dim // 2), triton.next_power_of_2(D),
        bool(staged), has_ring, inv_freq is not None, num_warps=1)
    return q_out
