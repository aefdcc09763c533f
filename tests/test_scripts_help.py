"""Every benchmark and script with a command line builds its parser and prints --help on the CPU: a
script whose defaults or options fail to build (as a set union over a dict once did in
bench_decode_attention) fails here, not at the start of a GPU call."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for root in ("benchmarks", "scripts") for p in (REPO / root).rglob("*.py")
                 if "argparse" in (text := p.read_text()) and '__name__ == "__main__"' in text)


def test_scripts_found():
    assert len(SCRIPTS) > 30  # the glob itself works


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_help(script):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower()
