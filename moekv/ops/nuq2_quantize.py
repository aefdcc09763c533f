"""nuq2's page quantization in one Triton launch: one program per (page, kv head) slab.

`NUQ2Format.quantize` (the reference, moekv/kvcache/formats/nuq2.py) spends ~60 small torch
kernels on a batch of pages: robust moments, a top-k of the outliers, a sort for the k-means start,
eight Lloyd iterations of masked sums, inside a CUDA-graph decode step that fills pages (batch 64:
every step fills one or two) and in every prefill chunk (docs/decisions.md, "nuq2 pages quantized by
one Triton kernel"). Here a program holds its page-head's P x D elements in registers and does it
all, then writes the packed slab (codes, FP8 channel moments, fp16 centroids, FP8 outliers) at the
layout's offsets, so nothing is packed afterwards.

What needs a sort in the reference is a counting search here, exact and order-free:
- the outlier slots: the S largest deviations among the eligible elements, by bisection on the
  float bits of the deviation (31 halvings of [0, inf)); ties at the threshold go to the lowest
  positions, and the slots are filled in position order (the reader needs used slots first only);
- the k-means start, the kept elements' 1/8..7/8 quantiles: the k-th smallest value by bisection
  on an order-preserving integer key of the float (32 halvings each).
The FP8 E4M3 rounding (channel moments, outlier values) is done with integer arithmetic rather
than Triton's float8 cast, whose interpreter rounds wrongly across a binade (the CPU tests run
there), and it is exact either way: round to nearest, ties to even, as torch's cast.

The arithmetic is the reference's in fp32 with correctly rounded division and square root; sums
are taken in a different order, so centroids may differ from the reference in the last fp32 bit
(rarely visible after their fp16 rounding) and a code at a centroid midpoint may flip.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _total(x):
    return tl.sum(tl.sum(x, axis=1), axis=0)


@triton.jit
def _round_e4m3(x):
    """x fp32 with |x| <= 448 -> (the nearest E4M3 value, ties to even, as fp32; its byte, int32)."""
    a = tl.abs(x)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # below 2^-6 the grid is the subnormals' 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
    inv = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    y = a * inv  # exact (a power of two)
    r = ((y + 8388608.0) - 8388608.0) * step  # y < 2^23: adding 2^23 rounds to an integer, ties to even
    rb = r.to(tl.int32, bitcast=True)
    normal_byte = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    sub_byte = (r * 512.0).to(tl.int32)  # 0..7 units of 2^-9 (exact)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    byte = tl.where(r >= 0.015625, normal_byte, sub_byte) | (sign << 7)  # 2^-6: the smallest normal
    return tl.where(x < 0, -r, r), byte


@triton.jit
def _robust_moments_channels(x, P: tl.constexpr):
    """Mean and std over the tokens (axis 0) of x [P, D], re-estimated without the elements beyond
    3 std of a first pass (nuq2.robust_moments)."""
    mean = tl.sum(x, axis=0) / P
    d = x - mean[None, :]
    std = tl.sqrt_rn(tl.sum(d * d, axis=0) / P)
    w = (tl.abs(d) <= 3.0 * std[None, :]).to(tl.float32)
    count = tl.maximum(tl.sum(w, axis=0), 1.0)
    mean = tl.div_rn(tl.sum(x * w, axis=0), count)
    d = x - mean[None, :]
    std = tl.sqrt_rn(tl.div_rn(tl.sum(d * d * w, axis=0), count))
    return mean, std


@triton.jit
def _robust_moments_all(x, N: tl.constexpr):
    """robust_moments over every element of x [P, D] -> scalars."""
    mean = _total(x) / N
    d = x - mean
    std = tl.sqrt_rn(_total(d * d) / N)
    w = (tl.abs(d) <= 3.0 * std).to(tl.float32)
    count = tl.maximum(_total(w), 1.0)
    mean = tl.div_rn(_total(x * w), count)
    d = x - mean
    std = tl.sqrt_rn(tl.div_rn(_total(d * d * w), count))
    return mean, std


@triton.jit
def _flat_rank(m):
    """m [P, D] int32 of 0/1 -> for each element, how many set elements precede or are it in
    row-major (position) order."""
    row_total = tl.sum(m, axis=1)
    before = tl.cumsum(row_total, axis=0) - row_total
    return tl.cumsum(m, axis=1) + before[:, None]


@triton.jit
def _order_key(z):
    """An int32 key with the order of the floats z (finite): negative floats' magnitude bits flipped."""
    bits = z.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_at_most(z, keep, v):
    """How many kept elements of z have an order key <= v (an int64 scalar within int32)."""
    return _total((keep & (_order_key(z) <= v.to(tl.int32))).to(tl.int32))


@triton.jit
def _value_at_key(z, keep, v):
    """The largest kept element of z whose key is <= v: the element with key v, when one has it."""
    return tl.max(tl.max(tl.where(keep & (_order_key(z) <= v.to(tl.int32)), z, -float("inf")), axis=1), axis=0)


@triton.jit
def _quartile_starts(z, keep, count):
    """The kept elements' k-th smallest values (0-based) for k = count * (1, 3, 5, 7) // 8 (needs
    count > 0): for each, the smallest key v with at least k + 1 kept keys <= v, by bisection. The
    four searches share each pass over z (independent reductions, and z's key is recomputed from
    z rather than held in registers beside it)."""
    k0 = (1 * count) // 8 + 1
    k1 = (3 * count) // 8 + 1
    k2 = (5 * count) // 8 + 1
    k3 = (7 * count) // 8 + 1
    lo0 = tl.full([], -2147483648, tl.int64)  # no finite key is <= this
    hi0 = tl.full([], 2147483647, tl.int64)  # every key is <= this
    lo1, lo2, lo3 = lo0, lo0, lo0
    hi1, hi2, hi3 = hi0, hi0, hi0
    for _ in range(32):
        m0 = lo0 + (hi0 - lo0) // 2
        m1 = lo1 + (hi1 - lo1) // 2
        m2 = lo2 + (hi2 - lo2) // 2
        m3 = lo3 + (hi3 - lo3) // 2
        n0 = _count_at_most(z, keep, m0)
        n1 = _count_at_most(z, keep, m1)
        n2 = _count_at_most(z, keep, m2)
        n3 = _count_at_most(z, keep, m3)
        hi0, lo0 = tl.where(n0 >= k0, m0, hi0), tl.where(n0 >= k0, lo0, m0)
        hi1, lo1 = tl.where(n1 >= k1, m1, hi1), tl.where(n1 >= k1, lo1, m1)
        hi2, lo2 = tl.where(n2 >= k2, m2, hi2), tl.where(n2 >= k2, lo2, m2)
        hi3, lo3 = tl.where(n3 >= k3, m3, hi3), tl.where(n3 >= k3, lo3, m3)
    return (_value_at_key(z, keep, hi0), _value_at_key(z, keep, hi1), _value_at_key(z, keep, hi2),
            _value_at_key(z, keep, hi3))


@triton.jit
def _nearest(z, c0, c1, c2, c3):
    """The code of the nearest of the sorted centroids for each element (nuq2.assign): in 1-D a
    threshold test against the midpoints."""
    return (z > (c0 + c1) * 0.5).to(tl.int32) + (z > (c1 + c2) * 0.5).to(tl.int32) + (z > (c2 + c3) * 0.5).to(tl.int32)


@triton.jit
def _fit_weight(z, keep, KEY: tl.constexpr):
    """The k-means weight of each element: 0 if not kept; keys 1 + |z|^3 (nuq2.fit_weight), values 1.
    Recomputed where used rather than held in registers through the searches."""
    w = keep.to(tl.float32)
    if KEY:
        az = tl.abs(z)
        w = w * (1.0 + az * az * az)
    return w


@triton.jit
def _choose_slots(dev, eligible, S: tl.constexpr):
    """The S largest deviations dev >= 0 among the eligible elements (all of them if fewer) ->
    bool [P, D]. Bisection on the float bits (monotone for non-negative floats) finds the S-th
    largest; ties at it go to the lowest positions."""
    n_eligible = _total(eligible.to(tl.int32))
    bits = dev.to(tl.int32, bitcast=True)
    lo = tl.full([], 0, tl.int32)  # at least S eligible bits are >= lo (when n_eligible > S)
    hi = tl.full([], 0x7F800001, tl.int32)  # none is >= hi (finite)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        n = _total((eligible & (bits >= mid)).to(tl.int32))
        lo = tl.where(n >= S, mid, lo)
        hi = tl.where(n >= S, hi, mid)
    above = eligible & (bits > lo)
    tie = (eligible & (bits == lo)).to(tl.int32)
    need = S - _total(above.to(tl.int32))
    chosen = above | ((tie > 0) & (_flat_rank(tie) <= need))
    return tl.where(n_eligible <= S, eligible, chosen)


@triton.jit
def _nuq2_quantize_kernel(x_ptr, slab_ptr, cb_ptr, stride_x, stride_slab, tau, HEADS,
                          P: tl.constexpr, D: tl.constexpr, KEY: tl.constexpr, S: tl.constexpr, FILL: tl.constexpr,
                          S_PAD: tl.constexpr, CALIBRATED: tl.constexpr, ITERS: tl.constexpr,
                          MEAN_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, CENT_OFF: tl.constexpr,
                          OVAL_OFF: tl.constexpr, OIDX_OFF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = P * D
    t = tl.arange(0, P)
    ch = tl.arange(0, D)
    x = tl.load(x_ptr + row * stride_x + t[:, None] * D + ch[None, :]).to(tl.float32)  # [P, D]
    slab = slab_ptr + row * stride_slab

    # -- normalisation (keys): per channel over the page's tokens, moments stored in FP8 -----------
    if KEY:
        mean, std = _robust_moments_channels(x, P)
        mean, mean_byte = _round_e4m3(tl.minimum(tl.maximum(mean, -448.0), 448.0))
        floor = 1e-3 * tl.max(tl.max(tl.abs(x), axis=1), axis=0) + 1e-12
        scale, scale_byte = _round_e4m3(tl.minimum(tl.maximum(std, floor), 448.0))
        scale = tl.maximum(scale, 0.001953125)  # the smallest E4M3 subnormal, 2^-9
        tl.store(slab + MEAN_OFF + ch, mean_byte.to(tl.uint8))
        tl.store(slab + SCALE_OFF + ch, scale_byte.to(tl.uint8))
        z = tl.div_rn(x - mean[None, :], scale[None, :])
    else:
        z = x

    # -- outlier slots: the FILL (<= S) largest deviations beyond tau robust std leave the fit --------
    if S > 0:
        row_mean, row_std = _robust_moments_all(z, N)
        dev = tl.abs(z - row_mean)
        chosen = _choose_slots(dev, dev > tau * row_std, FILL)
        keep = ~chosen
    else:
        keep = z == z  # all (z is finite)

    # -- codebook: calibrated, or weighted 1-D k-means from the kept elements' quantiles -----------
    if CALIBRATED:
        cb = cb_ptr + (row % HEADS) * 4
        c0 = tl.load(cb)
        c1 = tl.load(cb + 1)
        c2 = tl.load(cb + 2)
        c3 = tl.load(cb + 3)
    else:
        count = _total(keep.to(tl.int32))
        c0, c1, c2, c3 = _quartile_starts(z, keep, count)
        for _ in range(ITERS):
            code = _nearest(z, c0, c1, c2, c3)
            w = _fit_weight(z, keep, KEY)
            zw = z * w
            s0 = _total(tl.where(code == 0, zw, 0.0))
            n0 = _total(tl.where(code == 0, w, 0.0))
            s1 = _total(tl.where(code == 1, zw, 0.0))
            n1 = _total(tl.where(code == 1, w, 0.0))
            s2 = _total(tl.where(code == 2, zw, 0.0))
            n2 = _total(tl.where(code == 2, w, 0.0))
            s3 = _total(tl.where(code == 3, zw, 0.0))
            n3 = _total(tl.where(code == 3, w, 0.0))
            c0 = tl.where(n0 > 0, tl.div_rn(s0, tl.maximum(n0, 1e-12)), c0)
            c1 = tl.where(n1 > 0, tl.div_rn(s1, tl.maximum(n1, 1e-12)), c1)
            c2 = tl.where(n2 > 0, tl.div_rn(s2, tl.maximum(n2, 1e-12)), c2)
            c3 = tl.where(n3 > 0, tl.div_rn(s3, tl.maximum(n3, 1e-12)), c3)
        c0 = tl.where(count > 0, c0, 0.0)
        c1 = tl.where(count > 0, c1, 0.0)
        c2 = tl.where(count > 0, c2, 0.0)
        c3 = tl.where(count > 0, c3, 0.0)
        # sorted (Lloyd keeps the order; the reference sorts anyway), as stored: fp16
        a0, a1 = tl.minimum(c0, c1), tl.maximum(c0, c1)
        a2, a3 = tl.minimum(c2, c3), tl.maximum(c2, c3)
        b0, b2 = tl.minimum(a0, a2), tl.maximum(a0, a2)
        b1, b3 = tl.minimum(a1, a3), tl.maximum(a1, a3)
        c0 = b0.to(tl.float16)
        c1 = tl.minimum(b1, b2).to(tl.float16)
        c2 = tl.maximum(b1, b2).to(tl.float16)
        c3 = b3.to(tl.float16)
        i4 = tl.arange(0, 4)
        cents = tl.where(i4 == 0, c0, tl.where(i4 == 1, c1, tl.where(i4 == 2, c2, c3)))
        tl.store((slab + CENT_OFF).to(tl.pointer_type(tl.float16), bitcast=True) + i4, cents)
        c0 = c0.to(tl.float32)
        c1 = c1.to(tl.float32)
        c2 = c2.to(tl.float32)
        c3 = c3.to(tl.float32)

    # -- outlier values, in units of the largest |centroid|, in position order ----------------------
    if S > 0:
        unit = tl.maximum(tl.maximum(tl.maximum(tl.abs(c0), tl.abs(c1)), tl.maximum(tl.abs(c2), tl.abs(c3))), 1e-6)
        chosen_i = chosen.to(tl.int32)
        slot = _flat_rank(chosen_i) - 1
        _, val_byte = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(z, unit), -448.0), 448.0))
        pos = t[:, None] * D + ch[None, :]
        tl.store(slab + OVAL_OFF + slot, val_byte.to(tl.uint8), mask=chosen)
        idx_ptr = (slab + OIDX_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        tl.store(idx_ptr + slot, pos.to(tl.uint16), mask=chosen)
        i = tl.arange(0, S_PAD)
        used = _total(chosen_i)
        tl.store(idx_ptr + i, tl.full([S_PAD], 0xFFFF, tl.int32).to(tl.uint16), mask=(i >= used) & (i < S))

    # -- codes: nearest centroid, 4 per byte (channel s*D/4 + j in bits 2s..2s+1 of byte j) ----------
    code = _nearest(z, c0, c1, c2, c3)
    quarters = tl.reshape(code, (P, 4, D // 4))
    shift = (2 * tl.arange(0, 4))[None, :, None]
    packed = tl.sum(quarters << shift, axis=1)  # [P, D/4]: the four 2-bit fields do not overlap
    j = tl.arange(0, D // 4)
    tl.store(slab + t[:, None] * (D // 4) + j[None, :], packed.to(tl.uint8))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def can_quantize(block_size: int, head_dim: int) -> bool:
    """Shapes the kernel takes: power-of-two pages and head dims (Triton's block shapes), with at
    least 4 channels (one code byte) and no more than 16384 elements a slab (registers)."""
    return _pow2(block_size) and _pow2(head_dim) and head_dim >= 4 and block_size * head_dim <= 16384


def nuq2_quantize_packed(x: torch.Tensor, kind: str, layout, slots: int, tau: float, iters: int,
                         centroids: torch.Tensor | None = None, num_warps: int | None = None,
                         fill: int | None = None) -> torch.Tensor:
    """Full pages x [n, Hkv, P, D] (any float dtype; read as fp32) -> packed slabs [n, Hkv, slab_bytes]
    uint8, as `layout.pack(NUQ2Format.quantize(x, kind))` would give (see the module docstring for
    where they may differ). centroids: the calibrated codebook [Hkv, 4] (fp32), or None for per-page
    k-means; fill: the most slots filled (NUQ2Format.outlier_cap; None: all `slots`). x must be finite (the
    callers check or flag it first)."""
    n, H, P, D = x.shape
    fill = slots if fill is None else fill
    if slots and not 1 <= fill <= slots:
        raise ValueError(f"nuq2_quantize_packed: fill={fill} must lie in [1, slots={slots}]")
    if not can_quantize(P, D):
        raise ValueError(f"nuq2_quantize_packed needs power-of-two block_size and head_dim with P*D <= 16384, "
                         f"got P={P}, D={D}")
    rows = x.contiguous().reshape(n * H, P * D)
    slab = torch.zeros(n * H, layout.slab_bytes, dtype=torch.uint8, device=x.device)
    if n * H == 0:
        return slab.reshape(n, H, -1)
    off = layout.offsets
    calibrated = centroids is not None
    cb = centroids.float().contiguous() if calibrated else slab  # (unused pointer when not calibrated)
    _nuq2_quantize_kernel[(n * H,)](
        rows, slab, cb, P * D, layout.slab_bytes, float(tau), H,
        P=P, D=D, KEY=kind == "key", S=slots, FILL=fill, S_PAD=triton.next_power_of_2(max(slots, 1)),
        CALIBRATED=calibrated, ITERS=iters,
        MEAN_OFF=off.get("chan_mean", 0), SCALE_OFF=off.get("chan_scale", 0), CENT_OFF=off.get("centroids", 0),
        OVAL_OFF=off.get("out_val", 0), OIDX_OFF=off.get("out_idx", 0),
        num_warps=num_warps or (8 if P * D >= 4096 else 4))
    return slab.reshape(n, H, -1)
