"""lm-evaluation-harness, a client nobody here wrote, against `moekv serve`: its log-likelihoods
(local-completions: echo + logprobs) equal LLM.score's on the same (context, continuation) pairs.
Offline: a local cloze task from the model's held-out text, the model folder's tokenizer."""
from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

from moekv import LLM
from moekv.config import default_model_path
from tests.server_harness import ServerThread

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
MODEL = default_model_path()


def load_script():
    spec = importlib.util.spec_from_file_location("lmeval_check", ROOT / "scripts" / "lmeval_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_eval_loglikelihoods_equal_llm_score():
    pytest.importorskip("lm_eval", reason='lm-evaluation-harness is not installed (pip install "lm_eval[api]"); '
                                          "it is kept out of the dev extras for its weight")
    check = load_script()
    items = check.cloze_items(check.heldout_text(MODEL / "heldout"), 16)
    with ServerThread(MODEL, max_model_len=256) as srv, tempfile.TemporaryDirectory() as tmp:
        results = check.run_lm_eval(srv.url, Path(MODEL), check.write_task(Path(tmp), items))
    pairs = check.lm_eval_pairs(results)
    expected = check.score_pairs(LLM(MODEL, dtype="float32", max_model_len=256), [(c, x) for c, x, _ in pairs])
    assert len(pairs) == sum(len(it["choices"]) for it in items)  # one request per choice, none lost
    assert [(c, x) for c, x, _ in pairs] == [(it["context"], ch) for it in items for ch in it["choices"]]
    got = torch.tensor([ll for _, _, ll in pairs], dtype=torch.float64)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-3)
    # the accuracy lm_eval reports is the argmax of the oracle's log-likelihoods over each item's choices
    per_item = torch.tensor(expected).view(len(items), -1)
    oracle_acc = (per_item.argmax(dim=1) == torch.tensor([it["label"] for it in items])).double().mean().item()
    assert results["results"][check.TASK]["acc,none"] == pytest.approx(oracle_acc)
