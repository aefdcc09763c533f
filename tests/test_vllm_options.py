"""vLLM's everyday options under vLLM's names: tokenizer, skip_tokenizer_init, seed (and the CLI
flags of these and of enable_prefix_caching)."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from moekv import LLM, EngineConfig, SamplingParams
from moekv.config import default_model_path

MODEL = default_model_path()
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def no_tokenizer_ckpt(tmp_path_factory) -> Path:
    """The shipped model without tokenizer.json (nor tokenizer_config.json)."""
    folder = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(MODEL / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(MODEL, dtype="float32", max_model_len=128)


def test_tokenizer_option_replaces_the_checkpoints(no_tokenizer_ckpt, reference):
    """tokenizer= a tokenizer.json file or a folder: same ids and same text as the checkpoint that
    ships it; its chat template comes from the folder it sits in."""
    text = "The quick brown fox jumps over the lazy dog."
    want = reference.generate(text, GREEDY)[0]
    for tok in (MODEL / "tokenizer.json", MODEL):
        llm = LLM(no_tokenizer_ckpt, dtype="float32", max_model_len=128, tokenizer=str(tok))
        got = llm.generate(text, GREEDY)[0]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].text == want.outputs[0].text
        assert llm.tokenizer.chat_template == reference.tokenizer.chat_template


def test_a_checkpoint_without_tokenizer_names_the_way_out(no_tokenizer_ckpt):
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found.*--tokenizer.*skip_tokenizer_init"):
        LLM(no_tokenizer_ckpt, dtype="float32")


def test_bad_tokenizer_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer='.*nope' is neither a tokenizer.json file nor a folder"):
        EngineConfig(tokenizer=tmp_path / "nope")
    with pytest.raises(ValueError, match="tokenizer=.*skip_tokenizer_init=True contradict"):
        EngineConfig(tokenizer=MODEL, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init=1 must be True or False"):
        EngineConfig(skip_tokenizer_init=1)


def test_skip_tokenizer_init_takes_token_ids_only(no_tokenizer_ckpt, reference):
    """No tokenizer loaded (a folder without tokenizer.json loads): token-id prompts give the tokens
    of an engine with a tokenizer and empty text; text, chat and stop strings are clear ValueErrors."""
    llm = LLM(no_tokenizer_ckpt, dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": reference.tokenizer.encode("Once upon a time")}
    want = reference.generate(prompt, GREEDY)[0].outputs[0]
    got = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert got.token_ids == want.token_ids and want.text != "" and got.text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init=True.*text prompts cannot be tokenized"):
        llm.generate("Once upon a time", GREEDY)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True.*chat messages"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        llm.generate(prompt, SamplingParams(stop=["."]))
    assert not llm.engine.has_unfinished_requests()


def test_server_without_tokenizer_answers_text_with_a_400(no_tokenizer_ckpt):
    from tests.server_harness import ServerThread

    with ServerThread(no_tokenizer_ckpt, max_model_len=128, skip_tokenizer_init=True) as srv:
        url = srv.url
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"]) == 0 and r.json()["usage"]["completion_tokens"] == 3
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3}),
                           ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
                           ("/tokenize", {"model": "tiny", "prompt": "hello"})):
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 400, (path, r.text)
            assert "skip_tokenizer_init" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200


def test_engine_seed_sets_unseeded_sampling_only(reference):
    """seed (vLLM's engine seed): the same engine seed repeats unseeded samples, another changes
    them; a request's own seed gives the same tokens whatever the engine seed."""
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    own = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234)

    def run(engine_seed, params):
        llm = LLM(MODEL, dtype="float32", max_model_len=128, seed=engine_seed)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    assert run(1, free) == run(1, free)
    assert run(1, free) != run(2, free)
    assert run(1, own) == run(2, own)


def test_cli_seed_flags():
    """--seed is the engine seed in every command, as vLLM's (--engine-seed is the same flag); generate's
    request seed is --request-seed, eval retrieval's passkey seed --key-seed."""
    from moekv.cli import build_parser, engine_config_from

    parser = build_parser()
    for flag in ("--seed", "--engine-seed"):
        assert engine_config_from(parser.parse_args(["serve", flag, "5"])).seed == 5
        assert engine_config_from(parser.parse_args(["eval", "ppl", "--text", "t", flag, "6"])).seed == 6
        assert engine_config_from(parser.parse_args(["generate", "--prompt", "x", flag, "4"])).seed == 4
        args = parser.parse_args(["eval", "retrieval", "--text", "t", flag, "8", "--key-seed", "9"])
        assert engine_config_from(args).seed == 8 and args.key_seed == 9
    args = parser.parse_args(["generate", "--prompt", "x", "--request-seed", "3", "--seed", "4"])
    assert args.request_seed == 3 and engine_config_from(args).seed == 4
    args = parser.parse_args(["generate", "--prompt", "x"])
    assert args.request_seed is None and engine_config_from(args).seed == 0
    assert parser.parse_args(["eval", "retrieval", "--text", "t"]).key_seed == 0


def test_cli_flags_of_the_new_options(tmp_path):
    from moekv.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--tokenizer", str(MODEL / "tokenizer.json"),
                                      "--gpu-memory-utilization", "0.5"])
    cfg = engine_config_from(args)
    assert (cfg.cache.enable_prefix_caching, cfg.tokenizer, cfg.skip_tokenizer_init,
            cfg.cache.gpu_memory_utilization) == (True, MODEL / "tokenizer.json", False, 0.5)
    cfg = engine_config_from(build_parser().parse_args(["serve", "--skip-tokenizer-init"]))
    assert cfg.skip_tokenizer_init and cfg.tokenizer is None and not cfg.cache.enable_prefix_caching


def test_generate_command_per_request_seed(capsys):
    """`moekv generate --request-seed N` samples the same text for the same N, whatever --seed."""
    from moekv.cli import main

    def run(*extra):
        assert main(["generate", "--prompt", "Once", "--max-tokens", "12", "--temperature", "1.0", "--ignore-eos",
                     "--quiet", "--dtype", "float32", "--max-model-len", "64", *extra]) == 0
        return capsys.readouterr().out

    assert run("--request-seed", "7", "--seed", "1") == run("--request-seed", "7", "--seed", "2")
    assert run("--seed", "1") != run("--seed", "2")  # without a request seed, the engine's decides
