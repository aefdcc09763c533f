"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints ship them: dequantized on load
(`dequantize_mxfp4`, the reference), or kept as a QuantizedWeight of kind "mxfp4" (`mxfp4_weight`:
the same bytes, read by the fused MoE kernels of ops/fused_moe_quant.py).

A weight [..., N, K] is stored as `<name>_blocks` uint8 [..., N, K / 32, 16] (32 FP4 E2M1 codes per
group, two per byte, the low nibble first) and `<name>_scales` uint8 [..., N, K / 32] (one E8M0
exponent per group, biased by 127): value = FP4_VALUES[code] * 2 ** (scale - 127).
"""
from __future__ import annotations

import sys

import torch

from moekv.ops.quantized_weight import MXFP4_GROUP, MXFP4_VALUES, QuantizedWeight

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"

FP4_VALUES = MXFP4_VALUES  # E2M1 codes 0..15: sign bit 3, then exponent 2 bits and mantissa 1 bit
GROUP = MXFP4_GROUP  # values per scale
# the kernels fold 2^14 into each scale (ops/quant_tiles.e8m0_scales): larger exponents would overflow
# fp32; a real weight group is nowhere near 2^113
MAX_KERNEL_SCALE = 240


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"accepted blocks [..., N, G, {GROUP // 2}] with scales [..., N, G]")


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> the QuantizedWeight "mxfp4" of the
    [..., N, G * 32] weight they hold, sharing no memory with them: codes the bytes viewed as int32
    [..., N, G * 4] (little-endian: the INT4 nibble order, ops/quantized_weight.py), scales as they are."""
    _check_pair(blocks, scales)
    if sys.byteorder != "little":  # the int32 view's nibble order assumes it (as every GPU is)
        raise RuntimeError("MXFP4 codes are viewed as little-endian int32 words; this host is big-endian")
    if scales.numel() and int(scales.max()) > MAX_KERNEL_SCALE:
        raise ValueError(f"an MXFP4 scale exponent of {int(scales.max())} (2^{int(scales.max()) - 127}) is beyond "
                         f"the kernels' range (at most {MAX_KERNEL_SCALE}, 2^{MAX_KERNEL_SCALE - 127})")
    *prefix, G, B = blocks.shape
    codes = blocks.reshape(*prefix, G * B).contiguous().view(torch.int32)
    return QuantizedWeight("mxfp4", (*prefix, G * GROUP), codes.clone(), scales.contiguous().clone(), (1, GROUP))


def empty_mxfp4(shape: tuple[int, ...], device: torch.device | str = "meta") -> QuantizedWeight:
    """An uninitialised QuantizedWeight "mxfp4" of a [..., N, K] weight (K a multiple of 32)."""
    *prefix, N, K = shape
    if K % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension a multiple of {GROUP}, got {tuple(shape)}")
    return QuantizedWeight("mxfp4", tuple(shape), torch.empty(*prefix, N, K // 8, dtype=torch.int32, device=device),
                           torch.empty(*prefix, N, K // GROUP, dtype=torch.uint8, device=device), (1, GROUP))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> [..., N, G * 32] in dtype (exact:
    every FP4 value times a power of two is representable in bf16 / fp32 within their exponent
    range). Chunked over rows so the int64 codes of a 120b layer never exist at once."""
    _check_pair(blocks, scales)
    *prefix, G, B = blocks.shape
    flat_blocks = blocks.reshape(-1, B)
    exponents = scales.reshape(-1, 1).to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], 2 * B, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat_blocks.shape[0], rows_per_chunk):
        chunk = flat_blocks[r0:r0 + rows_per_chunk]
        values = torch.stack((lut[(chunk & 0x0F).long()], lut[(chunk >> 4).long()]), dim=-1).reshape(chunk.shape[0], -1)
        out[r0:r0 + rows_per_chunk] = torch.ldexp(values, exponents[r0:r0 + rows_per_chunk]).to(dtype)
    return out.reshape(*prefix, G * 2 * B)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (K a multiple of 32) -> (blocks, scales) as above: each group's exponent
    makes its largest magnitude at most 6 (FP4's largest), codes round to the nearest FP4 value.
    For building test checkpoints and measuring the format's error; not a production quantizer."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension a multiple of {GROUP}, got {tuple(weight.shape)}")
    *prefix, K = weight.shape
    groups = weight.float().reshape(*prefix, K // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8], device=weight.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    codes |= ((scaled < 0).to(torch.uint8) << 3) * (codes > 0).to(torch.uint8)
    pairs = codes.reshape(*prefix, K // GROUP, GROUP // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)
