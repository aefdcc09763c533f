"""The `moekv` command line, run as a user would run it."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moekv.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_generate_streams_text(mixtral_ckpt):
    r = run_cli("generate", "--model", str(mixtral_ckpt), "--prompt", "It was the best", "--max-tokens", "8",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("It was the best")
    assert "8 tokens in" in r.stderr and "finish_reason=length" in r.stderr


@pytest.mark.slow
def test_info_prints_counts_and_kv_bytes(mixtral_ckpt):
    r = run_cli("info", "--model", str(mixtral_ckpt))
    assert r.returncode == 0, r.stderr
    assert "MixtralForCausalLM" in r.stdout
    # 2 layers x (K+V) x 2 KV heads x 16 dims x 2 bytes = 256 bytes per token in bf16
    assert "bf16" in r.stdout and " 256 bytes/token" in r.stdout
    assert "active per token" in r.stdout


@pytest.mark.slow
def test_bad_input_is_one_clear_line(mixtral_ckpt, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "model folder not found" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--model", str(mixtral_ckpt), "--prompt", "x", "--kv-cache-dtype", "int3")
    assert r.returncode == 2 and "kv_cache_dtype='int3' is unknown" in r.stderr


@pytest.mark.slow
def test_engine_runs_without_importing_transformers(mixtral_ckpt):
    """Loading and generating must not pull in transformers (a dev dependency only)."""
    code = ("import sys; from moekv import LLM, SamplingParams; "
            f"LLM({str(mixtral_ckpt)!r}, max_model_len=32).generate('hi', SamplingParams(max_tokens=2)); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_default_model_generates_english(tmp_path):
    """No --model: the bundled model answers with words, and with its generation_config.json's sampling
    settings it does not loop (greedy, it repeats "he was in a fat" three times in 48 tokens)."""
    r = run_cli("generate", "--prompt", "It was a dark and stormy night", "--max-tokens", "48", "--quiet")
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert len(words) >= 16 and sum(w.strip(".,!?;:'\"“”’").isalpha() for w in words) >= len(words) // 2
    lowered = [w.strip(".,!?;:'\"“”’").lower() for w in words]
    trigrams = Counter(zip(lowered, lowered[1:], lowered[2:]))
    assert max(trigrams.values()) <= 2, trigrams.most_common(3)


def test_generate_sampling_flags_default_to_generation_config(mixtral_ckpt, monkeypatch):
    """--temperature, --top-p, --top-k and --repetition-penalty: a flag given wins, then the checkpoint's
    generation_config.json, then greedy without penalty (as the server and LLM default to the file too)."""
    from moekv.cli import build_parser, engine_config_from
    from moekv.cli.generate import _generate
    from moekv.engine.llm_engine import LLMEngine

    parser = build_parser()
    base = ["generate", "--model", str(mixtral_ckpt), "--prompt", "x", "--max-tokens", "2", "--quiet"]
    engine = LLMEngine(engine_config_from(parser.parse_args(base)))
    seen = []
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda rid, prompt, params, **kw: (seen.append(params),
                                                                                 add(rid, prompt, params, **kw))[1])

    def fields_for(generation_config, *flags):
        engine.generation_config = generation_config
        assert _generate(engine, parser.parse_args([*base, *flags])) == 0
        p = seen.pop()
        return p.temperature, p.top_p, p.top_k, p.repetition_penalty

    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    assert fields_for({}) == (0.0, 1.0, -1, 1.0)
    assert fields_for({"do_sample": False, "top_p": 0.5}) == (0.0, 0.5, -1, 1.0)
    assert fields_for(sampling) == (0.7, 0.9, 50, 1.1)
    assert fields_for(sampling, "--temperature", "0", "--top-k", "5") == (0.0, 0.9, 5, 1.1)
    flags = ("--temperature", "1.2", "--top-p", "0.8", "--repetition-penalty", "1.3")
    assert fields_for({}, *flags) == (1.2, 0.8, -1, 1.3)


def test_async_scheduling_flag_reaches_the_engine_config(mixtral_ckpt):
    """--async-scheduling / --no-async-scheduling set EngineConfig.scheduler.async_scheduling; without either it
    is None, which means on for CUDA (the GPU tests of test_cuda_graphs run with that default) and off on
    the CPU."""
    from moekv.cli import build_parser, engine_config_from
    from moekv.config import EngineConfig

    parser = build_parser()
    seen = {}
    for flags, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = parser.parse_args(["generate", "--model", str(mixtral_ckpt), "--prompt", "x", *flags])
        seen[tuple(flags)] = engine_config_from(args).scheduler.async_scheduling
        assert seen[tuple(flags)] is want, flags
    assert not EngineConfig(model=mixtral_ckpt).async_scheduling_enabled  # the CPU's default
    assert EngineConfig(model=mixtral_ckpt, async_scheduling=True).async_scheduling_enabled


def test_every_engine_config_field_has_a_flag_with_its_default():
    """The engine flags are EngineConfig's flat fields (its own, every group's, every KV format's
    options): each one a flag, with the field's default, and the parsed defaults build the default
    EngineConfig."""
    import dataclasses
    from pathlib import Path

    from moekv.cli import build_parser
    from moekv.cli.engine_args import engine_config_from, flag_name
    from moekv.config import EngineConfig, config_groups, flat_fields
    from moekv.kvcache.formats import engine_options

    # generate runs one prompt, so its pool holds one sequence (the only default a command changes)
    own = {"generate": {"max_num_seqs": 1}}
    for command in (["generate", "--prompt", "x"], ["serve"], ["eval", "ppl", "--text", "t"],
                    ["eval", "routing", "--text", "t"], ["eval", "retrieval", "--text", "t"]):
        args = build_parser().parse_args(command)
        changed = own.get(command[0], {})
        for f in flat_fields():
            default = changed.get(f.name, f.default)
            assert getattr(args, f.name) == (str(default) if isinstance(default, Path) else default), \
                (command[0], flag_name(f))
        assert engine_config_from(args) == EngineConfig(**changed)
    names = {f.name for f in flat_fields()}
    for group, cls in config_groups().items():  # every field of every group, but the formats' options' holder
        assert {f.name for f in dataclasses.fields(cls)} - {"kv_options"} <= names, group
    assert {option.field for option in engine_options().values()} <= names
    flags = {flag_name(f) for f in flat_fields()}
    assert {"--kv-cache-dtype", "--max-model-len", "--block-size", "--enforce-eager", "--async-scheduling",
            "--cluster-map", "--load-format", "--kv-group-size", "--kv-rank-after-prompt"} <= flags


def test_engine_flags_reach_the_engine_config():
    from moekv.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["serve", "--max-model-len", "64", "--block-size", "32", "--kv-cache-dtype",
                                      "tiered", "--enforce-eager", "--no-async-scheduling", "--engine-seed", "7",
                                      "--kv-tier1-fraction", "0.25", "--load-format", "dummy"])
    cfg = engine_config_from(args)
    assert (cfg.max_model_len, cfg.cache.block_size, cfg.cache.kv_cache_dtype, cfg.enforce_eager,
            cfg.scheduler.async_scheduling, cfg.seed, cfg.cache.kv_options["tier1_fraction"], cfg.load_format) == (
                64, 32, "tiered", True, False, 7, 0.25, "dummy")


def test_kv_format_names_match_the_registry():
    from moekv.kvcache.formats import _PLAIN, compressed_formats
    from moekv.kvcache.formats.names import KV_FORMAT_NAMES

    assert (*_PLAIN, *compressed_formats()) == KV_FORMAT_NAMES


@pytest.mark.slow
def test_info_rows_name_their_page_size_and_eval_refuses_stride_0(mixtral_ckpt, tmp_path):
    r = run_cli("info", "--model", str(mixtral_ckpt))
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if "bytes/token" in line}
    assert rows["bf16"].endswith("(block_size 16)") and rows["nuq2"].endswith("(block_size 64)")
    # a sequence's bits count its 16-bit window: nuq2's 128 tokens cost more at 4k than at 32k
    bits = {name: [float(w) for w in re.findall(r"([\d.]+) (?:bits/element|at 4k|at 32k)", line)]
            for name, line in rows.items()}
    assert bits["nuq2"][1] > bits["nuq2"][2] > bits["nuq2"][0]
    r = run_cli("info", "--model", str(mixtral_ckpt), "--kv-residual", "0")
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["nuq2"])
    assert [float(w) for w in re.findall(r"([\d.]+) at (?:4k|32k)", row)] < bits["nuq2"][1:]
    # and its sinks: 64 tokens in 16 bits add 16 * 64 / L bits per element at L tokens
    r = run_cli("info", "--model", str(mixtral_ckpt), "--kv-sink-tokens", "64")
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["nuq2"])
    at = [float(w) for w in re.findall(r"([\d.]+) at (?:4k|32k)", row)]
    assert at == pytest.approx([b + 16 * 64 / n for b, n in zip(bits["nuq2"][1:], (4096, 32768))], abs=0.011)
    text = tmp_path / "t.txt"
    text.write_text("some words " * 20)
    for flag, value in (("--stride", "0"), ("--window", "1")):
        r = run_cli("eval", "ppl", "--model", str(mixtral_ckpt), "--text", str(text), flag, value)
        assert r.returncode == 2 and f"argument {flag}: {value} is out of range" in r.stderr


def test_version_prints_the_package_version():
    import moekv

    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"moekv {moekv.__version__}"


def _parsers(parser, name="moekv"):
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_help_shows_each_flags_default():
    """Every optional flag of every command has help text that ends in its default, or names it."""
    import argparse

    from moekv.cli import build_parser

    checked = set()
    for name, parser in _parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            assert action.help, (name, action.option_strings)
            formatted = parser.formatter_class(name)._get_help_string(action)
            assert "(default" in formatted, (name, action.option_strings, formatted)
            checked.add(name)
        if name == "moekv generate":
            assert "--max-tokens MAX_TOKENS most tokens to generate (default: 64)" in text
            assert "--kv-cache-memory-gb KV_CACHE_MEMORY_GB CPU: GB of KV pages" in text and "(default: 1.0)" in text
    assert {"moekv generate", "moekv serve", "moekv eval ppl", "moekv info"} <= checked


def test_stop_takes_backslash_escapes():
    from moekv.cli import build_parser
    from moekv.cli.generate import unescape

    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb") == "a\tb" and unescape("\\\\") == "\\"
    assert unescape("é — “x”") == "é — “x”" and unescape(r"é\n") == "é\n"  # non-ASCII stays as it is
    assert unescape("plain") == "plain"
    args = build_parser().parse_args(["generate", "--prompt", "x", "--stop", r"\n\n", "--stop", "END"])
    assert args.stop == ["\n\n", "END"]
    r = run_cli("generate", "--prompt", "x", "--stop", "ends in a backslash\\")
    assert r.returncode == 2 and "--stop" in r.stderr and "bad backslash escape" in r.stderr


def test_generate_warns_when_max_tokens_exceeds_the_context(mixtral_ckpt, capsys):
    from moekv.cli import main

    argv = ["generate", "--model", str(mixtral_ckpt), "--prompt", "It was", "--ignore-eos", "--max-model-len", "16"]
    assert main([*argv, "--max-tokens", "100"]) == 0
    err = capsys.readouterr().err
    assert "warning: --max-tokens 100 does not fit the model's context (max_model_len=16" in err, err
    room = int(err.split("generating at most ")[1].split()[0])
    assert f"[{room} tokens in" in err and "finish_reason=length" in err
    assert main([*argv, "--max-tokens", str(room)]) == 0  # fits: no warning
    assert "warning" not in capsys.readouterr().err


def test_engine_flags_are_grouped_with_the_cuda_only_ones_apart():
    """Every command with engine flags lists them by configuration group, and the flags that change
    nothing on the CPU under "engine: CUDA only" (and nowhere else)."""
    from moekv.cli import build_parser

    cuda_only = {"--enforce-eager", "--decode-kernel", "--gpu-memory-utilization", "--expert-l2-prefetch",
                 "--expert-l2-prefetch-mb"}
    seen = 0
    for name, parser in _parsers(build_parser()):
        groups = {g.title: {s for a in g._group_actions for s in a.option_strings} for g in parser._action_groups}
        if "engine" not in groups:
            continue
        seen += 1
        assert groups["engine: CUDA only"] == cuda_only, name
        assert {"engine: KV cache", "engine: scheduler", "engine: parallel"} <= set(groups), name
        assert not cuda_only & (groups["engine"] | groups["engine: KV cache"] | groups["engine: experts"]), name
        assert "--kv-cache-dtype" in groups["engine: KV cache"] and "--threads" in groups["engine: parallel"]
    assert seen >= 5  # generate, serve, eval ppl / routing / retrieval, ...
