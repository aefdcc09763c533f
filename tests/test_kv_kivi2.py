"""kivi2 KV format: round-trip error on structured inputs, exact cases, refusals, bit accounting, the
16-bit residual window, engine."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.kvcache import roundtrip
from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.kivi2 import KIVI2Format
from tests.checkpoints import check_batch_matches_alone
from tests.kv_formats import step_context

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14, 15, 16, 20, 21, 22, 23,
            24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35], [9, 8, 7], [250, 3, 3, 3, 3, 31, 64], [40] * 17]


def rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float((x_hat - x).norm() / x.norm())


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- round-trip error ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("block_size", [32, 64])
def test_gaussian_error_is_that_of_two_bits(kind, block_size):
    x = gaussian(128 + 5, 2, 64)
    x_hat, _ = roundtrip("kivi2", x, kind, block_size=block_size)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert rel_err(x_hat, x) < 0.42  # 4 levels over a group's range: ~0.39 on gaussians


def test_keys_per_channel_survive_outlier_channels():
    """Outlier channels stretch a per-token step (values) but not a per-channel one (keys): on keys
    with a few huge channels, the ordinary channels keep their 2-bit accuracy only along channels."""
    x = gaussian(64, 2, 64, seed=1)
    outliers = [3, 40]
    x[:, :, outliers] *= 30
    normal = [c for c in range(64) if c not in outliers]
    per_channel, _ = roundtrip("kivi2", x, "key", block_size=32)
    per_token, _ = roundtrip("kivi2", x, "value", block_size=32)
    assert rel_err(per_channel[..., normal], x[..., normal]) < 0.42
    assert rel_err(per_token[..., normal], x[..., normal]) > 0.9  # crushed to the group's floor


@pytest.mark.parametrize("kind", ["key", "value"])
def test_heavy_tails(kind):
    x = torch.distributions.StudentT(3.0).sample((64, 2, 64))
    x_hat, _ = roundtrip("kivi2", x, kind, block_size=32)
    assert rel_err(x_hat, x) < 0.7


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_constant_and_zero_pages_round_trip_exactly(kind, dtype):
    zero = torch.zeros(64, 2, 32)
    constant = torch.full((64, 2, 32), 1.5)
    per_channel = (torch.arange(2 * 32).reshape(1, 2, 32).float() / 8 - 4).expand(64, 2, 32)  # key slices
    per_token = (torch.arange(64 * 2).reshape(64, 2, 1).float() / 8 - 8).expand(64, 2, 32)  # value slices
    for x in (zero, constant, per_channel if kind == "key" else per_token):
        x = x.to(dtype)
        x_hat, _ = roundtrip("kivi2", x, kind, block_size=32)
        assert torch.equal(x_hat, x)


def test_codes_pack_four_per_byte_with_uniform_shifts():
    fmt = KIVI2Format()
    x = (torch.arange(32) % 4).float().expand(1, 1, 32, 32).clone()  # per-token range 0..3: code == value
    codes = (torch.arange(32) % 4).to(torch.uint8)
    packed = fmt.quantize(x, "value")["codes"][0, 0, 0]  # [D/4]
    assert torch.equal(packed, codes[0::4] | codes[1::4] << 2 | codes[2::4] << 4 | codes[3::4] << 6)


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(bad):
    x = gaussian(32, 2, 32)
    x[7, 0, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip("kivi2", x, "value", block_size=32)


@pytest.mark.parametrize("block_size", [16, 48])
def test_block_size_not_a_multiple_of_32_is_refused(block_size):
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        roundtrip("kivi2", gaussian(64, 2, 32), "key", block_size=block_size)


def test_head_dim_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="head_dim=48"):
        roundtrip("kivi2", gaussian(64, 2, 48), "value", block_size=32)


@pytest.mark.parametrize("options", [{"residual": 20}, {"residual": -32}, {"kivi_residual": 33},
                                     {"residual": 32, "kivi_residual": 64}])
def test_bad_residual_is_refused(options):
    with pytest.raises(ValueError, match="residual"):
        get_kv_format("kivi2", **options)


# -- bit accounting --------------------------------------------------------------------------------
@pytest.mark.parametrize("P, D", [(32, 32), (64, 32), (32, 128), (64, 128)])
def test_layout_bytes(P, D):
    fmt = KIVI2Format()
    codes = P * D // 4
    key, value = fmt.layout("key", P, D), fmt.layout("value", P, D)
    assert key.used_bytes == codes + 2 * 2 * (P // 32) * D  # fp16 scale and min per (token group, channel)
    assert value.used_bytes == codes + 2 * 2 * P * (D // 32)  # ... per (token, channel group)
    assert key.slab_bytes == key.used_bytes and value.slab_bytes == value.used_bytes  # whole 128-byte lines
    assert fmt.bits_per_element(2, P, D) == 3.0


@pytest.mark.parametrize("D, bits", [(128, 2.5), (64, 2.5), (32, 2.75)])
def test_group_64_halves_the_side_data(D, bits):
    """G = 64: keys per channel over 64 tokens, values per token over 64 channels (the whole head
    when it is narrower), so a 128-wide head pays 2.5 bits instead of 3."""
    fmt = KIVI2Format(group_size=64)
    assert fmt.bits_per_element(2, 64, D) == bits
    x = gaussian(128, 2, D)
    for kind in ("key", "value"):
        x_hat, _ = roundtrip("kivi2", x, kind, block_size=64, group_size=64, residual=0)
        err = float((x_hat - x).pow(2).sum() / x.pow(2).sum())
        assert 0.05 < err < 0.25  # coarser than G = 32 (~0.15 on Gaussians), still a 2-bit code
    with pytest.raises(ValueError, match="block_size=32 must be a multiple of 64"):
        fmt.layout("key", 32, D)
    with pytest.raises(ValueError, match="group_size=16"):
        KIVI2Format(group_size=16)


@pytest.mark.parametrize("T", [64, 64 + 9])
def test_roundtrip_bits_count_every_slab_byte(T):
    H, P, D = 2, 32, 64
    _, bits = roundtrip("kivi2", gaussian(T, H, D), "key", block_size=P)
    full, tail = divmod(T, P)
    slab = KIVI2Format().layout("key", P, D).slab_bytes
    assert bits == pytest.approx((8 * full * H * slab + 16 * tail * H * D) / (T * H * D), rel=1e-12)


def test_residual_ring_is_counted():
    fmt = KIVI2Format(residual=64)
    H, P, D, L = 2, 32, 32, 512
    ring = 2 * H * 64 * D * 2
    assert fmt.residual_bytes_per_seq(H, D) == ring
    assert fmt.staging_bytes_per_seq(H, P, D) == 2 * H * P * D * 2 + ring
    expected = 8 * ((L // P) * fmt.page_bytes(H, P, D) + fmt.staging_bytes_per_seq(H, P, D)) / (2 * L * H * D)
    assert fmt.bits_per_element_at(L, H, P, D) == pytest.approx(expected)
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 3, torch.float32)
    assert cache["k_residual"].shape == (3, H, 64, D) and cache["k_residual"].dtype == torch.bfloat16


# -- the residual window through write/gather ------------------------------------------------------
@pytest.mark.parametrize("block_size, residual", [(32, 0), (32, 32), (32, 64), (64, 32), (64, 96)])
def test_newest_tokens_are_read_in_16_bit(block_size, residual):
    """Two sequences in slots 2 and 0 are prefilled in chunks, then decode across page boundaries;
    after every step the last `residual` tokens, and the newest page (staged even when full), read
    back exactly (16-bit), older ones as the quantized pages give them."""
    H, P, D, fmt = 2, block_size, 32, KIVI2Format(residual=residual)
    cache = fmt.allocate(8, H, P, D, torch.device("cpu"), 3, torch.float32)
    x = {s: gaussian(100, H, D, seed=s).bfloat16().float() for s in (2, 0)}  # staging is bf16: start from bf16
    tables = {2: [5, 1, 7, 3], 0: [0, 2, 4, 6]}
    steps = [(0, 40), (40, 63), (63, 64), (64, 65), (65, 97), (97, 98)]
    for lo, hi in steps:
        ctx = step_context([(s, tables[s], lo, hi) for s in (2, 0)], P)
        fmt.write(cache, torch.cat([x[s][lo:hi] for s in (2, 0)]), torch.cat([-x[s][lo:hi] for s in (2, 0)]), ctx)
        for b, s in enumerate((2, 0)):
            for kind, sign in (("key", 1), ("value", -1)):
                got = fmt.gather(cache, ctx, b, hi, kind)
                want, _ = roundtrip("kivi2", sign * x[s][:hi], kind, block_size=P)
                cut = min(hi - min(hi, residual), ((hi - 1) // P) * P)
                assert got.shape == (hi, H, D)
                assert torch.equal(got[:cut], want[:cut])
                assert torch.equal(got[cut:], sign * x[s][cut:hi])


# -- engine ----------------------------------------------------------------------------------------
def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_engine_generates_with_quantized_pages(hd32_ckpt):
    # a 32-token window under max_model_len=64, so attention reads quantized pages
    llm = LLM(hd32_ckpt, kv_cache_dtype="kivi2", block_size=32, max_model_len=64, dtype="float32", kv_residual=32)
    assert llm.engine.runner.kv_format.residual == 32
    batched = check_batch_matches_alone(llm, PROMPTS, GREEDY)
    assert all(len(t) == 24 for t in batched)


def test_engine_window_covering_the_context_reads_what_bf16_reads(hd32_ckpt):
    """With the default 128-token window and max_model_len=64 every token is read from the 16-bit
    ring, so the tokens are those of the bf16 cache exactly."""
    kivi = LLM(hd32_ckpt, kv_cache_dtype="kivi2", block_size=32, max_model_len=64, dtype="float32")
    bf16 = LLM(hd32_ckpt, kv_cache_dtype="bf16", block_size=32, max_model_len=64, dtype="float32")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert token_ids(kivi.generate(prompts, GREEDY)) == token_ids(bf16.generate(prompts, GREEDY))
    bm = kivi.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
