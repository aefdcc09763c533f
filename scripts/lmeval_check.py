#!/usr/bin/env python3
"""Run lm-evaluation-harness (`local-completions`, log-likelihood requests through echo + logprobs)
against `moekv serve`, offline, on a small cloze task built from the model's held-out text, and
check that every log-likelihood it got equals the one LLM.score gives for the same (context,
continuation) pair.

    pip install "lm_eval[api]"          # not in the dev extras: it pulls datasets, pandas, pyarrow, sklearn
    PYTHONPATH=. python scripts/lmeval_check.py            # starts `moekv serve` on 127.0.0.1 itself
    PYTHONPATH=. python scripts/lmeval_check.py --url http://127.0.0.1:8000  # an already running server
    PYTHONPATH=. python scripts/lmeval_check.py --write-task /tmp/cloze       # only the task, for lm_eval's CLI

Nothing is downloaded: the task is a local YAML reading a local JSONL file, and lm_eval's tokenizer is
the model folder's tokenizer.json (`tokenizer_backend=huggingface,tokenizer=<model folder>`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TASK = "moekv_heldout_cloze"
HELDOUT_FILES = ["prose.txt", "drama.txt"]  # in the model folder's heldout/ (models/domain-moe ships them)


def offline_env() -> None:
    """lm_eval, datasets and transformers must not reach for a hub."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"


def heldout_text(heldout_dir: Path) -> str:
    """HELDOUT_FILES of heldout_dir (text the model never saw in training), one after the other."""
    return "\n".join((heldout_dir / name).read_text(encoding="utf-8") for name in HELDOUT_FILES)


def cloze_items(text: str, n: int, n_choices: int = 4, seed: int = 0) -> list[dict]:
    """n items {context, choices, label}: a held-out sentence without its last word; the choices are
    that word and the last words of other sentences (each with its leading space)."""
    if n < 1 or n_choices < 2:
        raise ValueError(f"need n >= 1 and n_choices >= 2, got n={n}, n_choices={n_choices}")
    sentences = []
    for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        words = s.split(" ")
        last = words[-1].rstrip(".!?,;:'\"")
        if 8 <= len(words) <= 40 and last.isalpha():
            sentences.append((" ".join(words[:-1]), " " + last))
    rng = random.Random(seed)
    rng.shuffle(sentences)
    if len(sentences) < n:
        raise ValueError(f"the text has only {len(sentences)} usable sentences, {n} asked")
    endings = sorted({end for _, end in sentences})
    items = []
    for context, gold in sentences[:n]:
        choices = [gold] + rng.sample([e for e in endings if e != gold], n_choices - 1)
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(gold)})
    return items


def write_task(folder: Path, items: list[dict]) -> Path:
    """A task YAML and its JSONL data in `folder` (pass the folder as lm_eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        'target_delimiter: ""\n'  # the choices carry their leading space
        "metric_list:\n  - metric: acc\n", encoding="utf-8")
    return folder


def run_lm_eval(url: str, model_path: Path, task_dir: Path, model_name: str = "tiny",
                max_length: int = 256) -> dict:
    """lm_eval.simple_evaluate with local-completions against url; returns its results (samples kept).
    The HF_*_OFFLINE variables are set only for the call."""
    saved = dict(os.environ)
    offline_env()
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager

        model_args = (f"model={model_name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={model_path},tokenized_requests=True,max_length={max_length},"
                      "num_concurrent=1,max_retries=1")
        return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[TASK],
                                       task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                       batch_size=1)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def lm_eval_pairs(results: dict) -> list[tuple[str, str, float]]:
    """(context, continuation, log-likelihood) of every request lm_eval sent, from its samples."""
    pairs = []
    for sample in results["samples"][TASK]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            pairs.append((context, continuation, float(resp[0][0])))
    return pairs


def score_pairs(llm, pairs: list[tuple[str, str]]) -> list[float]:
    """The oracle: sum of log p(continuation token | everything before) from LLM.score's logits.
    Tokenized as a causal LM's log-likelihood is (no special tokens): the context's tokens, then
    the tokens that context + continuation adds past them."""
    import torch

    tok = llm.tokenizer
    prompts, spans = [], []
    for context, continuation in pairs:
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        if whole[:len(ctx)] != ctx:  # a merge across the boundary: score continuation on its own
            whole = ctx + tok.encode(continuation, add_special_tokens=False)
        prompts.append({"prompt_token_ids": whole})
        spans.append(len(ctx))
    out = []
    for ids, start, logits in zip((p["prompt_token_ids"] for p in prompts), spans, llm.score(prompts), strict=True):
        logp = torch.log_softmax(logits.double(), dim=-1)  # logits[i] predicts token i + 1
        out.append(float(sum(logp[i - 1, ids[i]] for i in range(start, len(ids)))))
    return out


def start_server(model_path: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moekv.cli", "serve", "--model", str(model_path),
                             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "256", "--served-model-name", "tiny", "--log-level", "warning"],
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moekv serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("moekv serve did not answer /health within 120 s")


def main() -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from moekv import LLM
    from moekv.config import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(default_model_path()))
    p.add_argument("--heldout-dir", type=Path, help="folder of HELDOUT_FILES (default: the model's heldout/)")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--url", help="a running `moekv serve` serving --model as 'tiny' (default: start one)")
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--atol", type=float, default=1e-3, help="per-request tolerance (float32 server)")
    p.add_argument("--write-task", type=Path, metavar="DIR",
                   help="only write the task (YAML + JSONL) to DIR, for `lm_eval --include_path DIR`")
    args = p.parse_args()

    items = cloze_items(heldout_text(args.heldout_dir or args.model / "heldout"), args.items)
    if args.write_task:
        print(f"wrote {write_task(args.write_task.resolve(), items)}/{TASK}.yaml ({len(items)} items)")
        return 0
    proc = None if args.url else start_server(args.model, args.port)
    url = args.url or f"http://127.0.0.1:{args.port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_lm_eval(url, args.model, write_task(Path(tmp), items))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    pairs = lm_eval_pairs(results)
    expected = score_pairs(LLM(str(args.model), dtype="float32", max_model_len=256), [(c, x) for c, x, _ in pairs])
    diffs = [abs(got - want) for (_, _, got), want in zip(pairs, expected, strict=True)]
    acc = results["results"][TASK]["acc,none"]
    print(f"{len(pairs)} log-likelihood requests over {len(items)} items; lm_eval acc={acc:.3f} "
          f"(chance {1 / len(items[0]['choices']):.2f}); max |lm_eval - LLM.score| = {max(diffs):.2e}")
    bad = [(c[-30:], x, got, want) for (c, x, got), want in zip(pairs, expected, strict=True)
           if abs(got - want) > args.atol]
    for row in bad[:10]:
        print("MISMATCH", row)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
