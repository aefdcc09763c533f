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


@pytest.mark.parametrize("call,exc,match", [
    (lambda llm: llm.generate("\ud800 x"), ValueError, r"prompt is not valid Unicode: a lone surrogate U\+D800"),
    (lambda llm: llm.generate([{"prompt": "ok \udfff"}]), ValueError, "prompt is not valid Unicode"),
    (lambda llm: llm.chat([{"role": "user", "content": "\ud83d"}]), ValueError, "messages is not valid Unicode"),
    (lambda llm: llm.tokenizer.encode("a\ud800"), ValueError, "text is not valid Unicode"),
    (lambda llm: llm.tokenizer.encode(None), TypeError, "text must be a str, got NoneType"),
    (lambda llm: llm.generate(None), TypeError, r"prompts must be a string, .* got NoneType"),
    (lambda llm: llm.generate(7), TypeError, "prompts must be .* got int"),
    (lambda llm: llm.chat([]), ValueError, "messages is an empty conversation"),
    (lambda llm: llm.chat([[{"role": "user", "content": "hi"}], []]), ValueError, r"messages\[1\] is an empty"),
    (lambda llm: llm.chat("hi"), TypeError, "messages must be a list"),
])
def test_bad_prompts_name_the_argument(llm, call, exc, match):
    """The raw errors these gave before (TypeError from the Rust tokenizer, 'NoneType' object is not
    iterable, or a generation from an empty chat) become errors that name the argument."""
    with pytest.raises(exc, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(llm, monkeypatch):
    tok = llm.tokenizer
    bound = tok.max_chars_per_token
    assert bound is not None and bound == max(len(t) for t in json.loads(
        (llm.engine.config.model / "tokenizer.json").read_text())["model"]["vocab"])
    calls = []
    monkeypatch.setattr(tok._tok, "encode", lambda *a, **k: calls.append(a) or pytest.fail("tokenized"))
    n = int(bound * llm.engine.max_model_len) + 1
    with pytest.raises(PromptTooLongError, match=f"the prompt has {n} characters: at least 33 tokens"):
        llm.generate("x" * n)
    assert not calls


def test_chars_per_token_bound_only_where_it_holds():
    from moekv.models.tokenizer import _chars_per_token_bound

    bpe = {"model": {"type": "BPE", "vocab": {"a": 0, "abcd": 1}, "unk_token": None}, "added_tokens": []}
    assert _chars_per_token_bound(bpe) == 4
    assert _chars_per_token_bound({**bpe, "normalizer": {"type": "NFC"}}) == 12  # composition shrinks text
    assert _chars_per_token_bound({**bpe, "added_tokens": [{"content": "<|im_start|>"}]}) == 12
    for spec in [{**bpe, "pre_tokenizer": {"type": "Whitespace"}},  # drops spaces: no bound
                 {**bpe, "normalizer": {"type": "Strip"}},
                 {**bpe, "normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
                 {**bpe, "model": {**bpe["model"], "unk_token": "<unk>", "fuse_unk": True}},
                 {"model": {"type": "WordPiece", "vocab": {"a": 0}}}]:
        assert _chars_per_token_bound(spec) is None, spec
    # the real case: a text of N characters never tokenizes to fewer than N / bound tokens
    from moekv.config import default_model_path
    from moekv.models.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    for text in ["x" * 1000, " " * 1000, "the " * 300, "é日本" * 200, "<|endoftext|>" * 50]:
        assert len(tok.encode(text)) * tok.max_chars_per_token >= len(text), text[:20]
