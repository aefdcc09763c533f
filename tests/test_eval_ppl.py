"""The perplexity harness on a tiny random checkpoint: windows, short texts, bad files, and the
transformers oracle."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from moekv import LLM
from moekv.eval.perplexity import perplexity, perplexity_transformers, read_text_tokens, windows

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 6


@pytest.mark.parametrize("n,window,stride", [(100, 32, 16), (100, 32, 32), (20, 32, 16), (2, 8, 4), (33, 32, 8)])
def test_windows_score_every_token_once(n, window, stride):
    plan = windows(n, window, stride)
    scored = [p for _, _, first in plan for p in range(first, _end(plan, first))]
    assert scored == list(range(1, n))
    for begin, end, first in plan:
        assert end - begin <= window and begin < first <= end
        assert first - begin >= min(window - stride, first) or begin == 0  # context kept from the overlap


def _end(plan, first):
    return next(end for _, end, f in plan if f == first)


def test_windows_reject_bad_shapes():
    with pytest.raises(ValueError, match="stride"):
        windows(10, 8, 9)


@pytest.fixture(scope="module")
def llm(mixtral_ckpt):
    return LLM(mixtral_ckpt, dtype="float32", kv_cache_dtype="fp32", max_model_len=32)


def brute_force_ppl(llm, ids, window, stride):
    """Independent of windows(): score token i from the window that the harness should use."""
    total, count, scored = 0.0, 0, 1
    begin = 0
    while scored < len(ids):
        end = min(begin + window, len(ids))
        logits = llm.score([{"prompt_token_ids": ids[begin:end]}])[0]
        lp = torch.log_softmax(logits.double(), -1)
        for pos in range(scored, end):
            total -= lp[pos - 1 - begin, ids[pos]].item()
            count += 1
        scored = end
        begin = min(begin + stride, end - 1)
    return math.exp(total / count), count


def test_windows_shorter_than_the_text(llm, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    ids = read_text_tokens(llm.tokenizer, path, None)
    assert len(ids) > 3 * 32
    result = perplexity(llm, path, window=32, stride=16, progress=False)
    expected, count = brute_force_ppl(llm, ids, 32, 16)
    assert result.tokens == count == len(ids) - 1
    assert result.ppl == pytest.approx(expected, rel=1e-6)
    ref, ref_count = perplexity_transformers(mixtral_path(llm), ids, 32, 16, progress=False)
    assert ref_count == count
    assert result.ppl == pytest.approx(ref, rel=1e-4)  # fp32 vs transformers: well inside 0.1%


def mixtral_path(llm):
    return llm.engine.config.model


def test_text_shorter_than_one_window(llm, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("It was the best of times")
    ids = read_text_tokens(llm.tokenizer, path, None)
    assert 2 <= len(ids) < 32
    result = perplexity(llm, path, progress=False)
    assert result.tokens == len(ids) - 1
    assert result.ppl == pytest.approx(brute_force_ppl(llm, ids, 32, 16)[0], rel=1e-6)


def test_max_tokens_caps_the_text(llm, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    assert perplexity(llm, path, window=32, stride=16, max_tokens=50, progress=False).tokens == 49


def test_empty_and_missing_files(llm, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds 0 token"):
        perplexity(llm, empty, progress=False)
    with pytest.raises(FileNotFoundError, match="text file not found"):
        perplexity(llm, tmp_path / "nope.txt", progress=False)
    with pytest.raises(ValueError, match="window=64 exceeds the engine's max_model_len=32"):
        perplexity(llm, empty, window=64, progress=False)


@pytest.mark.slow
def test_cli_json_last_line(mixtral_ckpt, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "moekv.cli", "eval", "ppl", "--model", str(mixtral_ckpt), "--text",
                        str(path), "--max-model-len", "32", "--kv-cache-dtype", "bf16", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("ppl", "tokens", "bits_per_element", "kv_cache_dtype", "seconds"):
        assert key in record
    assert record["kv_cache_dtype"] == "bf16" and record["bits_per_element"] == 16.0
    r = subprocess.run([sys.executable, "-m", "moekv.cli", "eval", "ppl", "--model", str(mixtral_ckpt), "--text",
                        str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "text file not found" in r.stderr


class RecordingBar:
    """tqdm's stand-in: records each update."""

    updates: list[int] = []

    def __init__(self, total=None, **kwargs):
        self.total = total
        RecordingBar.updates = []

    def update(self, n=1):
        RecordingBar.updates.append(n)

    def close(self):
        pass


def test_progress_advances_per_engine_step(llm, tmp_path, monkeypatch):
    """Decode mode feeds the scored tokens one engine step each: the bar moves with every step (not once
    per window); prefill mode scores a short window in one step."""
    import moekv.eval.perplexity as ppl_module

    monkeypatch.setattr(ppl_module, "tqdm", RecordingBar)
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    result = perplexity(llm, path, window=32, stride=16, max_tokens=60)
    steps = [n for n in RecordingBar.updates if n]
    assert sum(RecordingBar.updates) == result.tokens == 59
    plan = windows(60, 32, 16)  # the windows run side by side: each step scores one token of each
    assert len(steps) >= max(end - first for _, end, first in plan) and max(steps) <= len(plan), RecordingBar.updates
    result = perplexity(llm, path, window=32, stride=32, max_tokens=30, mode="prefill")
    assert sum(RecordingBar.updates) == result.tokens == 29 and len([n for n in RecordingBar.updates if n]) == 1


def test_invalid_utf8_is_refused_naming_the_file_and_offset(tmp_path, capsys):
    """Scoring replacement characters would be scoring nothing: the file's path and the first bad
    byte's offset, before any model loads (a file, or one inside a folder)."""
    from moekv.cli import main
    from moekv.eval.perplexity import read_utf8

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait".encode("latin-1"))  # 0xe9 at byte 3, not followed by continuation bytes
    assert main(["eval", "ppl", "--text", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not valid UTF-8" in err and "byte offset 3" in err and "0xe9" in err
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text " * 10, encoding="utf-8")
    (folder / "bad.txt").write_bytes(b"ok \xff")
    assert main(["eval", "ppl", "--text", str(folder)]) == 2
    assert "bad.txt is not valid UTF-8: byte 0xff at byte offset 3" in capsys.readouterr().err
    assert read_utf8(folder / "good.txt").startswith("fine text")
