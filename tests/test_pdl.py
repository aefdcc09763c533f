"""When kernels use programmatic dependent launch (moekv/ops/pdl.py): CUDA devices of compute
capability >= 9.0 unless MOEKV_PDL=0; never on the CPU, where the interpreter knows no such launch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moekv.ops import pdl  # noqa: E402


def test_never_on_the_cpu(monkeypatch):
    monkeypatch.setenv("MOEKV_PDL", "1")
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


def test_prefetch_sizes(monkeypatch):
    assert pdl.PREFETCH_TILES == 0 and pdl.prefetch_cols(3584, 512) == 0  # the default: no prefetch
    assert pdl.prefetch_lines(0) == 0  # the kernels then skip the prefetch branch
    assert pdl.prefetch_lines(4096) == 64  # 4096 16-bit elements = 64 lines of 128 bytes
    assert pdl.prefetch_lines(3584) == 64  # 56 lines, rounded up to a power of two
    monkeypatch.setattr(pdl, "PREFETCH_TILES", 1)
    assert pdl.prefetch_cols(3584, 512) == 512 and pdl.prefetch_cols(300, 512) == 300
    monkeypatch.setattr(pdl, "PREFETCH_TILES", None)
    assert pdl.prefetch_cols(3584, 512) == 3584


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_by_default_on_hopper_and_off_with_the_variable(monkeypatch):
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    monkeypatch.delenv("MOEKV_PDL", raising=False)
    assert pdl.pdl_enabled(dev) == hopper
    monkeypatch.setenv("MOEKV_PDL", "0")
    assert not pdl.pdl_enabled(dev)
