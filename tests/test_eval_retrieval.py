"""`moekv eval retrieval` and per-domain `eval ppl` on the shipped domain-moe (max_model_len 512).

The retrieval grid is checked for exact prompt lengths, needle positions and determinism; its accuracy
against a fake LLM whose answers the test controls and scores with its own rule; the engine path,
the CLI (--json, --plot) and the refusal of lengths the model cannot hold. Per-domain perplexity is
checked against each text scored alone.
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from moekv import LLM, SamplingParams
from moekv.cli import main
from moekv.eval.needle import NEEDLE_TEMPLATE, QUESTION
from moekv.eval.perplexity import perplexity
from moekv.eval.retrieval import build_cases, default_lengths, evaluate_retrieval, heatmap_figure, plot_heatmap

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "domain-moe"
WORDS = ("the house was quiet and the old man walked slowly along the river while his daughter read letters "
         "from a friend who lived in the city far away beyond hills of green and grey under a pale sky").split()


def filler_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 14))).capitalize() + ".")
    return " ".join(sentences)


def char_encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character


@pytest.fixture(scope="module")
def llm():
    return LLM(str(MODEL), dtype="float32", kv_cache_dtype="bf16", max_model_len=512)


@pytest.fixture(scope="module")
def filler_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("retrieval") / "filler.txt"
    path.write_text(filler_text(1500))
    return path


# ---- the grid ------------------------------------------------------------------------------------------

def test_cases_have_exact_lengths_needles_and_filler():
    filler = char_encode(filler_text(600, seed=1))
    lengths, depths, trials, answer_tokens = [200, 300, 450], [0.0, 0.3, 1.0], 3, 7
    cases = build_cases(char_encode, filler, lengths, depths, trials, seed=5, answer_tokens=answer_tokens)
    assert len(cases) == len(lengths) * len(depths) * trials
    assert [(c.length, c.depth, c.trial) for c in cases] == [(n, d, t) for n in lengths for d in depths
                                                             for t in range(trials)]
    for c in cases:
        text = "".join(map(chr, c.ids))
        needle = NEEDLE_TEMPLATE.format(key=c.key)
        assert len(c.ids) == c.length - answer_tokens
        assert text.endswith(QUESTION) and text.count(needle) == 1 and text.index(needle) == c.needle_position
        n_filler = len(c.ids) - len(needle) - len(QUESTION)
        assert c.needle_position == round(c.depth * n_filler)
        body = text[:c.needle_position] + text[c.needle_position + len(needle):-len(QUESTION)]
        assert body == "".join(map(chr, filler[c.offset:c.offset + n_filler]))  # contiguous filler
        assert re.fullmatch(r"[1-9]\d{4}", c.key)
    for n in lengths:  # one key and one filler offset per trial, at every depth
        row = [(c.trial, c.key, c.offset) for c in cases if c.length == n]
        assert len(set(row)) == trials
    assert len({c.offset for c in cases}) > 3  # offsets differ between trials and lengths


def test_cases_are_deterministic_per_seed():
    filler = char_encode(filler_text(600, seed=1))
    a = build_cases(char_encode, filler, [200, 400], [0.0, 1.0], 4, seed=3)
    b = build_cases(char_encode, filler, [200, 400], [0.0, 1.0], 4, seed=3)
    c = build_cases(char_encode, filler, [200, 400], [0.0, 1.0], 4, seed=4)
    assert a == b
    assert [x.key for x in a] != [x.key for x in c]
    only_400 = build_cases(char_encode, filler, [400], [0.0, 1.0], 4, seed=3)
    assert only_400 == [x for x in a if x.length == 400]  # a length's prompts do not depend on the others


def test_cases_refuse_bad_grids():
    filler = char_encode(filler_text(300))
    with pytest.raises(ValueError, match="holds .* tokens; length 5000 needs"):
        build_cases(char_encode, filler, [5000], [0.5], 1)
    with pytest.raises(ValueError, match="depth must be in"):
        build_cases(char_encode, filler, [200], [1.2], 1)
    with pytest.raises(ValueError, match="trials"):
        build_cases(char_encode, filler, [200], [0.5], 0)
    with pytest.raises(ValueError, match="must not repeat"):
        build_cases(char_encode, filler, [200, 200], [0.5], 1)
    with pytest.raises(ValueError, match="shorter than the needle"):
        build_cases(char_encode, filler, [60], [0.5], 1)


# ---- accuracy, against answers the test controls ---------------------------------------------------------

class FakeLLM:
    """The real engine's tokenizer and config, but generate() answers from a seeded menu of right and
    wrong forms (including the key with one digit more or one less)."""

    FORMS = [" {k}.", "{k}", "\n {k} is", " {k}6", " {s}", " 1{k}", "", "the key is {k}", " {r}"]

    def __init__(self, real: LLM, seed: int) -> None:
        self.engine, self.tokenizer = real.engine, real.tokenizer
        self.rng = random.Random(seed)
        self.calls: list[tuple[list[list[int]], SamplingParams, list[str]]] = []  # prompts, params, answers

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        ids = [p["prompt_token_ids"] for p in prompts]
        answers = []
        for p in ids:
            key = re.search(r"The secret passkey is (\d+)\.", self.tokenizer.decode(p)).group(1)
            answers.append(self.rng.choice(self.FORMS).format(k=key, s=key[:-1], r=key[::-1]))
        self.calls.append((ids, sampling_params, answers))
        return [SimpleNamespace(outputs=[SimpleNamespace(text=a)]) for a in answers]


def oracle_cells(fake: FakeLLM, depths: list[float], answer_tokens: int) -> dict[tuple[int, float], list[bool]]:
    """Cell -> right/wrong per prompt, rebuilt from what the fake saw and said, without the module's code."""
    (prompts, _, answers), = fake.calls
    question = fake.tokenizer.encode(QUESTION, add_special_tokens=False)
    cells: dict[tuple[int, float], list[bool]] = {}
    for ids, text in zip(prompts, answers):
        key = re.search(r"The secret passkey is (\d+)\.", fake.tokenizer.decode(ids)).group(1)
        m = re.match(r"\s*(\d+)", text)
        right = m is not None and m.group(1) == key
        needle = fake.tokenizer.encode(NEEDLE_TEMPLATE.format(key=key), add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)
        n_filler = len(ids) - len(needle) - len(question)
        depth, = [d for d in depths if round(d * n_filler) == at]
        cells.setdefault((len(ids) + answer_tokens, depth), []).append(right)
    return cells


def test_accuracy_counts_right_and_wrong_answers(llm, filler_file):
    depths, lengths, trials = [0.0, 0.5, 1.0], [128, 256, 448], 4
    fake = FakeLLM(llm, seed=11)
    r = evaluate_retrieval(fake, filler_file, lengths=lengths, depths=depths, trials=trials, seed=2,
                           answer_tokens=6, progress=False)
    assert len(fake.calls) == 1  # one batch
    prompts, params, _ = fake.calls[0]
    assert params.temperature == 0.0 and params.max_tokens == 6
    assert sorted(len(p) for p in prompts) == sorted([n - 6 for n in lengths] * len(depths) * trials)
    expected = oracle_cells(fake, depths, 6)
    assert {(c["length"], c["depth"]): (c["correct"], c["trials"]) for c in r.cells} == \
           {cell: (sum(v), len(v)) for cell, v in expected.items()}
    flat = [ok for v in expected.values() for ok in v]
    assert 0 < sum(flat) < len(flat)  # both kinds of answer occur
    assert r.accuracy == pytest.approx(sum(flat) / len(flat))
    for n in lengths:
        mine = [ok for (length, _), v in expected.items() if length == n for ok in v]
        assert r.accuracy_by_length[str(n)] == pytest.approx(sum(mine) / len(mine))
    assert [[len(row)] for row in r.grid()] == [[len(lengths)]] * len(depths)
    wrong_longer = [a for a in r.answers if a["answer"].strip() == a["key"] + "6"]
    assert wrong_longer and not any(a["correct"] for a in wrong_longer)  # "123456" is not "12345"


# ---- the engine ----------------------------------------------------------------------------------------

def test_engine_answers_are_plain_greedy_generations(llm, filler_file):
    r = evaluate_retrieval(llm, filler_file, lengths=[128, 256], depths=[0.0, 1.0], trials=2, seed=0,
                           answer_tokens=6, progress=False)
    assert len(r.answers) == 8 and len(r.cells) == 4
    assert r.kv_cache_dtype == "bf16" and r.bits_per_element == 16.0
    assert r.bits_per_element_at_length == {"128": 16.0, "256": 16.0}
    assert 0.0 <= r.accuracy <= 1.0 and all(isinstance(a["answer"], str) for a in r.answers)
    # the batched answer of one prompt is what greedy generation gives it alone
    case = build_cases(lambda s: llm.tokenizer.encode(s, add_special_tokens=False),
                       llm.tokenizer.encode(filler_file.read_text(), add_special_tokens=False),
                       [256], [1.0], 2, seed=0, answer_tokens=6)[1]
    alone = llm.generate({"prompt_token_ids": case.ids}, SamplingParams(max_tokens=6, temperature=0.0))
    mine, = [a for a in r.answers if (a["length"], a["depth"], a["trial"]) == (256, 1.0, 1)]
    assert mine["answer"] == alone[0].outputs[0].text and mine["key"] == case.key


def test_too_long_lengths_and_bad_texts_are_refused(llm, filler_file):
    with pytest.raises(ValueError, match="length 1024 exceeds the engine's max_model_len=512"):
        evaluate_retrieval(llm, filler_file, lengths=[256, 1024], depths=[0.5], trials=1, progress=False)
    empty = filler_file.parent / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds 0 tokens; length 256 needs"):
        evaluate_retrieval(llm, empty, lengths=[256], depths=[0.5], trials=1, progress=False)
    with pytest.raises(FileNotFoundError, match="text file not found"):
        evaluate_retrieval(llm, filler_file.parent / "missing.txt", lengths=[256], progress=False)


def test_cli_json_and_plot(filler_file, tmp_path, capsys):
    png = tmp_path / "heat.png"
    rc = main(["eval", "retrieval", "--text", str(filler_file), "--max-model-len", "512", "--dtype", "float32",
               "--lengths", "128", "448", "--depths", "0", "1", "--trials", "1", "--key-seed", "7",
               "--plot", str(png), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "note: --seed" not in out.err
    record = json.loads(out.out.strip().splitlines()[-1])
    assert record["lengths"] == [128, 448] and record["depths"] == [0.0, 1.0] and record["trials"] == 1
    assert len(record["cells"]) == 4 and len(record["answers"]) == 4 and record["seed"] == 7
    assert set(record["accuracy_by_length"]) == {"128", "448"}
    for key in ("accuracy", "kv_cache_dtype", "bits_per_element", "seconds"):
        assert key in record
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_heatmap(record, tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # from JSON
    rc = main(["eval", "retrieval", "--text", str(filler_file), "--max-model-len", "512", "--lengths", "128",
               "1024", "--trials", "1"])
    assert rc == 2 and "length 1024 exceeds the engine's max_model_len=512" in capsys.readouterr().err


# ---- per-domain perplexity -----------------------------------------------------------------------------

def test_ppl_per_domain_equals_each_text_alone(tmp_path, capsys):
    folder = tmp_path / "domains"
    folder.mkdir()
    (folder / "prose.txt").write_text(filler_text(120, seed=1))
    (folder / "drama.txt").write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 6)
    (folder / "notes.md").write_text("not a .txt file: left out")
    flags = ["--max-model-len", "64", "--dtype", "float32", "--mode", "prefill", "--json"]
    assert main(["eval", "ppl", "--text", str(folder), *flags]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record["domains"]) == {"prose", "drama"}
    llm = LLM(str(MODEL), dtype="float32", max_model_len=64)
    tokens = nll = 0.0
    for name in ("prose", "drama"):
        alone = perplexity(llm, folder / f"{name}.txt", mode="prefill", progress=False)
        assert record["domains"][name]["ppl"] == pytest.approx(alone.ppl, rel=1e-9)
        assert record["domains"][name]["tokens"] == alone.tokens
        tokens, nll = tokens + alone.tokens, nll + math.log(alone.ppl) * alone.tokens
    assert record["tokens"] == tokens
    assert record["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-9)
    # repeated --text gives the same, in the order given
    assert main(["eval", "ppl", "--text", str(folder / "drama.txt"), "--text", str(folder / "prose.txt"),
                 *flags]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(again["domains"]) == ["drama", "prose"] and again["ppl"] == pytest.approx(record["ppl"])
    # one file alone keeps the single-text record
    assert main(["eval", "ppl", "--text", str(folder / "drama.txt"), *flags]) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "domains" not in single and single["text"] == str(folder / "drama.txt")
    assert single["ppl"] == pytest.approx(record["domains"]["drama"]["ppl"], rel=1e-9)


def test_ppl_domains_refuse_clashing_names_and_empty_folders(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.txt").write_text("one text")
    (tmp_path / "b" / "x.txt").write_text("another")
    (tmp_path / "empty").mkdir()
    assert main(["eval", "ppl", "--text", str(tmp_path / "a"), "--text", str(tmp_path / "b")]) == 2
    assert "two texts are named 'x'" in capsys.readouterr().err
    assert main(["eval", "ppl", "--text", str(tmp_path / "empty")]) == 2
    assert "holds no .txt file" in capsys.readouterr().err


def test_default_lengths_fit_the_engine_s_context(llm, filler_file):
    """Without lengths: a quarter, half and all of max_model_len (domain-moe's 4096: 1024 2048 4096)."""
    assert default_lengths(4096) == [1024, 2048, 4096]
    result = evaluate_retrieval(llm, filler_file, depths=[0.5], trials=1, progress=False)
    assert result.lengths == [128, 256, 512] == default_lengths(llm.engine.max_model_len)


def test_heat_map_title_is_never_clipped(llm, filler_file):
    result = evaluate_retrieval(llm, filler_file, lengths=[128], depths=[0.0, 1.0], trials=1, progress=False)
    for title in (None, "passkey retrieval of a long-named format under a long description, all lengths"):
        fig = heatmap_figure(result, title)
        fig.canvas.draw()
        box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, (box, fig.bbox)


def test_cli_seed_is_the_engine_s_with_a_note(filler_file, capsys):
    rc = main(["eval", "retrieval", "--text", str(filler_file), "--max-model-len", "512", "--dtype", "float32",
               "--lengths", "128", "--depths", "0", "--trials", "1", "--seed", "3", "--json"])
    out = capsys.readouterr()
    assert rc == 0 and "--key-seed" in out.err and json.loads(out.out.strip().splitlines()[-1])["seed"] == 0
