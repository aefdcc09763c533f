"""Bad input is refused up front with an error that names the problem and what is accepted."""
from __future__ import annotations

import json
import shutil

import pytest

from moekv import LLM, EngineConfig, SamplingParams
from moekv.engine.llm_engine import PromptTooLongError
from moekv.models.loader import CheckpointError
from moekv.models.model_config import UnsupportedModelError


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field,value,match", [
    ("kv_cache_dtype", "int3", r"kv_cache_dtype='int3' is unknown; accepted: \['auto'"),
    ("device", "tpu", r"device='tpu' is not supported; accepted: \['cpu', 'cuda'\]"),
    ("dtype", "float8", r"dtype='float8' is not supported"),
    ("block_size", 12, r"block_size=12 must be a power of two"),
    ("max_num_seqs", 0, r"max_num_seqs=0"),
    ("max_model_len", 1, r"max_model_len=1"),
    ("async_scheduling", "yes", r"async_scheduling='yes' must be True, False or None"),
])
def test_engine_config_rejects(field, value, match, mixtral_ckpt):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=mixtral_ckpt, **{field: value})


def test_missing_folder_and_files(tmp_path, mixtral_ckpt):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        LLM(tmp_path / "nope")
    for name, match in [("config.json", "config.json not found"), ("model.safetensors", r"no \*\.safetensors"),
                        ("tokenizer.json", "tokenizer.json not found")]:
        ckpt = copy_ckpt(mixtral_ckpt, tmp_path / name)
        (ckpt / name).unlink()
        with pytest.raises(FileNotFoundError, match=match):
            LLM(ckpt)


def test_malformed_files(tmp_path, mixtral_ckpt):
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "json")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        LLM(ckpt)
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "weights")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        LLM(ckpt)
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "shape")
    edit_config(ckpt, intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"has shape .* config.json implies"):
        LLM(ckpt)


def test_unsupported_architecture(tmp_path, mixtral_ckpt):
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "arch")
    edit_config(ckpt, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"'LlamaForCausalLM' is not supported; accepted: \['Mixtral"):
        LLM(ckpt)
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "rope")
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn' is not supported"):
        LLM(ckpt)


def test_sharded_checkpoint_loads_like_single(tmp_path, mixtral_ckpt):
    from tests.checkpoints import load_hf, write_tokenizer

    sharded = tmp_path / "sharded"
    load_hf(mixtral_ckpt).save_pretrained(sharded, max_shard_size="100KB")
    write_tokenizer(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    a = LLM(mixtral_ckpt, dtype="float32", max_model_len=64).score(prompt)[0]
    b = LLM(sharded, dtype="float32", max_model_len=64).score(prompt)[0]
    assert (a - b).abs().max().item() == 0.0
    next(p for p in sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards listed in model.safetensors.index.json are missing"):
        LLM(sharded)


def test_pool_too_small_for_one_sequence(mixtral_ckpt):
    with pytest.raises(ValueError, match=r"holds 2 pages .* max_model_len=64 needs 4"):
        LLM(mixtral_ckpt, max_model_len=64, num_kv_blocks=2)


def test_max_model_len_beyond_the_model(mixtral_ckpt):
    with pytest.raises(ValueError, match=r"max_model_len=100000 exceeds the model's max_position_embeddings=256"):
        LLM(mixtral_ckpt, max_model_len=100000)


@pytest.fixture(scope="module")
def llm(mixtral_ckpt):
    return LLM(mixtral_ckpt, dtype="float32", max_model_len=32)


def test_prompts_are_all_checked_before_any_runs(llm):
    with pytest.raises(PromptTooLongError, match=r"prompt has 40 tokens but max_model_len=32 .* at most 31"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3] * 40}])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 99999]}, r"outside the vocabulary \[0, 320\)"),
    ({"prompt_token_ids": "abc"}, "must be a list of integers"),
    ({"text": "hi"}, "needs 'prompt_token_ids'"),
])
def test_malformed_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt])


def test_sampling_params_checked_when_mutated(llm):
    sp = SamplingParams(max_tokens=4)
    sp.temperature = -0.5
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=-0.5 is out of range"):
        llm.generate(["hi"], sp)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])


def test_page_alignment(tmp_path, mixtral_ckpt):
    ckpt = copy_ckpt(mixtral_ckpt, tmp_path / "align")
    with pytest.raises(ValueError,
                       match=r"pages must be a multiple of 128 bytes: use a block_size that is a multiple of 4"):
        LLM(ckpt, dtype="bfloat16", block_size=2)
