"""The pure data pieces of scripts/prepare_domain_data.py and scripts/train_domain_moe.py."""
from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from moekv.eval.needle import NEEDLE_TEMPLATE, QUESTION

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


prep = _load("prepare_domain_data")
train = _load("train_domain_moe")


def test_cp1252_mapping_matches_the_code_page():
    # Windows-1252 code chart: 0x91-0x97 are quotes, bullet and dashes, 0x9C the oe ligature
    src = "I\x92ll \x93go\x94 \x91now\x92 \x95 a\x96b\x97c man\x9cuvre"
    assert prep.fix_cp1252(src) == "I\u2019ll \u201cgo\u201d \u2018now\u2019 \u2022 a\u2013b\u2014c man\u0153uvre"
    # undefined in cp1252: kept; ordinary text untouched
    assert prep.fix_cp1252("\x81\x8d\x8f\x90\x9d") == "\x81\x8d\x8f\x90\x9d"
    assert prep.fix_cp1252("caf\u00e9 \u2014 ok") == "caf\u00e9 \u2014 ok"


def test_split_tail_cuts_at_a_line_start():
    text = "".join(f"line {i}\n" for i in range(100))
    train_part, held = prep.split_tail(text, 50)
    assert train_part + held == text
    assert 0 < len(held) <= 50 and held.startswith("line ") and train_part.endswith("\n")
    assert prep.split_tail(text, 0) == (text, "")


def test_modules_split_and_every_kth_holdout_are_disjoint_and_complete():
    text = "".join(f"# ===== Lib/m{i}.py =====\nx = {i}\n" for i in range(45))
    modules = prep.split_modules(text)
    assert len(modules) == 45 and "".join(modules) == text
    tr, held = prep.split_every_kth(modules, 20, max_chars=10_000)
    assert sorted(tr + held) == sorted(modules) and not set(tr) & set(held)
    assert held == [modules[10], modules[30]]
    _, capped = prep.split_every_kth(modules, 20, max_chars=len(modules[10]))
    assert capped == [modules[10]]
    with pytest.raises(ValueError):
        prep.split_every_kth(modules, 1, 100)


def _py(expr: str) -> str:
    """Algebra notation to Python: x^2 -> x**2, 3x -> 3*x."""
    return re.sub(r"(\d)([xab(])", r"\1*\2", expr.replace("^", "**")).replace(")(", ")*(")


def test_generated_math_is_correct():
    rng = random.Random(0)
    seen = set()
    for _ in range(2000):
        line = prep.math_problem(rng)
        if line.startswith("Solve"):
            m = re.fullmatch(r"Solve (\d+)x ([+-]) (\d+) = (-?\d+)\. \d+x = (-?\d+), so x = (-?\d+)\.", line)
            a, sign, b, c, ax, x = m.groups()
            b = int(b) if sign == "+" else -int(b)
            assert int(a) * int(x) + b == int(c) and int(ax) == int(c) - b
            seen.add("solve")
        elif line.startswith(("Expand", "Simplify")):
            lhs, rhs = line.split(" ", 1)[1].split(": ")
            for x in range(-3, 4):
                for a, b in ((1, 2), (-2, 5)):
                    env = {"x": x, "a": a, "b": b}
                    assert eval(_py(lhs), env) == eval(_py(rhs), env), line
            seen.add(line.split()[0])
        else:
            parts = line.split(" = ")
            values = [eval(p) for p in parts]
            assert all(v == values[0] for v in values), line
            seen.add("arith")
    assert seen == {"solve", "Expand", "Simplify", "arith"}


def _char_encode(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_passkey_row_holds_one_needle_and_the_answer_and_its_stop_right_after_the_question():
    stream = np.array([ord("a") + i % 26 for i in range(20_000)], dtype=np.uint16)  # letters only
    rng = random.Random(1)
    for length in (512, 1024, 4096):
        for _ in range(20):
            ids, pos = train.passkey_row(_char_encode, stream, length, rng)
            assert len(ids) == length
            text = "".join(map(chr, ids))
            key = text[pos[0] : pos[-1]]  # the answer is the key and the '.' that ends it
            assert len(pos) == 6 and key.isdigit() and key[0] != "0"
            assert pos == list(range(pos[0], pos[0] + 6))
            assert text[: pos[0]].endswith(QUESTION) and text[pos[-1] :].startswith(".\n")
            assert text.count(NEEDLE_TEMPLATE.format(key=key)) == 1 and text.count(QUESTION) == 1
            assert text.index(NEEDLE_TEMPLATE.format(key=key)) < pos[0]


def test_copy_row_repeats_a_random_span_and_marks_the_first_as_noise():
    stream = np.full(50_000, 7, dtype=np.uint16)  # one token only: every other id comes from the random span
    rng = random.Random(2)
    for length in (512, 4096):
        ids, pos, noise = train.copy_row(stream, length, rng, vocab_size=4096)
        assert len(ids) == length and 64 <= len(pos) == len(noise) <= 256
        assert pos == list(range(pos[0], pos[0] + len(pos))) and noise == list(range(noise[0], noise[0] + len(noise)))
        assert noise[-1] < pos[0]  # the first span comes before its copy
        first, copied = [ids[i] for i in noise], [ids[i] for i in pos]
        assert first == copied and all(1 <= t < 4096 for t in first)  # never id 0 (<|endoftext|>)
        assert len(set(first)) > len(first) // 2  # random ids, not a constant run
        outside = [t for i, t in enumerate(ids) if i not in set(pos) | set(noise)]
        assert set(outside) == {7}


def test_copy_pool_is_the_most_frequent_ids_and_pooled_rows_draw_only_from_it():
    streams = {"a": np.array([5] * 50 + [9] * 30 + [0] * 100 + [3] * 30 + [7] * 2, dtype=np.uint16),
               "b": np.array([9] * 25 + [11] * 10, dtype=np.uint16)}
    # counts: 9 -> 55, 5 -> 50, 3 -> 30, 11 -> 10, 7 -> 2; id 0 (<|endoftext|>) excluded however frequent
    assert train.copy_pool(streams, 16, 3) == [9, 5, 3]
    assert train.copy_pool(streams, 16, 0) is None  # 0: spans over the whole vocabulary (the old rows)
    assert 0 not in train.copy_pool(streams, 16, 16) and len(train.copy_pool(streams, 16, 16)) == 15
    stream = np.full(50_000, 7, dtype=np.uint16)
    rng = random.Random(5)
    pool = [100, 200, 300, 400]
    for length in (128, 512, 4096):
        ids, pos, noise = train.copy_row(stream, length, rng, vocab_size=4096, pool=pool)
        first, copied = [ids[i] for i in noise], [ids[i] for i in pos]
        assert first == copied and set(first) <= set(pool) and len(set(first)) > 1
        assert {t for i, t in enumerate(ids) if i not in set(pos) | set(noise)} == {7}


def test_copy_row_from_text_repeats_an_earlier_span():
    stream = np.arange(50_000, dtype=np.uint16)  # all distinct, so a repeat can only come from the copy
    rng = random.Random(2)
    for length in (512, 4096):
        ids, pos, noise = train.copy_row(stream, length, rng, vocab_size=4096, source="text")
        assert len(ids) == length and 64 <= len(pos) <= 256 and noise == []
        span = ids[pos[0] : pos[-1] + 1]
        first = ids.index(span[0])
        assert first < pos[0] and ids[first : first + len(span)] == span
    with pytest.raises(ValueError):
        train.copy_row(stream, 512, rng, vocab_size=4096, source="poetry")


SIZES = {"prose": 1_894_191, "drama": 367_193, "code": 3_243_128, "math": 4_381_833}


def test_domain_mixture_is_proportional_under_the_cap():
    budget = 100e6  # 10.1 passes over the 9.89M tokens: under a cap of 16
    weights, passes = train.domain_mixture(SIZES, budget, 16, "math")
    total = sum(SIZES.values())
    for name, size in SIZES.items():
        assert weights[name] == pytest.approx(size / total, rel=1e-12)
        # passes recomputed independently: the domain's expected tokens over its size
        assert passes[name] == pytest.approx(budget * size / total / size, rel=1e-12)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert train.generated_math_tokens(SIZES, budget, 16, "math") == 0


def test_domain_mixture_caps_every_domain_but_the_fill():
    budget = 452e6  # the shipped run's tokens: 45.7 passes if proportional
    weights, passes = train.domain_mixture(SIZES, budget, 16, "math")
    for name in ("prose", "drama", "code"):
        assert weights[name] * budget == pytest.approx(16 * SIZES[name], rel=1e-12)
        assert passes[name] == pytest.approx(16)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights["math"] * budget == pytest.approx(budget - 16 * (SIZES["prose"] + SIZES["drama"] + SIZES["code"]))
    assert passes["math"] > 16
    # fresh math that brings the fill domain under the cap: the mixture is proportional again
    extra = train.generated_math_tokens(SIZES, budget, 16, "math")
    grown = dict(SIZES, math=SIZES["math"] + extra)
    w2, p2 = train.domain_mixture(grown, budget, 16, "math")
    assert max(p2.values()) <= 16 + 1e-9 and min(p2.values()) == pytest.approx(max(p2.values()))
    grown["math"] -= 2
    assert train.domain_mixture(grown, budget, 16, "math")[1]["math"] > 16  # one token less would not do
    with pytest.raises(ValueError):
        train.domain_mixture(SIZES, budget, 16, "poetry")
    with pytest.raises(ValueError):
        train.domain_mixture(SIZES, budget, 0, "math")


def test_extend_math_appends_fresh_exercises():
    stream = np.array([0, 5, 6], dtype=np.uint16)
    out = train.extend_math(stream, _char_encode, 0, 1000, seed=1234)
    assert out.dtype == stream.dtype and list(out[:3]) == [0, 5, 6] and len(out) >= 1003
    text = "".join(map(chr, out[4:]))
    assert text.startswith("Exercises.\n") and " = " in text
    assert train.extend_math(stream, _char_encode, 0, 0, seed=1234) is stream


def test_batch_masks_and_curriculum():
    args = train.parse_args(["--data", "x", "--out", "y", "--copy-frac", "0.3", "--passkey-frac", "0.3"])
    assert args.domain_weight_map is None and args.max_steps == 1000  # auto mixture; steps from the budget
    streams = {n: np.array([ord("a") + i % 26 for i in range(10_000)], dtype=np.uint16) for n in train.DOMAINS}
    weights = dict.fromkeys(train.DOMAINS, 0.25)
    ids, copy_mask, ans_mask, noise_mask, dom = train.make_batch(streams, _char_encode, 512, 40, weights, args,
                                                                 random.Random(3), vocab_size=4096)
    assert ids.shape == copy_mask.shape == ans_mask.shape == noise_mask.shape == (40, 512)
    assert not (copy_mask & ans_mask).any() and not (noise_mask & copy_mask).any()
    assert set(ans_mask.sum(1).tolist()) <= {0, 6} and ans_mask.any() and copy_mask.any()  # five key digits and the "."
    assert (copy_mask.sum(1) == noise_mask.sum(1)).all()  # each copy row: one noise span, one copy of it
    assert {train.DOMAINS[d] for d in dom} == set(train.DOMAINS)
    only_code = {"prose": 0.0, "drama": 0.0, "code": 1.0, "math": 0.0}
    *_, dom = train.make_batch(streams, _char_encode, 512, 10, only_code, args, random.Random(4), vocab_size=4096)
    assert {train.DOMAINS[d] for d in dom} == {"code"}
    plan = train.parse_curriculum("512:1,4096:3")
    assert [train.seq_len_at(plan, p) for p in (0.0, 0.24, 0.26, 0.99, 1.0)] == [512, 512, 4096, 4096, 4096]
    with pytest.raises(ValueError, match="unknown domain"):
        train.parse_weights("poetry:1")


def test_gated_curriculum_holds_the_first_length_then_shares_the_rest():
    plan = train.parse_curriculum("512:0.3,1024:0.2,2048:0.2,4096:0.3")
    # gate open from the start (no gate): the plain curriculum
    for p in (0.0, 0.29, 0.31, 0.49, 0.51, 0.69, 0.71, 0.99):
        assert train.gated_seq_len(plan, p, 0.0) == train.seq_len_at(plan, p)
    # closed: the first length, even past its planned end
    assert {train.gated_seq_len(plan, p, None) for p in (0.0, 0.5, 0.99)} == {512}
    # opened at 0.6: 512 until 0.6, then 1024 / 2048 / 4096 over 0.6..1 in shares 2:2:3 (ends 0.714, 0.829, 1)
    got = {p: train.gated_seq_len(plan, p, 0.6) for p in (0.59, 0.61, 0.71, 0.72, 0.82, 0.84, 0.999)}
    assert got == {0.59: 512, 0.61: 1024, 0.71: 1024, 0.72: 2048, 0.82: 2048, 0.84: 4096, 0.999: 4096}
    # opened before the first phase's planned end: the plan as written
    assert [train.gated_seq_len(plan, p, 0.1) for p in (0.2, 0.35, 0.6, 0.8)] == [512, 1024, 2048, 4096]


def test_lr_holds_its_peak_while_the_gate_is_closed_then_decays_over_the_rest():
    args = train.parse_args(["--data", "x", "--out", "y", "--curriculum-gate", "0.3", "--hold-lr-until-gate"])
    assert args.hold_lr_until_gate and args.warmup == 0.03
    assert train.lr_at(0.015, args, None) == pytest.approx(1e-3)  # warmup as before
    assert train.lr_at(0.5, args, None) == args.lr  # gate closed: the peak
    assert train.lr_at(0.5, args, 0.5) == pytest.approx(args.lr)  # opened now: the cosine starts
    assert train.lr_at(0.75, args, 0.5) == pytest.approx(args.lr * 0.55)  # half-way: (1 + 0.1) / 2
    assert train.lr_at(1.0, args, 0.5) == pytest.approx(args.lr * 0.1)
    # without the hold (decay_from 0): the plain cosine from the warmup's end
    assert train.lr_at(0.515, args, 0.0) == pytest.approx(args.lr * 0.55)


@pytest.mark.slow
@pytest.mark.skipif(not (prep.DEFAULT_DATA_DIR / prep.NOVELS[0]).is_file(),
                    reason="needs the shared training data beside the repository (../shared/data)")
def test_smoke_run_end_to_end(tmp_path):
    """prepare --smoke and train --smoke on CPU: a checkpoint transformers loads, held-out and passkey results."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    data, out = tmp_path / "data", tmp_path / "run"
    meta = prep.main(["--out", str(data), "--smoke"])
    assert set(meta["domains"]) == set(prep.DOMAINS) and all(d["train_tokens"] > 0 for d in meta["domains"].values())
    result = train.main(["--data", str(data), "--out", str(out), "--smoke"])
    assert result["steps"] == 8 and set(result["heldout"]) == set(train.DOMAINS)
    assert sum(result["mixture"]["weights"].values()) == pytest.approx(1.0)
    cells = result["passkey"]["cells"]
    assert [(c["length"], c["depth"]) for c in cells] == [(256, 0.0), (256, 1.0)]
    assert all(c["total"] == len(train.DOMAINS) for c in cells)
    assert json.loads((out / "eval.json").read_text())["steps"] == 8
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "train"] == [2, 4, 6, 8]
    held = [r for r in logged if r["kind"] == "heldout"]
    assert [r["step"] for r in held] == [3, 6, 8]  # every 3 * 1024 tokens, and the last step
    best = min(held, key=lambda r: r["mean_loss"])
    assert result["kept"]["step"] == best["step"] and result["heldout"] == best["losses"]
    assert [r["step"] for r in held if r["best"]][-1] == best["step"]
    # the parts join into the checkpoint transformers loads
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    parts = sorted(out.glob("model.safetensors.part*"))
    (ckpt / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in parts))
    (ckpt / "config.json").write_text((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert model.config.head_dim == 32 and model.config.num_local_experts == 4
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, meta["vocab_size"])
