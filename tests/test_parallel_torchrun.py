"""The engine under torchrun on the CPU (gloo): every rank runs the same program, rank 0 becomes the
engine and the others serve it from inside the engine's constructor, then exit with code 0 when rank
0 shuts down. Greedy output equals the one-process engine's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moekv import LLM, SamplingParams
from moekv.engine.parallel import launcher_env

PROMPT = "The quick brown fox"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
REPO = Path(__file__).resolve().parents[1]


def one_process(ckpt) -> tuple[str, list[int]]:
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=128)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
    return out.text, list(out.token_ids)


def torchrun(args: list[str], cwd) -> subprocess.CompletedProcess:
    """torchrun with this checkout's moekv first on the path (cwd is elsewhere)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(TORCHRUN + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.slow
def test_generate_under_torchrun(mixtral_ckpt, tmp_path):
    text, _ = one_process(mixtral_ckpt)
    proc = torchrun(["-m", "moekv.cli", "generate", "--model", str(mixtral_ckpt), "--dtype", "float32",
                     "--max-model-len", "128", "--num-kv-blocks", "32", "--tensor-parallel-size", "2",
                     "--enable-expert-parallel", "--prompt", PROMPT, "--max-tokens", "10", "--ignore-eos",
                     "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert text and proc.stdout.count(text) == 1  # rank 0 printed it, the other rank printed nothing


@pytest.mark.slow
def test_llm_script_joins_the_programs_process_group(mixtral_ckpt, tmp_path):
    """A script that initialised torch.distributed itself: the engine joins that group; only rank 0
    gets past LLM(...), and both ranks exit cleanly once it shuts the engine down. Rank 1 destroys
    the program's group before its interpreter finalizes (a live gloo group there can abort it)."""
    _, ids = one_process(mixtral_ckpt)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, json, os
        import torch.distributed as dist
        from moekv import LLM, SamplingParams

        def record_group_at_exit():
            with open(f"exit{{os.environ['RANK']}}.json", "w") as f:
                json.dump(dist.is_initialized(), f)

        atexit.register(record_group_at_exit)
        dist.init_process_group("gloo")
        llm = LLM(model={str(mixtral_ckpt)!r}, dtype="float32", max_model_len=128, num_kv_blocks=32,
                  tensor_parallel_size=2)
        out = llm.generate({PROMPT!r}, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        with open(f"rank{{os.environ['RANK']}}.json", "w") as f:
            json.dump(list(out[0].outputs[0].token_ids), f)
        llm.engine.shutdown()
        assert dist.is_initialized()  # the program's own group is still there
        dist.destroy_process_group()
    """))
    proc = torchrun([str(script)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "rank0.json").read_text()) == ids
    assert not (tmp_path / "rank1.json").exists()  # rank 1 served inside LLM(...) and left with SystemExit(0)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"exit{rank}.json").read_text()) is False  # no group left at exit


def test_launcher_env_and_a_world_size_that_does_not_match(mixtral_ckpt, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert launcher_env() is None
    for key, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env = launcher_env()
    assert (env.rank, env.world_size, env.local_rank) == (0, 3, 0)
    with pytest.raises(ValueError, match="WORLD_SIZE=3"):
        LLM(model=str(mixtral_ckpt), dtype="float32", max_model_len=128, num_kv_blocks=32, tensor_parallel_size=2)
