"""Per-device launch tuning of the Triton kernels, as data: moekv/ops/configs/<kernel>_<device>.json.

The sweep scripts in benchmarks/ measure a kernel's launch choices on one GPU and write (--write-config)
the file of that GPU; the kernels' launchers read it once per process. <device> is
torch.cuda.get_device_name with every run of characters other than letters and digits turned into one
underscore ("NVIDIA H200" -> "NVIDIA_H200").

Fallback: a device without a file of its own (and a machine without a GPU, where the kernels run under
the interpreter) gets DEFAULT_DEVICE's file, the numbers the kernels were tuned with, so every device
launches as the tuned one does until someone sweeps that device.
"""
from __future__ import annotations

import functools
import json
import re
from importlib import resources
from pathlib import Path

import torch

DEFAULT_DEVICE = "NVIDIA_H200"
CONFIG_PACKAGE = "moekv.ops.configs"


def device_key(device_name: str) -> str:
    """The file-name form of a device name: "NVIDIA H200" -> "NVIDIA_H200"."""
    key = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    if not key:
        raise ValueError(f"tuning: cannot make a file name of the device name {device_name!r}")
    return key


def config_name(kernel: str, device_name: str) -> str:
    return f"{kernel}_{device_key(device_name)}.json"


@functools.cache
def current_device_name() -> str | None:
    """torch.cuda.get_device_name of the current device, None without CUDA (read once: one GPU model a process)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def load_tuning(kernel: str, device_name: str | None) -> dict:
    """The parsed <kernel>_<device>.json of `device_name`, or DEFAULT_DEVICE's when that device has none
    (or device_name is None); its "device" key says which file it is."""
    files = resources.files(CONFIG_PACKAGE)
    key = device_key(device_name) if device_name else DEFAULT_DEVICE
    path = files / f"{kernel}_{key}.json"
    if not path.is_file():
        key = DEFAULT_DEVICE
        path = files / f"{kernel}_{key}.json"
        if not path.is_file():
            raise FileNotFoundError(f"tuning: no {kernel}_{DEFAULT_DEVICE}.json in {CONFIG_PACKAGE}")
    data = json.loads(path.read_text())
    data["device"] = key
    return data


def merge(base: dict, updates: dict) -> dict:
    """base with updates applied key by key, nested dicts merged (a value None removes its key)."""
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        elif value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def write_tuning(kernel: str, device_name: str, updates: dict, folder: Path | None = None) -> Path:
    """Merge `updates` into <kernel>_<device>.json in `folder` (default: moekv/ops/configs of this checkout),
    starting from DEFAULT_DEVICE's file when the device has none yet; returns the file written. For the sweep
    scripts' --write-config."""
    folder = folder or Path(__file__).resolve().parent / "configs"
    path = folder / config_name(kernel, device_name)
    start = path if path.is_file() else Path(__file__).resolve().parent / "configs" / f"{kernel}_{DEFAULT_DEVICE}.json"
    data = merge(json.loads(start.read_text()) if start.is_file() else {}, updates)
    data.pop("device", None)  # the loader says which file it read
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
