from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoints import ARCHS, build_checkpoint

# Without CUDA the Triton kernels run under its interpreter, which must be chosen before any test
# module imports triton (the Gluon modules import it eagerly); tests/triton_kernels.py relies on it.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> folder of a tiny random checkpoint saved by transformers."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def mixtral_ckpt(checkpoints):
    return checkpoints["mixtral"]


@pytest.fixture(scope="session")
def hd32_ckpt(tmp_path_factory):
    """A tiny random Mixtral with head_dim 32: `mixtral_ckpt` has head_dim 16, which no 32-channel
    group (int4, kivi2) divides."""
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral_hd32") / "mixtral", seed=0, head_dim=32)
