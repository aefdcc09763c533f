from __future__ import annotations

import pytest

from tests.checkpoints import ARCHS, build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> folder of a tiny random checkpoint saved by transformers."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def mixtral_ckpt(checkpoints):
    return checkpoints["mixtral"]
