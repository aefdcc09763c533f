"""nuq2: 2-bit non-uniform codes with FP8 outliers. Round trips on structured inputs, the exact
byte accounting of the slab, calibrated codebooks, and the engine end to end."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from moekv import LLM, SamplingParams
from moekv.kvcache.formats.interface import PAGE_ALIGN_BYTES
from moekv.kvcache.formats.nuq2 import NO_OUTLIER, NUQ2Format, fit_centroids, normalize, pack_codes, unpack_codes
from moekv.kvcache.formats.paged import FIELD_ALIGN_BYTES, PageLayout
from moekv.kvcache.roundtrip import roundtrip

FP8_REL = 2.0 ** -4  # E4M3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of it


def rel_mse(x_hat, x):
    return float((x_hat - x).pow(2).sum() / x.pow(2).sum())


def gaussian(tokens=256, heads=2, dim=32, seed=0):
    return torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(seed))


def align(n, a):
    return -(-n // a) * a


@pytest.fixture(scope="module")
def nuq2_calibration(tmp_path_factory):
    """head_dim -> a calibration folder with nuq2 codebooks fitted on Gaussian pages (layer 0, 1 head)."""
    root = tmp_path_factory.mktemp("nuq2cal")

    def make(D: int) -> str:
        folder = root / f"d{D}"
        if not folder.exists():
            folder.mkdir()
            pages = gaussian(512, 1, D, seed=5).reshape(8, 64, 1, D).transpose(1, 2)
            save_file({f"nuq2.layer0.{kind}.centroids": fit_centroids(pages, kind) for kind in ("key", "value")},
                      str(folder / "kv_calibration.safetensors"))
        return str(folder)
    return make


# -- codes --------------------------------------------------------------------------------------------
def test_codes_pack_four_per_byte_with_uniform_shifts():
    codes = torch.randint(0, 4, (3, 5, 64, 32))
    packed = pack_codes(codes)
    assert packed.shape == (3, 5, 64, 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), codes)
    # channel s*D/4 + j lives in bits 2s..2s+1 of byte j
    assert torch.equal((packed[..., 3] >> 4) & 3, codes[..., 2 * 8 + 3].to(torch.uint8))


# -- accounting ---------------------------------------------------------------------------------------
def expected_used_bytes(kind, P, D, slots, calibrated):
    """The slab's fields at 16-byte offsets: codes, key channel mean + scale (FP8), centroids (fp16,
    per-page codebooks only), outlier values (FP8) and positions (uint16)."""
    sizes = [P * D // 4]
    if kind == "key":
        sizes += [D, D]
    if not calibrated:
        sizes.append(4 * 2)
    if slots:
        sizes += [slots, 2 * slots]
    return sum(align(s, FIELD_ALIGN_BYTES) for s in sizes[:-1]) + sizes[-1]


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("P,D", [(64, 32), (16, 128), (64, 128), (32, 16)])
def test_slab_bytes_and_bits_are_exact(P, D, calibrated, nuq2_calibration):
    calibration = nuq2_calibration(D) if calibrated else None
    fmt = NUQ2Format(calibration=calibration)
    total = 0
    for kind in ("key", "value"):
        layout = fmt.layout(kind, P, D)
        slots = fmt.outlier_slots(kind, P, D)
        assert layout.used_bytes == expected_used_bytes(kind, P, D, slots, calibrated)
        assert layout.slab_bytes == align(layout.used_bytes, PAGE_ALIGN_BYTES)
        if kind == "key":  # keys keep at least 0.5% of their elements as outliers
            assert slots >= math.ceil(0.005 * P * D)
        # the slots fill the padding: one more would need another 128-byte line
        assert PageLayout(fmt._fields(kind, P, D, slots + 1)).slab_bytes > layout.slab_bytes
        _, bits = roundtrip("nuq2", gaussian(2 * P, 1, D), kind, block_size=P, calibration=calibration)
        assert bits == 8 * layout.slab_bytes / (P * D)
        total += layout.slab_bytes
    assert fmt.bits_per_element(1, P, D) == 8 * total / (2 * P * D)


def test_bits_at_the_reported_shapes(nuq2_calibration):
    page = NUQ2Format()  # (block_size, head_dim) -> bits; K and V slabs in bytes below
    assert [page.bits_per_element(2, P, D) for P, D in [(64, 32), (16, 128), (64, 128)]] == [2.5, 3.0, 2.3125]
    assert (page.layout("key", 64, 32).slab_bytes, page.layout("value", 64, 32).slab_bytes) == (640, 640)
    cal = NUQ2Format(calibration=nuq2_calibration(32))
    assert cal.calibrated and cal.layout("value", 64, 32).slab_bytes == 512  # codes only: 2 bits exactly
    assert cal.bits_per_element(2, 64, 32) == 2.25


# -- round trips -----------------------------------------------------------------------------------------
def test_gaussian_values_error_near_the_2bit_optimum():
    x = gaussian()
    x_hat, _ = roundtrip("nuq2", x, "value", block_size=64)
    # Lloyd-Max with 4 levels leaves 0.1175 of a Gaussian's variance; the outlier slots take some off
    assert rel_mse(x_hat, x) < 0.118


def test_gaussian_keys_keep_their_extremes():
    """Keys are fitted with weights 1 + |z|^3: more MSE than Lloyd-Max, but the large elements
    (which make the large attention logits) are not pulled toward the mean."""
    x = gaussian()
    k_hat, _ = roundtrip("nuq2", x, "key", block_size=64)
    v_hat, _ = roundtrip("nuq2", x, "value", block_size=64)  # plain k-means, for contrast
    assert rel_mse(k_hat, x) < 0.18
    big = (x.abs() > 1.8) & (x.abs() < 3.0)  # the tail below the outlier slots' threshold
    keep_k = float((k_hat[big] * x[big].sign()).mean() / x[big].abs().mean())
    keep_v = float((v_hat[big] * x[big].sign()).mean() / x[big].abs().mean())
    assert keep_k > 0.9 and keep_v < 0.8, (keep_k, keep_v)


def test_key_outlier_channels_are_normalised_away():
    x = gaussian()
    x[:, :, 3] = 40 + 25 * x[:, :, 3]  # offset and wide channels, as keys have
    x[:, :, 17] = -15 + 0.1 * x[:, :, 17]
    x_hat, _ = roundtrip("nuq2", x, "key", block_size=64)
    err = (x_hat - x).pow(2).mean(dim=(0, 1))  # [D] per channel
    var = x.var(dim=0).mean(dim=0)
    assert (err / var).max() < 0.2  # every channel, large and small, keeps ~2-bit precision


def student_t(tokens=128, heads=2, dim=32, df=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, heads, dim, generator=g)
    chi2 = torch.randn(tokens, heads, dim, df, generator=g).pow(2).sum(-1)
    return z / (chi2 / df).sqrt()


@pytest.mark.parametrize("kind", ["key", "value"])
def test_heavy_tails_go_to_fp8_slots(kind):
    x = student_t()
    x_hat, _ = roundtrip("nuq2", x, kind, block_size=64)
    assert torch.isfinite(x_hat).all()
    pages = x.reshape(2, 64, 2, 32).transpose(1, 2).reshape(4, -1)  # page-heads
    pages_hat = x_hat.reshape(2, 64, 2, 32).transpose(1, 2).reshape(4, -1)
    for row, row_hat in zip(pages, pages_hat):
        top = row.abs().topk(8).indices  # the 8 largest of each page-head are outliers by far
        if kind == "key":  # stored around the (FP8) channel means: allow that offset's share
            bound = FP8_REL * row[top].abs() + 0.05
        else:
            bound = FP8_REL * row[top].abs() * 1.001
        assert ((row_hat[top] - row[top]).abs() <= bound).all()


def test_slot_overflow_keeps_the_largest():
    P, D = 64, 32
    fmt = NUQ2Format(outlier_cap=1024)  # every slot of the padding fillable
    slots = fmt.outlier_slots("value", P, D)
    x = 0.01 * torch.randn(1, 1, P, D, generator=torch.Generator().manual_seed(2))
    spikes = torch.randperm(P * D, generator=torch.Generator().manual_seed(3))[:3 * slots]
    x.view(-1)[spikes] = torch.linspace(1.0, 10.0, 3 * slots)  # 3x more outliers than slots
    fields = fmt.quantize(x, "value", 0)
    assert set(fields["out_idx"].long().view(-1).tolist()) == set(spikes[-slots:].tolist())


@pytest.mark.parametrize("kind", ["key", "value"])
def test_outlier_cap_keeps_the_largest_and_the_layout(kind):
    """outlier_cap fills at most that many slots a page-head, its largest deviations, and leaves the slab
    as it is (the other slots unused, the bits unchanged)."""
    P, D, cap = 64, 32, 5
    capped, full = NUQ2Format(outlier_cap=cap), NUQ2Format()
    x = 0.01 * torch.randn(1, 1, P, D, generator=torch.Generator().manual_seed(2))
    spikes = torch.randperm(P * D, generator=torch.Generator().manual_seed(3))[:12]
    x.view(-1)[spikes] = torch.linspace(1.0, 10.0, 12)  # 12 outliers, far beyond any threshold
    assert capped.layout(kind, P, D).slab_bytes == full.layout(kind, P, D).slab_bytes
    slots = full.quantize(x, kind, 0)["out_idx"].long().view(-1)
    assert set(slots[slots != NO_OUTLIER].tolist()) == set(spikes.tolist())  # uncapped: a slot each
    used = capped.quantize(x, kind, 0)["out_idx"].long().view(-1)
    z, _ = normalize(x, kind)  # what the threshold sees (keys: per channel over the page's tokens)
    largest = spikes[z.view(-1)[spikes].abs().topk(cap).indices]
    assert (used[cap:] == NO_OUTLIER).all() and set(used[:cap].tolist()) == set(largest.tolist())


def test_tiered_passes_its_outlier_cap_to_its_nuq2_tier():
    """tiered's kv_outlier_cap reaches its nuq2 tier (the engine's option, as nuq2 takes it): a page of 12
    spikes fills at most the cap's slots."""
    from moekv.kvcache.formats import get_kv_format

    P, D, cap = 64, 32, 5
    fmt = get_kv_format("tiered", torch.bfloat16, outlier_cap=cap)
    assert fmt.lo.outlier_cap == cap and get_kv_format("tiered", torch.bfloat16).lo.outlier_cap == 1024
    x = 0.01 * torch.randn(1, 1, P, D, generator=torch.Generator().manual_seed(2))
    spikes = torch.randperm(P * D, generator=torch.Generator().manual_seed(3))[:12]
    x.view(-1)[spikes] = torch.linspace(1.0, 10.0, 12)
    used = fmt.lo.quantize(x, "value", 0)["out_idx"].long().view(-1)
    assert (used != NO_OUTLIER).sum().item() == cap


@pytest.mark.parametrize("cap", [0, -1, 2.5, True])
def test_outlier_cap_must_be_a_positive_integer(cap):
    with pytest.raises(ValueError, match="outlier_cap"):
        NUQ2Format(outlier_cap=cap)


def test_tau_decides_what_is_an_outlier():
    x = gaussian(64, 1, 32).reshape(1, 64, 1, 32).transpose(1, 2)
    fields = NUQ2Format(outlier_sigma=50.0).quantize(x, "value", 0)
    assert (fields["out_idx"].long() == NO_OUTLIER).all()  # nothing is 50 sigma out
    fields = NUQ2Format(outlier_sigma=1.0, outlier_cap=1024).quantize(x, "value", 0)
    assert (fields["out_idx"].long() != NO_OUTLIER).all()  # ~30% are 1 sigma out: every slot taken


@pytest.mark.parametrize("kind", ["key", "value"])
def test_zero_and_constant_pages(kind):
    zeros = torch.zeros(128, 2, 32)
    assert torch.equal(roundtrip("nuq2", zeros, kind, block_size=64)[0], zeros)
    const = torch.full((128, 2, 32), -3.14159)
    x_hat, _ = roundtrip("nuq2", const, kind, block_size=64)
    assert torch.isfinite(x_hat).all()
    assert (x_hat - const).abs().max() < 1e-3 * 3.14159  # fp16 centroid rounding at most


def test_partial_tail_stays_16bit():
    x = gaussian(64 + 10)
    x_hat, bits = roundtrip("nuq2", x, "value", block_size=64)
    assert torch.equal(x_hat[64:], x[64:].to(torch.bfloat16).float())
    assert bits == pytest.approx((8 * 640 * 2 + 16 * 10 * 2 * 32) / x.numel())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_is_refused(bad):
    x = gaussian(64)
    x[5, 1, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip("nuq2", x, "key", block_size=64)


def test_layouts_it_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="divisible by 4"):
        NUQ2Format().layout("key", 64, 30)
    with pytest.raises(ValueError, match="uint16"):
        NUQ2Format().layout("key", 1024, 128)


# -- calibrated codebooks -------------------------------------------------------------------------------
def test_calibrated_round_trip(nuq2_calibration):
    x = gaussian(128, 1, 32, seed=9)
    for kind in ("key", "value"):
        x_hat, bits = roundtrip("nuq2", x, kind, block_size=64, calibration=nuq2_calibration(32))
        assert rel_mse(x_hat, x) < (0.18 if kind == "key" else 0.13)  # keys: tail-weighted fit
        assert bits == (2.5 if kind == "key" else 2.0)


def test_calibration_of_another_model_is_named(nuq2_calibration):
    x = gaussian(64, 1, 32)
    with pytest.raises(ValueError, match="nuq2.layer3.key.centroids"):
        roundtrip("nuq2", x, "key", block_size=64, layer=3, calibration=nuq2_calibration(32))
    with pytest.raises(ValueError, match="kv_calibration"):
        NUQ2Format(calibration="/nonexistent/folder")


# -- engine -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [32, 64])
def test_engine_generates_and_frees_pages(mixtral_ckpt, block_size):
    llm = LLM(mixtral_ckpt, kv_cache_dtype="nuq2", max_model_len=128, block_size=block_size, dtype="float32")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 2 for j in range(n)]}
               for i, n in enumerate((block_size + 9, min(2 * block_size + 1, 100), 5))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24, 24]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_layouts_are_built_once_per_shape_and_instance(nuq2_calibration):
    """Layouts are memoized per format instance (eager steps asked for them in every layer): the
    same object for the same shape, and a calibrated instance keeps its own (no centroids field)."""
    page, calibrated = NUQ2Format(), NUQ2Format(calibration=nuq2_calibration(32))
    assert page.layout("key", 64, 32) is page.layout("key", 64, 32)
    assert page.layout("key", 64, 32) is not page.layout("value", 64, 32)
    assert "centroids" in page.layout("key", 64, 32).offsets
    assert "centroids" not in calibrated.layout("key", 64, 32).offsets
    assert page.outlier_slots("key", 64, 32) == NUQ2Format().outlier_slots("key", 64, 32)
