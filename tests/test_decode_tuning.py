"""The decode launchers' per-device tuning (moekv/ops/tuning.py, moekv/ops/configs/) and where each format's
decode spec builder lives (moekv/ops/decode/<format>.py)."""
from __future__ import annotations

import fnmatch
import importlib
import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import torch

from tests.triton_kernels import DECODE_MODULES, kernel_modules  # noqa: F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops import tuning  # noqa: E402

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
launch = decode["moekv.ops.decode.launch"]
REPO = Path(__file__).resolve().parent.parent


def test_device_names_become_file_names():
    assert tuning.device_key("NVIDIA H200") == "NVIDIA_H200"
    assert tuning.device_key("NVIDIA GeForce RTX 4090 (Laptop)") == "NVIDIA_GeForce_RTX_4090_Laptop"
    assert tuning.config_name("decode_attention", "NVIDIA H100 80GB HBM3") == \
        "decode_attention_NVIDIA_H100_80GB_HBM3.json"
    with pytest.raises(ValueError, match="device name"):
        tuning.device_key(" -- ")


def test_the_h200_config_loads_and_unknown_devices_fall_back_to_it():
    h200 = tuning.load_tuning("decode_attention", "NVIDIA H200")
    assert h200["device"] == "NVIDIA_H200"
    for other in ("NVIDIA GeForce RTX 4090", None):  # a GPU without a file of its own, and no GPU
        fallback = tuning.load_tuning("decode_attention", other)
        assert fallback["device"] == tuning.DEFAULT_DEVICE
        assert fallback == h200
    with pytest.raises(FileNotFoundError, match="no_such_kernel"):
        tuning.load_tuning("no_such_kernel", "NVIDIA H200")


def test_decode_tuning_holds_the_h200_numbers():
    """The numbers the launchers used before they were data: a change to the file is a change of behaviour."""
    tuned = launch.tuning_for("NVIDIA H200")
    assert (tuned.block_n, tuned.split_waves, tuned.split_double_from, tuned.split_min_tiles, tuned.max_splits,
            tuned.wave_fill, tuned.min_capped_tiles, tuned.capped_min_page) == (64, 2, 64, 2, 128, 0.95, 8, 64)
    fp8 = tuned.format("fp8_e4m3")
    assert (fp8.prefetch, fp8.split_factor, fp8.swap_ab, fp8.max_registers, fp8.tail_in_last_split) == (0, 2, True, 80,
                                                                                                         False)
    assert tuned.register_cap("fp8_e4m3", 16) == 80  # fp8 keeps its cap on small pages
    assert [tuned.format(f).prefetch for f in ("int4", "kivi2", "nuq2", "vq", "tiered", "bf16")] == [2, 1, 2, 0, 2, 0]
    assert [tuned.format(f).swap_ab for f in ("int4", "kivi2", "nuq2", "vq", "tiered", "bf16")] == [
        True, False, True, True, False, False]
    assert launch.tuning_for("NVIDIA GeForce RTX 4090") == launch.tuning_for(None)
    assert launch.tuning_for(None).formats == tuned.formats


def test_bad_tuning_files_are_refused_with_the_key_named():
    with pytest.raises(ValueError, match="block_size"):
        launch.DecodeTuning.from_json({"device": "X", "block_size": 64})
    with pytest.raises(TypeError):
        launch.DecodeTuning.from_json({"device": "X", "formats": {"int4": {"prefetch_tiles": 2}}})


def test_the_specs_carry_the_tuned_launch():
    """Each format's spec takes its launch fields from the tuning of the current device (here: none, so
    the default device's)."""
    tuned = launch.decode_tuning()
    for name, options, block_size in (("fp8_e4m3", {}, 64), ("int4", {}, 64), ("kivi2", {}, 64),
                                      ("nuq2", {"codebook": "page"}, 64), ("int4", {}, 16)):
        spec = get_kv_format(name, torch.bfloat16, **options).decode_spec(block_size, 128)
        fmt = tuned.format(name)
        assert (spec.prefetch, spec.split_factor, spec.swap_ab, spec.tail_in_last_split) == (
            fmt.prefetch, fmt.split_factor, fmt.swap_ab, fmt.tail_in_last_split), name
        assert spec.max_registers == tuned.register_cap(name, block_size), name


def test_the_configs_ship_as_package_data():
    """pyproject's package-data covers every JSON file in moekv/ops/configs, and importlib.resources finds them
    (what an installed wheel reads)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["moekv.ops.configs"]
    files = sorted(p.name for p in (REPO / "moekv" / "ops" / "configs").glob("*.json"))
    assert "decode_attention_NVIDIA_H200.json" in files
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
        text = (resources.files("moekv.ops.configs") / name).read_text()
        assert json.loads(text)["formats"], name


@pytest.mark.parametrize("fmt_name, module, builder", [
    ("bf16", "plain", "plain_spec"), ("fp16", "plain", "plain_spec"), ("fp8_e4m3", "fp8", "fp8_spec"),
    ("int4", "int4", "int4_spec"), ("kivi2", "kivi2", "kivi2_spec"), ("nuq2", "nuq2", "nuq2_spec"),
    ("vq", "vq", "vq_spec")])
def test_each_format_reads_its_pages_through_its_own_module(fmt_name, module, builder):
    """The spec builder lives in moekv/ops/decode/<module>.py beside its tile readers."""
    mod = importlib.import_module(f"moekv.ops.decode.{module}")
    assert callable(getattr(mod, builder))
    if fmt_name == "vq":  # needs a calibration to build a format: the readers are checked by name
        assert {"vq_key_tile", "vq_value_tile", "vq_key_fold", "vq_key_fix", "vq_value_fix"} <= set(vars(mod))
        return
    spec = get_kv_format(fmt_name, torch.bfloat16).decode_spec(64, 128)
    for reader in (spec.key, spec.value):
        fn = getattr(reader.fn, "fn", reader.fn)  # a JITFunction (or the interpreter's) wraps the Python function
        assert fn.__module__ == f"moekv.ops.decode.{module}", (fmt_name, fn.__module__)


def test_the_launchers_are_where_the_formats_import_them():
    assert callable(decode["moekv.ops.decode.paged"].paged_decode_attention)
    assert callable(decode["moekv.ops.decode.tiered"].tiered_decode_attention)


def test_write_config_merges_a_sweeps_choices_into_the_devices_file(tmp_path):
    """What the sweep scripts' --write-config does: a new device starts from the default device's numbers,
    the sweep's fields replace theirs (None: back to the spec's default), the rest stays."""
    path = tuning.write_tuning("decode_attention", "NVIDIA H100 80GB HBM3",
                               {"formats": {"int4": {"prefetch": 1, "max_registers": None}, "new": {"swap_ab": True}}},
                               folder=tmp_path)
    assert path == tmp_path / "decode_attention_NVIDIA_H100_80GB_HBM3.json"
    written = launch.DecodeTuning.from_json({**json.loads(path.read_text()), "device": "NVIDIA_H100_80GB_HBM3"})
    default = launch.tuning_for(None)
    assert written.format("int4").prefetch == 1 and written.format("int4").max_registers is None
    assert written.format("int4").swap_ab == default.format("int4").swap_ab
    assert written.format("new").swap_ab and written.format("fp8_e4m3") == default.format("fp8_e4m3")
    again = tuning.write_tuning("decode_attention", "NVIDIA H100 80GB HBM3", {"wave_fill": 0.9}, folder=tmp_path)
    assert json.loads(again.read_text())["formats"]["int4"]["prefetch"] == 1  # the device's own file, updated
    assert json.loads(again.read_text())["wave_fill"] == 0.9
