"""LLM's lifetime and its conversation checks: close() / `with` / garbage collection release a parallel
engine's ranks (so another may start in the process), a parallel start-up whose rank dies names the
likely cause instead of hanging, and LLM.chat refuses the roles the server refuses."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moekv import LLM, SamplingParams
from moekv.config import default_model_path

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_chat_refuses_an_unknown_role():
    llm = LLM(str(default_model_path()), dtype="float32", max_model_len=64)
    good = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert llm.chat(good, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[1\]\.role='wizard' is not a chat role; accepted: 'system', "
                                         r"'developer', 'user', 'assistant', 'tool'"):
        llm.chat([good[0], {"role": "wizard", "content": "Hello"}], GREEDY)
    assert llm.engine.block_manager.num_used_blocks == 0


def _parallel(ckpt) -> LLM:
    return LLM(model=str(ckpt), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=16,
               tensor_parallel_size=2, distributed_timeout=60)


@pytest.mark.slow
def test_close_with_and_garbage_collection_release_the_ranks(mixtral_ckpt):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with _parallel(mixtral_ckpt) as llm:
        first = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
        procs = list(llm.engine.runner.parallel.procs)
    assert not any(p.is_alive() for p in procs)  # `with` closed it: the ranks stopped
    llm = _parallel(mixtral_ckpt)  # a second parallel engine in the same process
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == first
    procs = list(llm.engine.runner.parallel.procs)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in procs)  # collected: released
    llm = _parallel(mixtral_ckpt)
    llm.close()
    llm.close()  # idempotent
    assert not any(p.is_alive() for p in llm.engine.runner.parallel.procs)


@pytest.mark.slow
def test_unguarded_program_fails_at_start_naming_the_main_guard(mixtral_ckpt, tmp_path):
    """spawn imports the program again in the rank: without `if __name__ == "__main__":` the rank builds
    an engine of its own and dies; rank 0 raises at once instead of waiting for it without end."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from moekv import LLM
        llm = LLM(model={str(mixtral_ckpt)!r}, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=16,
                  tensor_parallel_size=2)
        print("built")
    """))
    start = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "built" not in r.stdout
    assert 'if __name__ == "__main__":' in r.stderr and "rank 1 of the tensor-parallel engine exited" in r.stderr
    assert time.monotonic() - start < 120
