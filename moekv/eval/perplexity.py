"""Perplexity of a text through the engine's own KV cache.

The text is tokenized once and scored in windows of `window` tokens that advance by `stride`:
each window is prefilled through the engine (its K/V written to pages in the chosen KV format and
read back from them by attention), and only the tokens not scored by an earlier window count, so
every token after the first window is predicted from at least window - stride tokens of context.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    window: int
    stride: int
    kv_cache_dtype: str
    bits_per_element: float
    mode: str
    seconds: float
    text: str = ""
    # bits per element that attention actually read (formats whose mix changes at run time)
    bits_per_element_read: float | None = None
    # one sequence of `window` tokens: its full pages plus staging / full-precision window bytes
    bits_per_element_at_window: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window: tokens [begin, end) go in, and positions
    first_scored..end-1 are predicted (position 0 of the text is never predicted)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    out = []
    scored_until = 1  # the first token has no context to be predicted from
    begin = 0
    while scored_until < num_tokens:
        end = min(begin + window, num_tokens)
        out.append((begin, end, scored_until))
        scored_until = end
        if end == num_tokens:
            break
        begin = min(begin + stride, end - 1)  # keep >= 1 token of context for the next window
    return out


def read_utf8(path: str | Path) -> str:
    """The text of a UTF-8 file; ValueError naming the file and the byte offset of the first invalid
    sequence (a score of replacement characters would be a score of nothing)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} "
                         f"({e.reason}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_text_tokens(tokenizer, path: str | Path, max_tokens: int | None) -> list[int]:
    text = read_utf8(path)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{path} holds {len(ids)} token(s); perplexity needs at least 2")
    return ids


def nll_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of targets [n] under logits [n, V] (fp64 accumulation)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return -logprobs.gather(1, targets[:, None]).sum()


def score_windows(logits_fn, ids: list[int], window: int, stride: int, progress: bool = True,
                  batch_windows: int = 8) -> tuple[float, int]:
    """Sum of NLL and count of scored tokens.

    logits_fn(chunks, first_rows, progress) -> list of [len, V]: chunks are token lists, first_rows[i]
    the first row of chunk i whose logits are scored (rows before it are context only); progress, if
    logits_fn calls it (after each engine step), takes each chunk's tokens computed so far, and the bar
    advances by the scored rows they cover (per step, not per window).
    """
    plan = windows(len(ids), window, stride)
    total, count = 0.0, 0
    bar = tqdm(total=len(ids) - 1, desc="perplexity", unit="tok", disable=not progress)
    for i in range(0, len(plan), batch_windows):
        group = plan[i:i + batch_windows]
        first_rows = [first - 1 - b for b, _, first in group]
        shown = 0  # scored rows of this group the bar counts

        def advance(computed: list[int], group=group, first_rows=first_rows) -> None:
            nonlocal shown
            # logits row r exists once r + 1 tokens are computed; the scored rows are first_row..end-begin-2
            done = sum(min(max(c - row, 0), end - first)
                       for c, row, (_, end, first) in zip(computed, first_rows, group))
            if done > shown:
                bar.update(done - shown)
                shown = done

        all_logits = logits_fn([ids[b:e] for b, e, _ in group], first_rows, advance)
        for (begin, end, first), logits in zip(group, all_logits):
            # logits row r predicts token begin + r + 1
            rows = slice(first - 1 - begin, end - 1 - begin)
            targets = torch.tensor(ids[first:end])
            total += float(nll_from_logits(logits[rows], targets))
            count += end - first
        bar.update(sum(end - first for _, end, first in group) - shown)
    bar.close()
    return total, count


def perplexity(llm, text_path: str | Path, window: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, progress: bool = True, mode: str = "decode") -> PerplexityResult:
    """Perplexity of the file through `llm` (a moekv.LLM) and its configured KV format.

    mode "decode": each window's context is prefilled, then its scored tokens are fed one per step
    as generation feeds them, so every prediction reads the cache exactly as decoding would (the
    newest partial page in staging, older pages compressed). mode "prefill": the whole window is
    one prefill (faster; for compressed formats optimistic: a prefill chunk attends to its own
    tokens' K/V as computed, so a one-chunk window reads nothing compressed, though the pages are
    written compressed for later steps).
    """
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode={mode!r} is not accepted; use 'decode' or 'prefill'")
    engine = llm.engine
    window = engine.max_model_len if window is None else window
    stride = max(1, window // 2) if stride is None else stride
    if window > engine.max_model_len:
        raise ValueError(f"window={window} exceeds the engine's max_model_len={engine.max_model_len}")
    ids = read_text_tokens(engine.tokenizer, text_path, max_tokens)
    fmt = engine.runner.kv_format
    fmt.reset_read_counters()  # a format whose bits read depend on the run (tiered) counts them: read_counts
    start = time.perf_counter()
    def logits_fn(chunks, first_rows, advance):
        prompts = [{"prompt_token_ids": c} for c in chunks]
        # decode mode: every scored row comes from a one-token step, as in generation
        return llm.score(prompts, decode_from=first_rows if mode == "decode" else None, progress=advance)

    batch = min(engine.config.scheduler.max_num_seqs, 32) if mode == "decode" else 8
    total, count = score_windows(logits_fn, ids, window, stride, progress, batch_windows=batch)
    seconds = time.perf_counter() - start
    cfg = engine.model_config
    return PerplexityResult(
        ppl=math.exp(total / count), nll=total / count, tokens=count, window=window, stride=stride, mode=mode,
        kv_cache_dtype=fmt.name, seconds=seconds, text=str(text_path),
        bits_per_element=fmt.bits_per_element(cfg.num_kv_heads, engine.config.cache.block_size, cfg.head_dim),
        bits_per_element_read=read.bits_per_element if (read := fmt.read_counts()) is not None else None,
        bits_per_element_at_window=fmt.bits_per_element_at(window, cfg.num_kv_heads, engine.config.cache.block_size,
                                                           cfg.head_dim))


def text_files(paths: str | Path | list[str | Path]) -> dict[str, Path]:
    """Domain name (the file's stem) -> text file, for files and folders (a folder gives its *.txt files,
    sorted). Names must not repeat; each must be UTF-8 (read_utf8)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: dict[str, Path] = {}
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise ValueError(f"folder {path} holds no .txt file")
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"text file not found: {path}")
        for f in files:
            read_utf8(f)  # (before the model loads)
            if f.stem in out:
                raise ValueError(f"two texts are named {f.stem!r} ({out[f.stem]} and {f}); domains are named by "
                                 "file stem, so rename one")
            out[f.stem] = f
    return out


def perplexity_domains(llm, texts: dict[str, str | Path], **kwargs) -> tuple[dict[str, PerplexityResult],
                                                                            PerplexityResult]:
    """perplexity() of each text alone, and their token-weighted total (text: the names, comma-separated;
    seconds: the sum). kwargs go to perplexity()."""
    if not texts:
        raise ValueError("give at least one text")
    results, read = {}, None
    fmt = llm.engine.runner.kv_format
    for name, path in texts.items():
        results[name] = perplexity(llm, path, **kwargs)
        counts = fmt.read_counts()  # reset by each perplexity() call: add them up here
        if counts is not None:
            read = counts if read is None else read + counts
    first = next(iter(results.values()))
    tokens = sum(r.tokens for r in results.values())
    nll = sum(r.nll * r.tokens for r in results.values()) / tokens
    total = PerplexityResult(
        ppl=math.exp(nll), nll=nll, tokens=tokens, window=first.window, stride=first.stride,
        kv_cache_dtype=first.kv_cache_dtype, bits_per_element=first.bits_per_element, mode=first.mode,
        seconds=sum(r.seconds for r in results.values()), text=", ".join(results),
        bits_per_element_read=read.bits_per_element if read is not None else None,
        bits_per_element_at_window=first.bits_per_element_at_window)
    return results, total


def perplexity_transformers(model_dir: str | Path, ids: list[int], window: int, stride: int,
                            dtype: torch.dtype = torch.float32, device: str = "cpu",
                            progress: bool = True) -> tuple[float, int]:
    """The same windows scored by transformers itself (an independent oracle; dev dependency)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    @torch.no_grad()
    def logits_fn(chunks, first_rows, advance):  # one forward per window: the bar advances per window group
        return [model(torch.tensor([c], device=device)).logits[0].float().cpu() for c in chunks]

    total, count = score_windows(logits_fn, ids, window, stride, progress)
    return math.exp(total / count), count
