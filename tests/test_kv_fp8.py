"""fp8_e4m3: FP8 codes with a per-(token, head) scale."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.kvcache import get_kv_format, roundtrip


def test_roundtrip_error_is_fp8_rounding():
    x = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(0)) * 3
    x[:, :, 5] *= 50  # an outlier channel only costs resolution within its own token's scale
    x_hat, bits = roundtrip("fp8_e4m3", x, "key", block_size=16)
    amax = x.abs().amax(-1, keepdim=True)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal values, plus the fp16 scale
    assert ((x_hat - x).abs() <= x.abs() * 2**-4 + amax * 2**-9 + 1e-6).all()
    assert bits == pytest.approx(8 * get_kv_format("fp8_e4m3").layout("key", 16, 32).slab_bytes * 2 / (16 * 2 * 32))


def test_zeros_exact_and_nan_refused():
    x_hat, _ = roundtrip("fp8_e4m3", torch.zeros(16, 2, 32), "value", block_size=16)
    assert (x_hat == 0).all()
    x = torch.randn(16, 2, 32)
    x[3, 1, 4] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip("fp8_e4m3", x, "value", block_size=16)


def test_partial_page_stays_16_bit():
    x = torch.randn(20, 2, 32)
    x_hat, bits = roundtrip("fp8_e4m3", x, "key", block_size=16)
    assert torch.equal(x_hat[16:], x[16:].to(torch.bfloat16).float())
    fmt = get_kv_format("fp8_e4m3")
    assert bits == pytest.approx((16 * 64 * fmt.bits_per_element(2, 16, 32) + 4 * 64 * 16) / (20 * 64))


def test_greedy_tokens_follow_bf16_on_the_tiny_model():
    """On the trained model, 16 greedy tokens with the fp8 cache equal the bf16 cache's for most
    prompts; a near-tie can flip one late token, so the check allows one prompt to diverge late."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["It was a dark and stormy night", "ROMEO:", "The prince said to Natasha that",
               "Anna Karenina looked at him and", "Raskolnikov walked out into the street"]
    ref = [o.outputs[0].token_ids for o in LLM(kv_cache_dtype="bf16").generate(prompts, sp)]
    fp8 = [o.outputs[0].token_ids for o in LLM(kv_cache_dtype="fp8_e4m3").generate(prompts, sp)]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), 16) for r, f in zip(ref, fp8)]
    assert sum(n == 16 for n in same_prefix) >= 4 and min(same_prefix) >= 8, same_prefix
