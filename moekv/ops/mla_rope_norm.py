"""MLA's glue between its projections and the latent write, in one launch (layers/mla.py on CUDA).

From the q projection [T, H * (nope + r)] and the kv_a projection [T, R + r] of a step, with the
step's cos / sin [T, r/2] (mla_rope_cos_sin_ref): every query head's rotary part and the shared key
rotated (mla_rope_apply_ref's products and sums, each rounded to the dtype as its torch ops round
them), c_kv normalised by kv_a_layernorm (ops/rms_norm.normalize_row, as RMSNorm's kernel); written
to
  - q_abs [T, H, R + r]: columns R: the rotated q_rope; columns :R are left for q_lat (the absorbed
    decode's queries, q_nope through W_UK, written there by the caller), so no concatenation follows;
  - entries [T, R + r]: the normalised c_kv, then the rotated key: the latent entry the cache stores.
One program a token. The reference path (eight to twelve launches: the concatenation of q_rope and
k_rope, the rotation's products, sums and concatenation, the norm, the entry's concatenation) is
`mla_rope_norm_ref`. Shape legend: T tokens, H query heads, R kv_lora_rank, r qk_rope_head_dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.rms_norm import normalize_row


@triton.jit
def _rotate(x1, x2, c, s):
    """(x1 * c - x2 * s, x2 * c + x1 * s) with each product and the result rounded to x1's dtype."""
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    c32, s32 = c.to(tl.float32), s.to(tl.float32)
    first = ((a * c32).to(dt).to(tl.float32) - (b * s32).to(dt).to(tl.float32)).to(dt)
    second = ((b * c32).to(dt).to(tl.float32) + (a * s32).to(dt).to(tl.float32)).to(dt)
    return first, second


@triton.jit
def _mla_rope_norm_kernel(q_ptr, kv_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, ent_ptr,
                          stride_qt, stride_kvt, stride_ct, stride_st, stride_qot, stride_qoh, stride_et, eps,
                          H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_R: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3), ...
        i1, i2 = 2 * j, 2 * j + 1
    else:  # rotate-half pairs (x_i, x_{i + r/2})
        i1, i2 = j, j + HALF
    c = tl.load(cos_ptr + t * stride_ct + j, mask=j_ok, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + j, mask=j_ok, other=0.0)
    # the query heads' rotary parts -> q_abs[t, h, R:]
    h = tl.arange(0, BLOCK_H)
    ok = (h < H)[:, None] & j_ok[None, :]
    q_row = q_ptr + t * stride_qt + h[:, None] * D + NOPE
    o1, o2 = _rotate(tl.load(q_row + i1[None, :], mask=ok, other=0.0), tl.load(q_row + i2[None, :], mask=ok, other=0.0),
                     c[None, :], s[None, :])
    out_row = q_out_ptr + t * stride_qot + h[:, None] * stride_qoh + R + j[None, :]
    tl.store(out_row, o1.to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_row + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=ok)
    # the shared key -> entries[t, R:]
    k_row = kv_ptr + t * stride_kvt + R
    k1, k2 = _rotate(tl.load(k_row + i1, mask=j_ok, other=0.0), tl.load(k_row + i2, mask=j_ok, other=0.0), c, s)
    ent_row = ent_ptr + t * stride_et
    tl.store(ent_row + R + j, k1.to(ent_ptr.dtype.element_ty), mask=j_ok)
    tl.store(ent_row + R + HALF + j, k2.to(ent_ptr.dtype.element_ty), mask=j_ok)
    # c_kv through kv_a_layernorm -> entries[t, :R]
    offs = tl.arange(0, BLOCK_R)
    r_ok = offs < R
    latent = tl.load(kv_ptr + t * stride_kvt + offs, mask=r_ok, other=0.0)
    tl.store(ent_row + offs, normalize_row(latent, w_ptr, offs, r_ok, R, eps).to(ent_ptr.dtype.element_ty), mask=r_ok)


def mla_rope_norm(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                  eps: float, num_heads: int, nope: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H * (nope + r)], kv [T, R + r], cos / sin [T, 1, r/2] or [T, r/2] (in q's dtype), weight [R]
    (kv_a_layernorm's, in kv's dtype) -> (q_abs [T, H, R + r] with columns R: the rotated q_rope and
    columns :R unwritten, entries [T, R + r]), both in q's dtype."""
    T = q.shape[0]
    R = weight.shape[0]
    rope = kv.shape[-1] - R
    D = nope + rope
    if (q.dim() != 2 or q.shape[1] != num_heads * D or kv.dim() != 2 or kv.shape[0] != T or rope < 2 or rope % 2
            or kv.dtype != q.dtype or weight.dtype != q.dtype):
        raise ValueError(f"mla_rope_norm: q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} {kv.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not fit {num_heads} heads of {nope} + {rope}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    cos, sin = (x.reshape(T, rope // 2) for x in (cos, sin))
    cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (cos, sin))
    q_abs = torch.empty(T, num_heads, R + rope, dtype=q.dtype, device=q.device)
    entries = torch.empty(T, R + rope, dtype=q.dtype, device=q.device)
    if T:
        _mla_rope_norm_kernel[(T,)](
            q, kv, cos, sin, weight, q_abs, entries, q.stride(0), kv.stride(0), cos.stride(0), sin.stride(0),
            q_abs.stride(0), q_abs.stride(1), entries.stride(0), float(eps),
            num_heads, D, nope, R, rope // 2, triton.next_power_of_2(num_heads), triton.next_power_of_2(rope // 2),
            triton.next_power_of_2(R), interleave, num_warps=4)
    return q_abs, entries
