"""Passkey retrieval through the engine (`moekv eval retrieval`).

For each context length L and needle depth d, `trials` prompts are built with moekv.eval.needle's
format (the one the training data uses): a five-digit key stated once at depth d inside filler taken
from a text file, and asked for at the end. A cell of length L holds the whole sequence in L tokens:
the prompt has L - answer_tokens tokens and the model may generate up to answer_tokens more, so
L = max_model_len is a valid length. Every prompt goes through `LLM.generate` (greedy, one batch),
so the KV format and decode path under test are what answers; an answer is right when it starts with
the key and does not continue it with another digit (needle.answer_is_correct).

Trial t of length L uses one key and one filler offset (drawn from a generator seeded by the seed and
L) at every depth, so along a row of the table only the needle's position changes.
"""
from __future__ import annotations

import random
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moekv.eval.needle import answer_is_correct, build_prompt, random_key
from moekv.eval.perplexity import read_utf8


def default_lengths(max_model_len: int) -> list[int]:
    """A quarter, half and all of the engine's context (domain-moe's 4096: 1024 2048 4096), so the
    default fits whatever model runs."""
    return sorted({max(64, max_model_len // 4), max(64, max_model_len // 2), max_model_len})


DEFAULT_DEPTHS = tuple(round(i / 10, 4) for i in range(11))
DEFAULT_ANSWER_TOKENS = 8  # a key of five one-digit tokens, a leading space, and what follows it


@dataclass(frozen=True)
class RetrievalCase:
    """One prompt of the grid: which cell it belongs to and what it should answer."""
    length: int
    depth: float
    trial: int
    key: str
    offset: int  # first filler token used
    needle_position: int  # token index of the needle in the prompt
    ids: list[int] = field(repr=False)


def build_cases(encode: Callable[[str], list[int]], filler_ids: Sequence[int], lengths: Sequence[int],
                depths: Sequence[float], trials: int, seed: int = 0,
                answer_tokens: int = DEFAULT_ANSWER_TOKENS) -> list[RetrievalCase]:
    """Every (length, depth, trial) prompt, in that order; deterministic for (filler, lengths, seed)."""
    lengths, depths = list(lengths), list(depths)
    if not lengths or not depths:
        raise ValueError("give at least one length and one depth")
    if len(set(lengths)) != len(lengths) or len(set(depths)) != len(depths):
        raise ValueError(f"lengths and depths must not repeat, got lengths={lengths} depths={depths}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 1:
        raise ValueError(f"answer_tokens must be an integer >= 1, got {answer_tokens!r}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {d}")
    cases = []
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length <= answer_tokens:
            raise ValueError(f"length must be an integer above answer_tokens={answer_tokens}, got {length!r}")
        if len(filler_ids) < length:
            raise ValueError(f"the filler text holds {len(filler_ids)} tokens; length {length} needs at least "
                             f"{length}: give a longer --text")
        rng = random.Random(f"moekv-retrieval:{seed}:{length}")  # str seeds are stable across runs
        draws = [(random_key(rng), rng.randrange(len(filler_ids) - length + 1)) for _ in range(trials)]
        for depth in depths:
            for trial, (key, offset) in enumerate(draws):
                p = build_prompt(encode, filler_ids[offset:offset + length], length - answer_tokens, depth, key)
                cases.append(RetrievalCase(length=length, depth=depth, trial=trial, key=key, offset=offset,
                                           needle_position=p.needle_position, ids=p.ids))
    return cases


@dataclass
class RetrievalResult:
    lengths: list[int]
    depths: list[float]
    trials: int
    seed: int
    answer_tokens: int
    accuracy: float  # over every prompt
    accuracy_by_length: dict[str, float]  # str(length) -> accuracy
    accuracy_by_depth: dict[str, float]  # str(depth) -> accuracy
    cells: list[dict]  # {"length", "depth", "correct", "trials", "accuracy"}, lengths outer, depths inner
    kv_cache_dtype: str
    bits_per_element: float  # full pages, as `eval ppl` reports it
    bits_per_element_at_length: dict[str, float]  # one sequence of each length, staging included
    # what the answers' decode steps read (formats whose mix changes at run time: tiered); the
    # prompts' prefill reads are not in it
    bits_per_element_read: float | None
    seconds: float
    text: str
    filler_tokens: int
    answers: list[dict]  # per prompt: length, depth, trial, key, offset, needle_position, answer, correct

    def to_dict(self) -> dict:
        return asdict(self)

    def grid(self) -> list[list[float]]:
        """accuracy[depth index][length index]."""
        acc = {(c["length"], c["depth"]): c["accuracy"] for c in self.cells}
        return [[acc[(length, d)] for length in self.lengths] for d in self.depths]


def score_answers(cases: Sequence[RetrievalCase], answers: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """(cells, per-prompt records) of the cases and the texts generated for them."""
    if len(answers) != len(cases):
        raise ValueError(f"{len(answers)} answers for {len(cases)} prompts")
    per_prompt, cells = [], {}
    for case, answer in zip(cases, answers):
        ok = answer_is_correct(answer, case.key)
        per_prompt.append({"length": case.length, "depth": case.depth, "trial": case.trial, "key": case.key,
                           "offset": case.offset, "needle_position": case.needle_position, "answer": answer,
                           "correct": ok})
        cell = cells.setdefault((case.length, case.depth), {"length": case.length, "depth": case.depth,
                                                            "correct": 0, "trials": 0})
        cell["correct"] += ok
        cell["trials"] += 1
    for cell in cells.values():
        cell["accuracy"] = cell["correct"] / cell["trials"]
    return list(cells.values()), per_prompt


def _mean_by(per_prompt: list[dict], key: str) -> dict[str, float]:
    groups: dict[str, list[bool]] = {}
    for r in per_prompt:
        groups.setdefault(str(r[key]), []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in groups.items()}


def evaluate_retrieval(llm, text: str | Path, lengths: Sequence[int] | None = None,
                       depths: Sequence[float] = DEFAULT_DEPTHS, trials: int = 10, seed: int = 0,
                       answer_tokens: int = DEFAULT_ANSWER_TOKENS, progress: bool = True) -> RetrievalResult:
    """Passkey accuracy of `llm` (a moekv.LLM) by context length and needle depth, with filler from `text`.
    lengths None: default_lengths of the engine's max_model_len."""
    from moekv.sampling_params import SamplingParams

    engine = llm.engine
    lengths = default_lengths(engine.max_model_len) if lengths is None else list(lengths)
    depths = [float(d) for d in depths]
    too_long = [n for n in lengths if isinstance(n, int) and n > engine.max_model_len]
    if too_long:
        raise ValueError(f"length {too_long[0]} exceeds the engine's max_model_len={engine.max_model_len} "
                         f"(lengths count the prompt and its {answer_tokens} answer tokens)")
    filler = engine.tokenizer.encode(read_utf8(text), add_special_tokens=False)

    def encode(s: str) -> list[int]:
        return engine.tokenizer.encode(s, add_special_tokens=False)

    cases = build_cases(encode, filler, lengths, depths, trials, seed, answer_tokens)
    fmt = engine.runner.kv_format
    # a format whose bits read depend on the run (tiered) counts what decoding read: read_counts(decode=True)
    fmt.reset_read_counters()
    fmt.count_decode_reads(True)
    if progress:
        import sys
        print(f"retrieval: {len(cases)} prompts ({len(lengths)} lengths x {len(depths)} depths x {trials} "
              f"trials), KV {fmt.name}", file=sys.stderr)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c.ids} for c in cases],
                        SamplingParams(max_tokens=answer_tokens, temperature=0.0), use_tqdm=progress)
    seconds = time.perf_counter() - start
    cells, per_prompt = score_answers(cases, [o.outputs[0].text for o in outs])
    cfg = engine.model_config
    bs = engine.config.cache.block_size
    return RetrievalResult(
        lengths=lengths, depths=depths, trials=trials, seed=seed, answer_tokens=answer_tokens,
        accuracy=sum(r["correct"] for r in per_prompt) / len(per_prompt),
        accuracy_by_length=_mean_by(per_prompt, "length"), accuracy_by_depth=_mean_by(per_prompt, "depth"),
        cells=cells, kv_cache_dtype=fmt.name,
        bits_per_element=fmt.bits_per_element(cfg.num_kv_heads, bs, cfg.head_dim),
        bits_per_element_at_length={str(n): fmt.bits_per_element_at(n, cfg.num_kv_heads, bs, cfg.head_dim)
                                    for n in lengths},
        bits_per_element_read=read.bits_per_element if (read := fmt.read_counts(decode=True)) is not None else None,
        seconds=seconds, text=str(text), filler_tokens=len(filler), answers=per_prompt)


def plot_heatmap(result: RetrievalResult | dict, path: str | Path, title: str | None = None) -> Path:
    """A PNG heat map of accuracy in percent, depth (rows) x length (columns), each cell annotated."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(result, title)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def heatmap_figure(result: RetrievalResult | dict, title: str | None = None):
    """The matplotlib Figure plot_heatmap saves (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result if isinstance(result, RetrievalResult) else RetrievalResult(**result)
    grid = [[100 * a for a in row] for row in r.grid()]
    width = max(4.4, 1.4 + 1.1 * len(r.lengths))  # inches; the colour bar and labels need about 4 of them
    fig, ax = plt.subplots(figsize=(width, 1.5 + 0.42 * len(r.depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=100.0, aspect="auto")
    ax.set_xticks(range(len(r.lengths)), [str(n) for n in r.lengths])
    ax.set_yticks(range(len(r.depths)), [f"{d:g}" for d in r.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, acc in enumerate(row):
            ax.text(j, i, f"{acc:.0f}", ha="center", va="center", fontsize=8,
                    color="black" if 25 < acc < 85 else "white")
    title = title or f"passkey retrieval, KV {r.kv_cache_dtype}: {100 * r.accuracy:.1f}% ({r.trials} per cell)"
    # wrapped to the figure's width (a 9-point character is about 0.075 inch wide), never clipped
    ax.set_title(textwrap.fill(title, width=max(20, int(0.8 * width / 0.075))), fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    return fig
