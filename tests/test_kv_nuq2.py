"""nuq2: 2-bit codes into a per-page 4-centroid k-means codebook, FP8 outliers with positions."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.kvcache import get_kv_format, roundtrip


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def pages(seed, tokens=128, heads=2, dim=32):
    return torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["key", "value"])
def test_gaussian_error_is_that_of_a_4_level_code(kind):
    x = pages(0)
    x_hat, bits = roundtrip("nuq2", x, kind, block_size=64)
    # an optimal 4-level quantizer of a gaussian has relative RMS error ~0.34; outliers help a little
    assert rel_err(x_hat, x) < 0.36
    assert bits <= 3.0  # codes 2 bits + stats/centroids/outlier slots, padded to 128-byte lines


def test_key_outlier_channels_are_normalised_away():
    """Keys with a few channels 20x larger: per-channel normalisation keeps the small ones usable."""
    x = pages(1)
    x[..., [3, 17]] *= 20
    x[..., [3, 17]] += 5
    x_hat, _ = roundtrip("nuq2", x, "key", block_size=64)
    small = [c for c in range(32) if c not in (3, 17)]
    assert rel_err(x_hat[..., small], x[..., small]) < 0.45


def test_heavy_tails_go_to_fp8_slots():
    t = torch.distributions.StudentT(2.0).sample((128, 2, 32))
    x_hat, _ = roundtrip("nuq2", t, "value", block_size=64)
    big = t.abs() > 8 * t.std()
    assert big.any()
    # the largest elements come back at FP8 precision (3 mantissa bits), not at 2-bit precision
    assert ((x_hat[big] - t[big]).abs() / t[big].abs()).max() < 0.15


def test_zeros_and_constant_pages_are_exact():
    for x in (torch.zeros(64, 2, 32), torch.full((64, 2, 32), 0.75)):
        for kind in ("key", "value"):
            x_hat, _ = roundtrip("nuq2", x, kind, block_size=64)
            assert torch.isfinite(x_hat).all()
            assert (x_hat - x).abs().max() < 1e-3


def test_non_finite_input_is_refused():
    x = pages(2)
    x[5, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip("nuq2", x, "key", block_size=64)


def test_bits_count_every_slab_byte():
    fmt = get_kv_format("nuq2")
    x = pages(3, tokens=128)
    _, bits = roundtrip("nuq2", x, "key", block_size=64)
    slab = fmt.layout("key", 64, 32).slab_bytes
    assert bits == pytest.approx(8 * slab * 2 * 2 / x.numel())
    assert slab % 128 == 0
    pages_bytes = 2 * (fmt.layout("key", 64, 32).slab_bytes + fmt.layout("value", 64, 32).slab_bytes)
    assert fmt.bits_per_element(2, 64, 32) == pytest.approx(8 * pages_bytes / (2 * 64 * 2 * 32))
    assert fmt.bits_per_element(2, 64, 128) <= 2.5  # wider heads amortise the per-channel stats


def test_engine_generates_and_frees_pages(mixtral_ckpt):
    llm = LLM(mixtral_ckpt, dtype="float32", kv_cache_dtype="nuq2", max_model_len=128, block_size=64)
    prompts = [{"prompt_token_ids": [(5 * i) % 300 + 2 for i in range(n)]} for n in (70, 90, 5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
