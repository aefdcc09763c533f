"""QuantizedWeight (moekv/ops/quantized_weight.py): the documented layouts decoded by hand in float64,
the round-to-nearest quantizers' error bounds, and the bad-input errors.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_quantized_weight.py
"""
from __future__ import annotations

import pytest
import torch

from moekv.ops.quantized_weight import (
    QuantizedWeight,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    unpack_int4,
)
from moekv.ops.reference import fused_moe_ref, linear_ref


def test_int4_packing_is_the_documented_nibble_order():
    """Feature 8j + i lives in bits 4i..4i+3 of word j: written by hand, word by word."""
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 0, 9]])
    words = pack_int4(codes)
    want0 = sum(v << (4 * i) for i, v in enumerate([1, 2, 3, 4, 5, 6, 7, 15]))  # 0xF7654321
    want1 = 9 << 28
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() & 0xFFFFFFFF == want0 and words[0, 1].item() & 0xFFFFFFFF == want1
    assert torch.equal(unpack_int4(words).long(), codes)
    random = torch.randint(0, 16, (3, 5, 64))
    assert torch.equal(unpack_int4(pack_int4(random)).long(), random)


def _decode_by_hand(qw: QuantizedWeight) -> torch.Tensor:
    """Element by element from the module docstring's formula, float64, for a [N, K] weight."""
    N, K = qw.shape
    SN, SK = qw.scale_block
    out = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            s = qw.scales[n // SN, k // SK].double()
            if qw.method == "fp8":
                out[n, k] = qw.codes[n, k].double() * s
            else:
                code = (int(qw.codes[n, k // 8]) >> (4 * (k % 8))) & 0xF
                zero = 8.0 if qw.zeros is None else qw.zeros[n, k // SK].double()
                out[n, k] = (code - zero) * s
    return out


@pytest.mark.parametrize("make", [
    lambda w: quantize_fp8(w),
    lambda w: quantize_fp8(w, (4, 16)),
    lambda w: quantize_int4(w, 16),
    lambda w: quantize_int4(w, 16, zero_point=True),
    lambda w: quantize_int4(w[:, :40], 16, zero_point=True),  # a partial last group
], ids=["fp8-channel", "fp8-block", "int4-sym", "int4-zp", "int4-partial-group"])
def test_dequantize_matches_the_documented_layout(make):
    w = torch.randn(10, 48, generator=torch.Generator().manual_seed(0))
    qw = make(w)
    assert torch.allclose(qw.dequantize().double(), _decode_by_hand(qw), rtol=0, atol=1e-6)


def test_quantizers_error_bounds():
    """fp8: e4m3 keeps 3 mantissa bits (relative error <= 2^-4 above the subnormals); int4:
    round-to-nearest is within half a step of each group's scale."""
    w = torch.randn(3, 64, 256, generator=torch.Generator().manual_seed(1))
    fp8 = quantize_fp8(w)
    err = (fp8.dequantize() - w).abs()
    scale = fp8.scales.repeat_interleave(256, -1)
    assert (err <= w.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-7).all()
    for zero_point in (False, True):
        q = quantize_int4(w, 128, zero_point=zero_point)
        step = q.scales.float().repeat_interleave(128, -1)
        assert ((q.dequantize() - w).abs() <= step * 0.5 + 1e-6).all()
    block = quantize_fp8(w, (128, 128))
    assert block.scales.shape == (3, 1, 2)
    assert ((block.dequantize() - w).abs() <= w.abs() * 2 ** -4 + 2 ** -9 * block.scales.max() + 1e-7).all()


def test_nbytes_counts_codes_scales_and_zeros():
    w = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    assert quantize_fp8(w).nbytes == 2 * 64 * 256 + 2 * 64 * 4
    assert quantize_int4(w).nbytes == 2 * 64 * 128 + 2 * 64 * 2 * 2
    assert quantize_int4(w, zero_point=True).nbytes == 2 * 64 * 128 + 2 * 2 * 64 * 2 * 2


def test_expert_view_and_references():
    """qw[e] is expert e's matrix; the references run the dequantized weights."""
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(4, 32, 16, generator=g), torch.randn(4, 16, 16, generator=g)
    q13, q2 = quantize_int4(w13, 8, zero_point=True), quantize_fp8(w2)
    assert torch.equal(q13[2].dequantize(), q13.dequantize()[2])
    x = torch.randn(3, 16, generator=g)
    weights, ids = torch.rand(3, 2, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2]])
    want = fused_moe_ref(x, q13.dequantize(), q2.dequantize(), weights, ids)
    assert torch.equal(fused_moe_ref(x, q13, q2, weights, ids), want)
    bias = torch.randn(32, generator=g)
    assert torch.equal(linear_ref(x, q13[0], bias), torch.nn.functional.linear(x, q13[0].dequantize(), bias))


def test_bad_layouts_are_refused():
    codes = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="accepted"):
        QuantizedWeight("int8", (4, 16), codes, torch.ones(4, 1), (1, 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantizedWeight("int4", (4, 12), codes, torch.ones(4, 1), (1, 16))
    with pytest.raises(ValueError, match="scales have shape"):
        QuantizedWeight("int4", (4, 16), codes, torch.ones(4, 2), (1, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        QuantizedWeight("fp8", (4, 16), torch.zeros(4, 16), torch.ones(4, 1), (1, 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_int4(torch.randn(4, 16), group_size=12)
