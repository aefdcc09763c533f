"""benchmarks/e2e/bench_parallel_cost.py's CPU rehearsal: the parallel code path at world size 1
(the engine's ParallelGroup on gloo, shard_model, ExpertParallel dispatch, dynamic and static) gives the single-device
path's logits exactly, and every variant of every point is timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_matches_single_path(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "benchmarks/e2e/bench_parallel_cost.py", "--smoke", "--iters", "2",
                           "--rounds", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["compute_backend"] == "gloo" and record["layers"] == 2
    assert len(record["rows"]) == 4  # bf16 and int4 at two points
    for row in record["rows"]:
        assert "skipped" not in row, row
        assert row["protocol_ms"] > 0
        for variant in ("single", "tp", "tp+ep", "tp+ep-static"):
            assert row[variant]["tpot_eager_ms"] > 0
            assert row[variant]["max_abs_logit_diff_vs_single"] == 0.0
