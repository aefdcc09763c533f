"""vq: 8-channel subvectors, one uint8 code each into calibrated codebooks, per-token fp16 scale.
Round trips on structured inputs, exact byte accounting, the calibration it requires (and the
clear error without it), and calibrate -> engine end to end on a tiny checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moekv import LLM, SamplingParams
from moekv.kvcache.formats.interface import PAGE_ALIGN_BYTES
from moekv.kvcache.formats.paged import FIELD_ALIGN_BYTES
from moekv.kvcache.formats.vq import VQFormat, fit_codebook, fit_key_channel_scale
from moekv.kvcache.roundtrip import roundtrip
from moekv.tools.calibrate import calibrate

FP8_REL = 2.0 ** -4


def rel_mse(x_hat, x):
    return float((x_hat - x).pow(2).sum() / x.pow(2).sum())


def gaussian(tokens=128, heads=2, dim=32, seed=0):
    return torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(seed))


def align(n, a):
    return -(-n // a) * a


@pytest.fixture(scope="module")
def vq_calibration(tmp_path_factory):
    """head_dim -> calibration folder (layer 0, 2 heads) whose codebooks were fitted on Gaussian pages."""
    root = tmp_path_factory.mktemp("vqcal")

    def make(D: int) -> str:
        folder = root / f"d{D}"
        if not folder.exists():
            folder.mkdir()
            g = torch.Generator().manual_seed(0)
            pages = gaussian(64 * 16, 2, D, seed=1).reshape(16, 64, 2, D).transpose(1, 2)
            scale = fit_key_channel_scale(pages)
            save_file({"vq.layer0.key.chan_scale": scale,
                       "vq.layer0.key.codebook": fit_codebook(pages, "key", scale, 8, 4, 1024, g),
                       "vq.layer0.value.codebook": fit_codebook(pages, "value", None, 8, 4, 1024, g)},
                      str(folder / "kv_calibration.safetensors"))
        return str(folder)
    return make


def test_codewords_are_e4m3_values(vq_calibration, tmp_path):
    """fit_codebook stores e4m3 values (in fp16), and the format rounds a file's codebooks that are not
    (an older calibration's) to e4m3 when it loads them, so every kernel reads the same codewords and
    the Gluon ones can hold them in 8 bytes exactly."""
    from safetensors.torch import load_file

    on_grid = lambda t: torch.equal(t.float(), t.float().to(torch.float8_e4m3fn).float())  # noqa: E731
    fitted = load_file(str(Path(vq_calibration(32)) / "kv_calibration.safetensors"))
    assert on_grid(fitted["vq.layer0.key.codebook"]) and on_grid(fitted["vq.layer0.value.codebook"])
    off_grid = {**fitted, "vq.layer0.value.codebook": fitted["vq.layer0.value.codebook"] * 1.03}
    assert not on_grid(off_grid["vq.layer0.value.codebook"])
    save_file(off_grid, str(tmp_path / "kv_calibration.safetensors"))
    book = VQFormat(tmp_path).codebook("value", 0)
    assert on_grid(book) and torch.equal(book, off_grid["vq.layer0.value.codebook"].float()
                                         .to(torch.float8_e4m3fn).float())
    k16, _, v16 = VQFormat(tmp_path).decode_tables(0, "cpu")
    k8, _, v8 = VQFormat(tmp_path).decode_tables(0, "cpu", torch.float8_e4m3fn)
    assert torch.equal(k16.float(), k8.float()) and torch.equal(v16.float(), v8.float())


def test_random_calibration_saves_every_layer(tmp_path):
    """random_calibration's layers hold the same codebooks in tensors of their own (safetensors refuses
    tensors that share memory: a 32-layer one for the end-to-end benchmark failed to save)."""
    from moekv.kvcache.formats.vq import random_calibration

    fmt = VQFormat(random_calibration(tmp_path, 2, 32, num_layers=3, iters=1, max_vectors=256))
    assert torch.equal(fmt.codebook("key", 0), fmt.codebook("key", 2))
    assert torch.equal(fmt.chan_scale(0), fmt.chan_scale(2))


# -- calibration is required --------------------------------------------------------------------------
def test_without_calibration_the_error_says_what_to_run():
    with pytest.raises(ValueError) as e:
        VQFormat()
    assert str(e.value) == ("kv_cache_dtype='vq' needs a calibration: run `moekv calibrate --model PATH --text FILE "
                            "--out DIR` and pass kv_calibration=DIR")
    with pytest.raises(ValueError, match="needs a calibration"):
        roundtrip("vq", gaussian(), "key", block_size=64)


def test_engine_refuses_vq_without_calibration(mixtral_ckpt):
    with pytest.raises(ValueError, match="moekv calibrate"):
        LLM(mixtral_ckpt, kv_cache_dtype="vq", dtype="float32")


def test_calibration_folder_without_the_file(tmp_path):
    with pytest.raises(ValueError, match="kv_calibration.safetensors"):
        VQFormat(calibration=tmp_path)


def test_calibration_of_another_shape_is_refused(vq_calibration):
    with pytest.raises(ValueError, match="calibrate for this model"):
        VQFormat(calibration=vq_calibration(32)).check_layout(4, 64, 32)


# -- accounting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,D", [(64, 32), (16, 128), (64, 128)])
def test_slab_bytes_and_bits_are_exact(P, D, vq_calibration):
    fmt = VQFormat(calibration=vq_calibration(D))
    total = 0
    for kind in ("key", "value"):
        layout = fmt.layout(kind, P, D)
        slots = fmt.outlier_slots(kind, P, D)
        # codes (1 byte per 8 channels), fp16 token scale, FP8 key channel means, FP8 + uint16 outliers
        sizes = [P * D // 8, 2 * P] + ([D] if kind == "key" else []) + ([slots, 2 * slots] if slots else [])
        assert layout.used_bytes == sum(align(s, FIELD_ALIGN_BYTES) for s in sizes[:-1]) + sizes[-1]
        assert layout.slab_bytes == align(layout.used_bytes, PAGE_ALIGN_BYTES)
        _, bits = roundtrip("vq", gaussian(2 * P, 2, D), kind, block_size=P, calibration=vq_calibration(D))
        assert bits == 8 * layout.slab_bytes / (P * D)
        total += layout.slab_bytes
    assert fmt.bits_per_element(2, P, D) == 8 * 2 * total / (2 * 2 * P * D) < 2.0


def test_bits_at_the_reported_shapes(vq_calibration):
    fmt = VQFormat(calibration=vq_calibration(32))
    assert fmt.layout("key", 64, 32).slab_bytes == 512  # 256 codes + 128 scale + 32 means + 32 outlier slots
    assert fmt.layout("value", 64, 32).slab_bytes == 384  # 256 codes + 128 scale
    assert fmt.bits_per_element(2, 64, 32) == 1.75
    fmt = VQFormat(calibration=vq_calibration(128))
    assert [fmt.bits_per_element(2, P, 128) for P in (16, 64)] == [1.75, 1.1875]


# -- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["key", "value"])
def test_gaussian_error(kind, vq_calibration):
    x_hat, _ = roundtrip("vq", gaussian(seed=7), kind, block_size=64, calibration=vq_calibration(32))
    # 1 bit/element on iid Gaussians: rate-distortion allows 0.25, 256 codewords in 8-D reach ~0.35
    assert rel_mse(x_hat, gaussian(seed=7)) < 0.42


def test_key_outlier_channels_are_normalised_away(vq_calibration):
    x = gaussian(seed=8)
    x[:, :, 5] = 30 + x[:, :, 5]  # large per-page offsets, as post-RoPE keys carry
    x[:, :, 20] = -12 + x[:, :, 20]
    x_hat, _ = roundtrip("vq", x, "key", block_size=64, calibration=vq_calibration(32))
    err = (x_hat - x).pow(2).mean(dim=(0, 1))  # [D]
    assert err.max() < 0.8  # unit-variance channels: the offsets cost little beyond their FP8 rounding


def test_heavy_tailed_keys_go_to_fp8_slots(vq_calibration):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, 32, generator=g) * 0.5
    spikes = torch.randperm(64 * 2 * 32, generator=g)[:20]
    x.view(-1)[spikes] = torch.linspace(-40, 40, 20)
    x_hat, _ = roundtrip("vq", x, "key", block_size=64, calibration=vq_calibration(32))
    flat, flat_hat = x.view(-1)[spikes], x_hat.view(-1)[spikes]
    big = flat.abs() > 5  # 10 sigma and more (the two smallest spikes compete with the coarse codes
    assert big.sum() == 18  # that a spiky token's large scale gives its other channels)
    # they come back at FP8 precision, around the page's FP8 channel means
    assert ((flat_hat - flat).abs()[big] <= FP8_REL * flat.abs()[big] + 0.1).all()


@pytest.mark.parametrize("kind", ["key", "value"])
def test_zero_and_constant_pages(kind, vq_calibration):
    zeros = torch.zeros(64, 2, 32)
    x_hat, _ = roundtrip("vq", zeros, kind, block_size=64, calibration=vq_calibration(32))
    assert torch.equal(x_hat, zeros)  # the zero codeword is reserved
    const = torch.full((64, 2, 32), 2.5)
    x_hat, _ = roundtrip("vq", const, kind, block_size=64, calibration=vq_calibration(32))
    assert torch.isfinite(x_hat).all()
    assert (x_hat - const).abs().max() < 2e-3 * 2.5  # +-(1,...,1) reserved / the mean is exact in FP8


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_refused(bad, vq_calibration):
    x = gaussian()
    x[3, 0, 9] = bad
    with pytest.raises(ValueError, match="non-finite"):
        roundtrip("vq", x, "value", block_size=64, calibration=vq_calibration(32))


# -- calibrate -> engine -------------------------------------------------------------------------------------
CALIBRATION_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
                    "of foolishness. The quick brown fox jumps over the lazy dog. ") * 12


@pytest.fixture(scope="module")
def calibrated(mixtral_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    text = root / "calib.txt"
    text.write_text(CALIBRATION_TEXT)
    return calibrate(mixtral_ckpt, text, root / "out", max_tokens=1024, window=128, block_size=32,
                     progress=False, vq_iters=4, vq_max_vectors=2048)


def test_calibrate_command(mixtral_ckpt, tmp_path, capsys):
    import argparse

    from moekv.cli.calibrate import add_calibrate_parser

    parser = argparse.ArgumentParser(prog="moekv")
    add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    (tmp_path / "t.txt").write_text(CALIBRATION_TEXT)
    args = parser.parse_args(["calibrate", "--model", str(mixtral_ckpt), "--text", str(tmp_path / "t.txt"),
                              "--out", str(tmp_path / "cal"), "--max-tokens", "256", "--block-size", "32", "--quiet"])
    assert args.device == "cpu"  # the default: score the text on the CPU
    assert args.func(args) == 0
    assert "--kv-calibration" in capsys.readouterr().out
    assert json.loads((tmp_path / "cal" / "kv_calibration.json").read_text())["device"] == "cpu"
    with pytest.raises(ValueError, match="device"):  # --device reaches the engine, which checks it
        args = parser.parse_args(["calibrate", "--model", str(mixtral_ckpt), "--text", str(tmp_path / "t.txt"),
                                  "--out", str(tmp_path / "cal2"), "--max-tokens", "256", "--device", "tpu"])
        args.func(args)


def test_calibrate_writes_tables_and_record(calibrated, mixtral_ckpt):
    assert (calibrated / "kv_calibration.safetensors").is_file()
    record = json.loads((calibrated / "kv_calibration.json").read_text())
    assert record["num_layers"] == 2 and record["num_kv_heads"] == 2 and record["head_dim"] == 16
    assert record["tensors"]["vq.layer1.value.codebook"] == [2, 2, 256, 8]
    assert record["tensors"]["nuq2.layer0.key.centroids"] == [2, 4]
    assert record["tokens_used"] > 32 and record["model"].endswith(mixtral_ckpt.name)
    # 2 layers x K/V x 2 heads x 2 groups x 256 codewords x 8 channels x fp16
    assert record["vq"]["codebook_bytes_fp16"] == 2 * 2 * 2 * 2 * 256 * 8 * 2
    assert record["formats"] == ["nuq2", "vq"]  # the registry's formats that declare a calibration fitter
    assert record["vq"]["iters"] == 4 and record["vq"]["sub_dim"] == 8  # vq_iters reached vq's fitter


def test_calibrate_refuses_an_option_no_fitter_takes():
    from moekv.tools.calibrate import fitter_options

    assert fitter_options({"vq_iters": 3})["vq"] == {"sub_dim": 8, "iters": 3, "max_vectors": 16384}
    with pytest.raises(TypeError, match=r"no fitter takes vq_iterz=3; accepted: \['vq_sub_dim'"):
        fitter_options({"vq_iterz": 3})


@pytest.mark.parametrize("block_size", [32, 64])
def test_engine_generates_with_calibration_and_frees_pages(calibrated, mixtral_ckpt, block_size):
    llm = LLM(mixtral_ckpt, kv_cache_dtype="vq", kv_calibration=str(calibrated), max_model_len=128,
              block_size=block_size, dtype="float32")
    prompts = [{"prompt_token_ids": [(11 * i + 3 * j) % 300 + 2 for j in range(n)]}
               for i, n in enumerate((block_size + 7, min(2 * block_size + 2, 100), 3))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24, 24]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_nuq2_uses_the_same_calibration(calibrated, mixtral_ckpt):
    llm = LLM(mixtral_ckpt, kv_cache_dtype="nuq2", kv_calibration=str(calibrated), max_model_len=128,
              block_size=32, dtype="float32")
    assert llm.engine.runner.kv_format.calibrated
    out = llm.generate([{"prompt_token_ids": list(range(2, 80))}],
                       SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 24
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
