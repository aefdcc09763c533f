"""The decode kernel a format's pools are laid out for is configuration (EngineConfig.cache.decode_kernel,
--decode-kernel), carried by the format object: validated, reaching the format the engine builds, each
format object keeping its own layout beside others in one process, and MOEKV_DECODE_KERNEL in the
environment refused rather than read. The CPU has no Gluon kernels: there 'auto' keeps slabs and
'gluon' lays covered shapes out in fragment order (the reference path reads them)."""
from __future__ import annotations

import pytest
import torch

from moekv.config import EngineConfig
from moekv.kvcache.formats import DECODE_KERNELS, get_kv_format, kv_format_options
from moekv.kvcache.formats.nuq2 import NUQ2Format

H, P, D = 2, 64, 128
CPU = torch.device("cpu")


def test_engine_config_validates_decode_kernel():
    assert DECODE_KERNELS == ("auto", "triton", "gluon")
    assert EngineConfig().cache.decode_kernel == "auto"
    for choice in DECODE_KERNELS:
        assert EngineConfig(decode_kernel=choice).cache.decode_kernel == choice
    for bad in ("cuda", "Triton", ""):
        with pytest.raises(ValueError) as e:
            EngineConfig(decode_kernel=bad)
        assert f"decode_kernel={bad!r} is not supported; accepted: ['auto', 'triton', 'gluon']" in str(e.value)


def test_the_flag_is_made_from_the_field():
    from moekv.cli import build_parser, engine_config_from

    parser = build_parser()
    args = parser.parse_args(["serve", "--decode-kernel", "triton"])
    assert engine_config_from(args).cache.decode_kernel == "triton"
    assert engine_config_from(parser.parse_args(["serve"])).cache.decode_kernel == "auto"
    with pytest.raises(SystemExit):  # argparse's choices, from the field's metadata
        parser.parse_args(["serve", "--decode-kernel", "cuda"])


def test_the_registry_validates_it_and_does_not_count_it_as_an_option():
    with pytest.raises(ValueError, match=r"decode_kernel='cuda' is not supported; accepted: \['auto', 'triton', "):
        get_kv_format("nuq2", decode_kernel="cuda")
    for name in ("bf16", "int4", "nuq2", "tiered"):
        assert "decode_kernel" not in kv_format_options(name)
        assert get_kv_format(name, decode_kernel="triton").decode_kernel == "triton"
    with pytest.raises(ValueError) as e:  # an unknown option's message lists the options, not decode_kernel
        get_kv_format("int4", decode_kernel="gluon", group_sise=32)
    assert "'group_sise'" in str(e.value) and "decode_kernel" not in str(e.value)


def test_two_formats_with_different_kernels_keep_their_own_layouts():
    """nuq2 laid out for both kernels in one process, in either order: page_bytes and allocate follow
    each object's own choice (nuq2's fragment tables take more bytes a page than its slabs)."""
    gluon = get_kv_format("nuq2", torch.float32, decode_kernel="gluon", codebook="page")
    triton = get_kv_format("nuq2", torch.float32, decode_kernel="triton", codebook="page")
    auto = get_kv_format("nuq2", torch.float32, codebook="page")
    for _ in range(2):
        slab_bytes = triton.page_bytes(H, P, D)
        assert gluon.page_bytes(H, P, D) > slab_bytes
        assert auto.page_bytes(H, P, D) == slab_bytes  # auto on the CPU: slabs
        frag_pool = gluon.allocate(3, H, P, D, CPU, 2, torch.float32)
        slab_pool = triton.allocate(3, H, P, D, CPU, 2, torch.float32)
        assert gluon.is_fragment_pool(frag_pool) and "k_pages" not in frag_pool.tensors
        assert not triton.is_fragment_pool(slab_pool)
        assert slab_pool["k_pages"].shape == (3, H, triton.layout("key", P, D).slab_bytes)
    # a shape the Gluon kernel does not cover: 'gluon' says what it covers, 'triton' takes slabs
    with pytest.raises(ValueError, match="decode_kernel='gluon': nuq2's Gluon kernel covers block_size 64"):
        gluon.allocate(3, H, 32, D, CPU, 2, torch.float32)
    assert "k_pages" in triton.allocate(3, H, 32, D, CPU, 2, torch.float32).tensors


def test_the_engine_builds_its_format_with_the_configured_kernel(mixtral_ckpt):
    from moekv import LLM

    llm = LLM(mixtral_ckpt, kv_cache_dtype="nuq2", kv_codebook="page", decode_kernel="triton", max_model_len=128,
              dtype="float32")
    assert llm.engine.runner.kv_format.decode_kernel == "triton"
    # the tiny model's head_dim 16 is no shape a Gluon kernel covers
    with pytest.raises(ValueError, match="decode_kernel='gluon': nuq2's Gluon kernel covers"):
        LLM(mixtral_ckpt, kv_cache_dtype="nuq2", kv_codebook="page", decode_kernel="gluon", max_model_len=128,
            dtype="float32")


def test_the_environment_variable_is_refused_not_read(monkeypatch, mixtral_ckpt, capsys):
    from moekv.cli import main

    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "gluon")
    # a format built without the registry reads no environment: 'auto' on the CPU keeps slabs
    assert not NUQ2Format(codebook="page").fragment_pages(P, D)
    for build in (lambda: get_kv_format("nuq2", codebook="page"), EngineConfig):
        with pytest.raises(ValueError) as e:
            build()
        message = str(e.value)
        assert "MOEKV_DECODE_KERNEL='gluon' is set, but moekv does not read it" in message
        assert "--decode-kernel gluon" in message and "unset MOEKV_DECODE_KERNEL" in message
    monkeypatch.setenv("MOEKV_DECODE_KERNEL", "cuda")
    with pytest.raises(ValueError, match=r"--decode-kernel auto\|triton\|gluon"):
        EngineConfig()
    assert main(["info", "--model", str(mixtral_ckpt)]) == 2  # one line, not one error per format
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moekv info: error: MOEKV_DECODE_KERNEL='cuda' is set")
    monkeypatch.delenv("MOEKV_DECODE_KERNEL")
    assert get_kv_format("nuq2", codebook="page").decode_kernel == "auto"
