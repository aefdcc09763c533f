"""benchmarks/quality/result_paths.py: the result JSONs record paths relative to the repository (as given
when outside it), and expert_prediction_domain.py records a --predictor outside the repository."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "quality"))

import expert_prediction_domain  # noqa: E402
from result_paths import repo_path, repo_relative  # noqa: E402


def test_repo_path_inside_and_outside(tmp_path, monkeypatch):
    assert repo_path(REPO / "models" / "domain-moe") == "models/domain-moe"
    assert repo_path(str(REPO / "benchmarks" / "results")) == "benchmarks/results"
    outside = tmp_path / "p.safetensors"
    assert repo_path(outside) == str(outside)
    monkeypatch.chdir(REPO / "benchmarks")
    assert repo_path("results/cpu/x.json") == "benchmarks/results/cpu/x.json"


def test_repo_relative_rewrites_nested_strings():
    record = {"text": f"{REPO}/models/domain-moe/heldout/prose.txt", "n": 3, "x": None,
              "rows": [{"cluster_map": f"{REPO}/benchmarks/results/cpu/m.safetensors"}, 1.5],
              "stdout": f"wrote {REPO}/a.safetensors; use --cluster-map {REPO}/a.safetensors\n",
              "root": str(REPO), "other": "/tmp/elsewhere/file.txt"}
    assert repo_relative(record) == {
        "text": "models/domain-moe/heldout/prose.txt", "n": 3, "x": None,
        "rows": [{"cluster_map": "benchmarks/results/cpu/m.safetensors"}, 1.5],
        "stdout": "wrote a.safetensors; use --cluster-map a.safetensors\n", "root": ".",
        "other": "/tmp/elsewhere/file.txt"}


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside"])
def test_expert_prediction_domain_predictor_path(tmp_path, monkeypatch, inside):
    """The record is written (no ValueError from Path.relative_to) with the predictor's path as given outside
    the repository, repo-relative inside it, and no absolute repository path anywhere."""
    predictor = (REPO / "benchmarks" / "results" / "cpu" / "p.safetensors") if inside else tmp_path / "p.safetensors"
    out = tmp_path / "out.json"
    reply = json.dumps({"text": f"{REPO}/models/domain-moe/heldout/x.txt", "predictor": str(predictor),
                        "per_layer": {}})
    monkeypatch.setattr(expert_prediction_domain, "calibration_files", lambda out, chars: [])
    monkeypatch.setattr(expert_prediction_domain, "run", lambda cmd, label: "log line\n" + reply + "\n")
    monkeypatch.setattr(sys, "argv", ["expert_prediction_domain.py", "--predictor", str(predictor),
                                      "--out", str(out)])
    expert_prediction_domain.main()
    record = json.loads(out.read_text())
    expected = "benchmarks/results/cpu/p.safetensors" if inside else str(predictor)
    assert record["predictor"] == expected
    assert {d["predictor"] for d in record["domains"].values()} == {expected}
    assert {d["text"] for d in record["domains"].values()} == {"models/domain-moe/heldout/x.txt"}


def test_committed_results_name_no_checkout():
    """No result JSON under benchmarks/results records an absolute path into a checkout."""
    bad = []
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "/work/main/" in text or f"{REPO}/" in text:
            bad.append(str(path.relative_to(REPO)))
    assert not bad, f"absolute repository paths in {bad}"
