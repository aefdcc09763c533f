"""Every benchmark and script with a command line builds its parser and prints --help on the CPU: a
script whose defaults or options fail to build (as a set union over a dict once did in
bench_decode_attention) fails here, not at the start of a GPU call. One subprocess runs them all
(runpy, as `python SCRIPT --help` would, each in a fork), so torch is imported once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(REPO)) for root in ("benchmarks", "scripts") for p in (REPO / root).rglob("*.py")
                 if "argparse" in (text := p.read_text()) and '__name__ == "__main__"' in text)

RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
import torch  # imported once; each script runs in a fork of this process, so none sees another's state
failures = {}
for script in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        sys.argv = [script, "--help"]
        sys.path.insert(0, script.rsplit("/", 1)[0])
        out, message = io.StringIO(), ""
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(script, run_name="__main__")
            message = "exited without SystemExit"
        except SystemExit as e:
            if e.code not in (0, None):
                message = f"exit {e.code}"
            elif "usage" not in out.getvalue().lower():
                message = "no usage line"
        except BaseException:
            message = traceback.format_exc()[-1500:]
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    if message:
        failures[script] = message
print(json.dumps(failures))
"""


def test_scripts_found():
    assert len(SCRIPTS) > 30  # the glob itself works


@pytest.mark.slow
def test_every_script_prints_help():
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(SCRIPTS)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failures = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
