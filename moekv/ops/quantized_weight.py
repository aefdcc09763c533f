"""Weight-only quantized matrices: codes + scales (+ zero points) + their layout, and the
plain-PyTorch dequantization that every kernel reading them is checked against.

A `QuantizedWeight` stands in for a weight tensor of logical shape [*batch, N, K] (N = output
features, K = input features; batch = [E] for stacked experts, none for a projection). Element
(n, k) is

    fp8:   codes[n, k] (float8_e4m3fn) * scales[n // SN, k // SK]
    int4:  (code(n, k) - zero) * scales[n // SN, k // SK]
    mxfp4: MXFP4_VALUES[code(n, k)] * 2 ** (scales[n, k // 32] - 127)

with (SN, SK) = `scale_block`: (1, K) per output channel, (128, 128) DeepSeek-V3-style blocks, (1, G)
int4 groups of G input features. Scales are stored [*batch, ceil(N / SN), ceil(K / SK)]; a partial
last block or group is allowed (the kernels mask it).

INT4 packing (`codes` int32 [*batch, N, K / 8], K % 8 == 0): eight consecutive input features per
int32, feature 8j + i in bits 4i .. 4i + 3 (the lowest nibble first), codes unsigned 0..15. This is
compressed-tensors' `pack-quantized` order (its int32 `weight_packed` [N, K / 8]); GPTQ's qweight
[K / 8, N] packs the same nibble order along K and is transposed on load. Symmetric INT4 has the
implicit zero point 8 (`zeros` None); with zero points, `zeros` [*batch, N, ceil(K / G)] holds them
in code units (float, the scales' dtype).

MXFP4 (OCP microscaling FP4, gpt-oss's experts as their checkpoints ship them: models/mxfp4.py): E2M1
codes (sign bit 3, two exponent bits, one mantissa bit) two per byte, the low nibble first, and one
E8M0 exponent (uint8, biased by 127) per group of 32 input features: scale_block (1, 32), scales
uint8 [*batch, N, K / 32]. The codes are the checkpoint's bytes [*batch, N, K / 2] viewed as int32
[*batch, N, K / 8] (little-endian): feature 8j + i is then in bits 4i .. 4i + 3 of word j, the INT4
order, so the kernels unpack both alike. Read from checkpoints only (no quantize-on-load).

Shape legend: E = experts, N = output features, K = input features, G = int4 group size.
"""
from __future__ import annotations

import torch
from torch import nn

QUANT_METHODS = ("fp8", "int4")  # quantize-on-load's methods (`quantization=`)
WEIGHT_METHODS = (*QUANT_METHODS, "mxfp4")  # what a QuantizedWeight holds (mxfp4: read from checkpoints)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP = 128
INT4_SYMMETRIC_ZERO = 8
_NIBBLE_SHIFTS = torch.arange(8, dtype=torch.int32) * 4  # feature 8j + i -> bits 4i..4i+3
MXFP4_GROUP = 32  # input features per E8M0 scale
E8M0_BIAS = 127
# E2M1 codes 0..15: sign bit 3, then exponent 2 bits and mantissa 1 bit
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class QuantizedWeight(nn.Module):
    """A quantized [*batch, N, K] weight (see the module docstring for the layout). Its tensors are
    buffers, so `.to(device)` moves them; `shape` is the logical (dequantized) shape."""

    def __init__(self, method: str, shape: tuple[int, ...], codes: torch.Tensor, scales: torch.Tensor,
                 scale_block: tuple[int, int], zeros: torch.Tensor | None = None) -> None:
        super().__init__()
        if method not in WEIGHT_METHODS:
            raise ValueError(f"quantization method {method!r} is unknown; accepted: {list(WEIGHT_METHODS)}")
        *batch, N, K = shape
        SN, SK = scale_block
        packed_k = K // 8 if method in ("int4", "mxfp4") else K
        if method == "int4" and (K % 8 or codes.dtype != torch.int32):
            raise ValueError(f"int4 weights pack 8 input features per int32: K={K} must be a multiple of 8 and "
                             f"codes int32 (got {codes.dtype})")
        if method == "mxfp4" and (K % MXFP4_GROUP or codes.dtype != torch.int32 or scales.dtype != torch.uint8
                                  or (SN, SK) != (1, MXFP4_GROUP) or zeros is not None):
            raise ValueError(f"mxfp4 weights hold int32 codes (8 E2M1 codes a word), uint8 E8M0 scales, one per "
                             f"(1, {MXFP4_GROUP}) block, no zero points, K a multiple of {MXFP4_GROUP}; got K={K}, "
                             f"codes {codes.dtype}, scales {scales.dtype}, scale_block {scale_block}")
        if method == "fp8" and codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 weights hold float8_e4m3fn codes, got {codes.dtype}")
        if tuple(codes.shape) != (*batch, N, packed_k):
            raise ValueError(f"{method} codes have shape {tuple(codes.shape)}, the weight {tuple(shape)} needs "
                             f"{(*batch, N, packed_k)}")
        scale_shape = (*batch, -(-N // SN), -(-K // SK))
        if tuple(scales.shape) != scale_shape:
            raise ValueError(f"{method} scales have shape {tuple(scales.shape)}, blocks {scale_block} of "
                             f"{tuple(shape)} need {scale_shape}")
        if zeros is not None and (method != "int4" or tuple(zeros.shape) != scale_shape):
            raise ValueError(f"zero points are for int4 weights, shaped as the scales {scale_shape}; got "
                             f"{method} with zeros {tuple(zeros.shape)}")
        self.method = method
        self.shape = torch.Size(shape)
        self.scale_block = (SN, SK)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous())

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes a full read of the weight streams: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def extra_repr(self) -> str:
        zeros = ", zero points" if self.zeros is not None else ""
        return f"{self.method}, shape={tuple(self.shape)}, scale_block={self.scale_block}{zeros}"

    def __getitem__(self, index: int) -> QuantizedWeight:
        """The matrix of one batch entry (one expert of a stacked [E, N, K] weight); a view."""
        if len(self.shape) < 3:
            raise IndexError("a QuantizedWeight of one matrix has no batch dimension to index")
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedWeight(self.method, tuple(self.shape[1:]), self.codes[index], self.scales[index],
                               self.scale_block, zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [*batch, N, K] weight it stands for, computed in fp32 and cast to dtype (the reference)."""
        *batch, N, K = self.shape
        SN, SK = self.scale_block
        if self.method == "fp8":
            values = self.codes.float()
        elif self.method == "mxfp4":
            lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=self.codes.device)
            values = lut[unpack_int4(self.codes).long()]
            scales = torch.exp2(self.scales.float() - E8M0_BIAS)  # exact: every E8M0 value is an fp32
            return (values * _expand(scales, SN, SK, N, K)).to(dtype)
        else:
            values = unpack_int4(self.codes).float()
            zeros = (torch.full_like(self.scales, INT4_SYMMETRIC_ZERO, dtype=torch.float32) if self.zeros is None
                     else self.zeros.float())
            values = values - _expand(zeros, SN, SK, N, K)
        return (values * _expand(self.scales.float(), SN, SK, N, K)).to(dtype)


def _expand(blocks: torch.Tensor, SN: int, SK: int, N: int, K: int) -> torch.Tensor:
    """[*, ceil(N/SN), ceil(K/SK)] per-block values -> [*, N, K] per element."""
    return blocks.repeat_interleave(SN, dim=-2)[..., :N, :].repeat_interleave(SK, dim=-1)[..., :K]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes [*, K] (0..15, any integer dtype, K % 8 == 0) -> int32 [*, K / 8] (module docstring)."""
    *lead, K = codes.shape
    if K % 8:
        raise ValueError(f"int4 packing takes 8 features per int32: K={K} is not a multiple of 8")
    nibbles = codes.to(torch.int64).reshape(*lead, K // 8, 8) & 0xF
    words = (nibbles << _NIBBLE_SHIFTS.to(codes.device, torch.int64)).sum(-1)  # < 2**32
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [*, K / 8] -> unsigned codes uint8 [*, K] (the inverse of pack_int4)."""
    *lead, words = packed.shape
    nibbles = (packed[..., None] >> _NIBBLE_SHIFTS.to(packed.device)) & 0xF  # [*, K/8, 8]
    return nibbles.reshape(*lead, words * 8).to(torch.uint8)


def _block_amax(w: torch.Tensor, SN: int, SK: int) -> torch.Tensor:
    """max |w| over each (SN, SK) block of the last two dims (partial edge blocks included)."""
    *batch, N, K = w.shape
    pad_n, pad_k = -N % SN, -K % SK
    a = torch.nn.functional.pad(w.abs(), (0, pad_k, 0, pad_n))
    a = a.reshape(*batch, (N + pad_n) // SN, SN, (K + pad_k) // SK, SK)
    return a.amax(dim=(-3, -1))


@torch.no_grad()
def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> QuantizedWeight:
    """Round-to-nearest e4m3 with fp32 scales: one per output channel (block None) or per (SN, SK)
    block, each the block's max |w| / 448."""
    *_, N, K = w.shape
    SN, SK = block or (1, K)
    w32 = w.float()
    scales = (_block_amax(w32, SN, SK) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (w32 / _expand(scales, SN, SK, N, K)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", tuple(w.shape), codes, scales, (SN, SK))


@torch.no_grad()
def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP, zero_point: bool = False,
                  scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest INT4 in groups of group_size input features. Symmetric: scale = max |w| / 7,
    codes q + 8 with q in -7..7. With zero points: scale = (max - min) / 15, zero = round(-min / scale)
    in 0..15. Scales (and zeros) in scale_dtype (default: w's dtype when 16-bit, else fp32)."""
    *batch, N, K = w.shape
    if group_size < 8 or group_size % 8:
        raise ValueError(f"int4 group_size={group_size} must be a positive multiple of 8")
    scale_dtype = scale_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32)
    w32 = w.float()
    pad_k = -K % group_size
    groups = torch.nn.functional.pad(w32, (0, pad_k)).reshape(*batch, N, (K + pad_k) // group_size, group_size)
    tiny = torch.finfo(torch.float32).tiny
    if zero_point:
        lo = groups.amin(-1).clamp_max(0.0)
        hi = groups.amax(-1).clamp_min(0.0)
        scales = ((hi - lo) / 15).clamp_min(tiny).to(scale_dtype)
        zeros = (-lo / scales.float()).round().clamp(0, 15).to(scale_dtype)
    else:
        scales = (groups.abs().amax(-1) / 7).clamp_min(tiny).to(scale_dtype)
        zeros = None
    z = INT4_SYMMETRIC_ZERO if zeros is None else zeros.float()[..., None]
    q = (groups / scales.float()[..., None]).round() + z
    q = q.clamp(0, 15).reshape(*batch, N, K + pad_k)[..., :K]
    return QuantizedWeight("int4", tuple(w.shape), pack_int4(q), scales, (1, group_size), zeros)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    """Quantize-on-load for `quantization=method`: fp8 per output channel; int4 in groups of 128 with
    zero points (on domain-moe's held-out drama, +3.2% perplexity against +6.3% symmetric:
    docs/decisions.md, "Quantize-on-load INT4 keeps zero points")."""
    if method == "fp8":
        return quantize_fp8(w)
    if method == "int4":
        return quantize_int4(w, zero_point=True)
    raise ValueError(f"quantization={method!r} is unknown; accepted: {list(QUANT_METHODS)}")
