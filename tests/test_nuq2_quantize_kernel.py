"""The nuq2 page-quantization kernel (moekv/ops/nuq2_quantize.py) against its reference,
`NUQ2Format.quantize` + `PageLayout.pack`, field by field: FP8 channel moments and outlier
values byte for byte, outlier positions as sets, centroids to the fp16 bit (one ulp where the
sums' order moves the last fp32 bit), codes all but a few at centroid midpoints. Without CUDA the
kernel runs under TRITON_INTERPRET=1 on CPU tensors; with CUDA the same tests run compiled."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.kvcache.formats.nuq2 import KMEANS_ITERS, NO_OUTLIER, NUQ2Format, unpack_codes  # noqa: E402

(nq,) = kernel_modules("moekv.ops.nuq2_quantize")
tl = triton.language

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _round_e4m3_probe(x_ptr, val_ptr, byte_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    val, byte = nq._round_e4m3(tl.load(x_ptr + i))
    tl.store(val_ptr + i, val)
    tl.store(byte_ptr + i, byte.to(tl.uint8))


def test_e4m3_rounding_matches_torchs_cast_byte_for_byte():
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # ties: to even
    x = torch.cat([grid, mids, torch.randn(4096, generator=g) * 30, torch.rand(1024, generator=g) * 2 ** -5,
                   torch.tensor([448.0, -448.0, 0.0, -0.0, 2 ** -10, 3 * 2 ** -10, 2 ** -6 - 2 ** -11])])
    x = x.clamp(-448, 448)
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    val = torch.empty_like(x)
    byte = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _round_e4m3_probe[(1,)](x, val, byte, N=n)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(byte.cpu(), want.view(torch.uint8).cpu())
    assert torch.equal(val.cpu(), want.float().cpu())


def key_like(n, H, P, D, seed, dtype=torch.float32):
    """Keys with what nuq2 is built for: outlier channels (offsets of several sigma, one wide
    channel) and a few large spikes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, P, D, generator=g)
    x[..., 3] += 6.0
    x[..., D // 2] *= 5.0
    x[..., D - 1] -= 4.0
    spikes = torch.rand(n, H, P, D, generator=g) < 0.004
    x = torch.where(spikes, x + 12.0 * torch.randn(n, H, P, D, generator=g).sign(), x)
    return x.to(dtype).float()


def value_like(n, H, P, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, P, D, generator=g) * 0.7
    x = torch.where(torch.rand(n, H, P, D, generator=g) < 0.002, x * 8.0, x)  # rare large values
    return x.to(dtype).float()


def both(fmt, x, kind, layer=0):
    """(kernel fields, reference fields) of pages x."""
    P, D = x.shape[2], x.shape[3]
    layout = fmt.layout(kind, P, D)
    cb = fmt.codebook(kind, layer, x.shape[1], x.device) if fmt.calibrated else None
    got = nq.nuq2_quantize_packed(x.to(DEVICE), kind, layout, fmt.outlier_slots(kind, P, D), fmt.tau,
                                  KMEANS_ITERS, centroids=None if cb is None else cb.to(DEVICE),
                                  fill=fmt.filled_slots(kind, P, D)).cpu()
    want = layout.pack(fmt.quantize(x, kind, layer))
    return layout, got, want


def check_fields(fmt, layout, got, want, kind, layer=0):
    g, w = layout.unpack(got), layout.unpack(want)
    for name in ("chan_mean", "chan_scale"):
        if name in w:
            assert torch.equal(g[name].view(torch.uint8), w[name].view(torch.uint8)), name
    if "centroids" in w:
        diff = (g["centroids"].view(torch.int16).int() - w["centroids"].view(torch.int16).int()).abs()
        assert diff.max() <= 1, "centroids differ by more than one fp16 ulp"
        assert (diff == 0).float().mean() >= 0.9
    if "out_idx" in w:
        # slots: the same positions with the same values; used slots first (the reader's rule)
        for gi, gv, wi, wv in zip(g["out_idx"].reshape(-1, g["out_idx"].shape[-1]).int(),
                                  g["out_val"].reshape(-1, g["out_val"].shape[-1]).view(torch.uint8),
                                  w["out_idx"].reshape(-1, w["out_idx"].shape[-1]).int(),
                                  w["out_val"].reshape(-1, w["out_val"].shape[-1]).view(torch.uint8)):
            used = gi != NO_OUTLIER
            assert torch.equal(used, wi != NO_OUTLIER)
            assert used.sum() == 0 or used[:int(used.sum())].all(), "used slots must come first"
            assert torch.equal(dict_of(gi[used], gv[used]), dict_of(wi[wi != NO_OUTLIER], wv[wi != NO_OUTLIER]))
            assert (gv[~used] == 0).all()
    codes_g, codes_w = unpack_codes(g["codes"]), unpack_codes(w["codes"])
    assert (codes_g == codes_w).float().mean() >= 0.999
    # what the reader reconstructs: as close as the reference's own
    x_g = fmt.dequantize(g, kind, layer)
    x_w = fmt.dequantize(w, kind, layer)
    assert (x_g - x_w).abs().max() <= 1e-2 * x_w.abs().max()
    # padding and gaps between fields are zero, as pack leaves them
    assert torch.equal(got[..., layout.used_bytes:], want[..., layout.used_bytes:])


def dict_of(idx, val):
    """Slot (position, value byte) pairs in position order, as one tensor."""
    order = idx.argsort()
    return torch.stack([idx[order], val[order].int()])


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(16, 32), (32, 64), (64, 128), (16, 16)])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_kernel_matches_the_reference_quantize(kind, P, D):
    fmt = NUQ2Format()
    make = key_like if kind == "key" else value_like
    x = make(2, 2, P, D, seed=P + D)
    layout, got, want = both(fmt, x, kind)
    check_fields(fmt, layout, got, want, kind)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_kernel_matches_the_reference_with_a_calibrated_codebook(kind, tmp_path):
    from safetensors.torch import save_file

    from moekv.kvcache.formats.nuq2 import fit_centroids

    P, D, H = 32, 64, 2
    pages = key_like(4, H, P, D, seed=11) if kind == "key" else value_like(4, H, P, D, seed=11)
    save_file({f"nuq2.layer0.{k}.centroids": fit_centroids(pages, k).contiguous() for k in ("key", "value")},
              str(tmp_path / "kv_calibration.safetensors"))
    fmt = NUQ2Format(calibration=str(tmp_path), codebook="calibrated")
    x = (key_like if kind == "key" else value_like)(2, H, P, D, seed=12)
    layout, got, want = both(fmt, x, kind)
    assert "centroids" not in layout.offsets
    check_fields(fmt, layout, got, want, kind)


@pytest.mark.slow
def test_more_eligible_outliers_than_slots_keeps_the_largest():
    """Heavy tails: far more elements beyond tau than slots; the slots must hold the largest."""
    fmt = NUQ2Format(outlier_cap=1024)  # every slot of the padding fillable
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 32, 64, generator=g) ** 3  # cubed Gaussian: many elements past 3.5 sigma
    for kind in ("key", "value"):
        layout, got, want = both(fmt, x, kind)
        slots = fmt.outlier_slots(kind, 32, 64)
        assert (layout.unpack(want)["out_idx"].int() != NO_OUTLIER).sum(-1).min() == slots  # all used
        check_fields(fmt, layout, got, want, kind)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_outlier_cap_fills_the_same_largest_slots(kind):
    """Under outlier_cap the kernel fills the cap's largest deviations, as the reference does: more eligible
    elements than the cap on every page-head, the slab's other slots left unused."""
    fmt = NUQ2Format(outlier_cap=6)
    x = torch.randn(2, 2, 16, 32, generator=torch.Generator().manual_seed(5)) ** 3  # heavy tails
    layout, got, want = both(fmt, x, kind)
    assert ((layout.unpack(want)["out_idx"].int() != NO_OUTLIER).sum(-1) == 6).all()
    check_fields(fmt, layout, got, want, kind)


def tied_spikes(kind, seed):
    """A bf16-like bulk on a 1/16 grid and 48 identical spikes, more than the slots: deviations
    tie at the slot threshold. Keys: 16 identical channels with 3 spikes each, so the spikes stay
    equal after the per-channel normalisation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(2, 2, 64, 32, generator=g) * 8) / 16
    if kind == "key":
        column = x[..., 0].clone()
        column[..., [3, 30, 41]] = 8.0
        x[..., :16] = column[..., None]
    else:
        spike = torch.zeros(64, 32, dtype=torch.bool)
        spike.view(-1)[torch.randperm(64 * 32, generator=g)[:48]] = True
        x = torch.where(spike, 6.0, x)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["key", "value"])
def test_tied_deviations_fill_exactly_the_slots(kind):
    """The kernel breaks ties at the slot threshold by position, the reference's top-k its own
    way: every slot used, none written past the slot arrays, the same reconstruction error."""
    fmt = NUQ2Format(outlier_cap=1024)  # every slot of the padding fillable
    x = tied_spikes(kind, seed=4)
    layout, got, want = both(fmt, x, kind)
    g, w = layout.unpack(got), layout.unpack(want)
    slots = fmt.outlier_slots(kind, 64, 32)
    assert ((w["out_idx"].int() != NO_OUTLIER).sum(-1) == slots).all()  # the data does tie past the slots
    assert ((g["out_idx"].int() != NO_OUTLIER).sum(-1) == slots).all()
    assert torch.equal(got[..., layout.used_bytes:], want[..., layout.used_bytes:])  # nothing written past
    err_g = (fmt.dequantize(g, kind) - x).pow(2).mean()
    err_w = (fmt.dequantize(w, kind) - x).pow(2).mean()
    assert err_g <= err_w * 1.02


def test_bf16_input_reads_like_its_fp32_copy():
    x = key_like(1, 2, 16, 32, seed=9, dtype=torch.bfloat16)
    fmt = NUQ2Format()
    layout = fmt.layout("key", 16, 32)
    args = ("key", layout, fmt.outlier_slots("key", 16, 32), fmt.tau, KMEANS_ITERS)
    a = nq.nuq2_quantize_packed(x.to(torch.bfloat16).to(DEVICE), *args)
    b = nq.nuq2_quantize_packed(x.to(DEVICE), *args)
    assert torch.equal(a, b)


def test_shapes_the_kernel_cannot_take_are_refused_by_name():
    fmt = NUQ2Format()
    layout = fmt.layout("key", 24, 32)
    with pytest.raises(ValueError, match="power-of-two"):
        nq.nuq2_quantize_packed(torch.zeros(1, 1, 24, 32, device=DEVICE), "key", layout, 8, 3.5, 8)
    assert not nq.can_quantize(24, 32) and not nq.can_quantize(128, 256) and nq.can_quantize(64, 128)


MODEL = Path(__file__).resolve().parent.parent / "models" / "domain-moe"
STORY = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. The ships that "
         "passed the rocks at night never knew his name, but they trusted the light. One winter the storm "
         "came early, and the sea rose higher than anyone in the village could remember. ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codebook", ["page", "calibrated"])
def test_the_engine_writes_with_the_kernel_what_the_reference_writes(codebook, monkeypatch, tmp_path):
    """The shipped trained model on CUDA, nuq2 pages quantized by the kernel (prefill chunks eagerly,
    page-filling decode steps inside their CUDA graphs) and by the torch reference: the same
    greedy text, to within the odd code at a centroid midpoint (first 48 tokens equal, logprobs
    within 0.05 nats over them). The calibrated codebooks come from `moekv calibrate` on 2,048
    tokens of the model's held-out prose."""
    from moekv import LLM, SamplingParams
    from moekv.cli import main

    calibration = None
    if codebook == "calibrated":
        calibration = tmp_path / "kv_calibration"
        assert main(["calibrate", "--model", str(MODEL), "--text", str(MODEL / "heldout" / "prose.txt"),
                     "--out", str(calibration), "--max-tokens", "2048", "--device", "cuda", "--quiet"]) == 0
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=4, kv_cache_dtype="nuq2",
                  kv_codebook=codebook, block_size=32, kv_calibration=str(calibration) if calibration else None)
    prompts = [STORY, STORY[60:] + STORY[:60], "Once upon a time " + STORY]
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for impl in ("1", "0"):
        monkeypatch.setenv("MOEKV_NUQ2_QUANTIZE_KERNEL", impl)
        llm = LLM(str(MODEL), **kwargs)
        assert llm.engine.runner.kv_format.quantize_kernel == (impl == "1")
        runs[impl] = llm.generate(prompts, params)
        del llm
    for a, b in zip(runs["1"], runs["0"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta[:48] == tb[:48]
        la = [d[t] for d, t in zip(a.outputs[0].logprobs[:48], ta)]
        lb = [d[t] for d, t in zip(b.outputs[0].logprobs[:48], tb)]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 0.05
