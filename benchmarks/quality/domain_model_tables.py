"""Every KV format on the shipped 4k model (models/domain-moe): passkey retrieval by context length and
depth, and held-out perplexity per domain, with the bits per element each format stores and reads.

    PYTHONPATH=. python benchmarks/quality/domain_model_tables.py --device cuda --out RESULT.json
    PYTHONPATH=. python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail \
        --no-retrieval --formats bf16 fp8_e4m3 nuq2 tiered --out DECODE.json

On a multi-head latent attention model (--model models/domain-mla) the names are its latent caches
(kvcache/formats/latent_choice.py): bf16, fp8_e4m3, int4 (int4:kv_group_size=64), and the 2-bit kivi2
(KIVI's per-channel recipe, the baseline) and nuq2 (per channel, Gaussian codebook), each with a 16-bit
window of the newest 128 entries (at least one 32-token group); vq and tiered have no latent form:

    PYTHONPATH=. python benchmarks/quality/domain_model_tables.py --device cuda --model models/domain-mla \
        --ppl-mode decode-tail --formats bf16 fp8_e4m3 int4 int4:kv_group_size=64 kivi2 nuq2 \
        nuq2:kv_residual=32 --out MLA.json

A format is a kv_cache_dtype with engine options after colons: `nuq2:kv_codebook=page` (nuq2 with
per-page codebooks instead of the shipped calibration's), `tiered:kv_rerank_interval=1` (re-ranked
before every decode step, so the passkey's answer tokens read the tiers the ranking chose). In
--ppl-mode prefill no decode step runs, so tiered serves every page from its FP8 tier (its row is
FP8's); on CUDA, tiered with calibrated nuq2 codebooks (a checkpoint's kv_calibration/ is found on
its own) has no fused decode kernel and decodes through the reference path, one sequence at a time:
give `tiered:kv_codebook=page` there. --ppl-mode decode-tail takes --tail-windows windows of 4096
tokens per domain, prefills all but the last --tail-tokens of each and feeds those one per decode
step (all windows in one batch), so every scored token sees ~4k tokens of context read as generation
reads it (tiered re-ranking every --kv-rerank-interval steps); the bits tiered's decode rows read are
counted over those steps.
One engine per format; results are written after each format, so a cut run keeps what it finished.
`--plot PNG` draws perplexity change and retrieval at the longest length against bits per element from
--out (a file of several runs under `runs` too); with `--replot` it only draws, running nothing:

    python benchmarks/quality/domain_model_tables.py --replot --out RESULT.json --plot RESULT.png
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from result_paths import repo_path, repo_relative

from moekv import LLM
from moekv.eval.perplexity import PerplexityResult, nll_from_logits, perplexity_domains, text_files
from moekv.eval.retrieval import evaluate_retrieval

MODEL = Path(__file__).resolve().parents[2] / "models" / "domain-moe"
FORMATS = ("bf16", "fp8_e4m3", "int4", "kivi2", "nuq2", "nuq2:kv_codebook=page", "vq", "tiered:kv_rerank_interval=1")


def parse_format(spec: str) -> tuple[str, dict]:
    """'tiered:kv_rerank_interval=1' -> ('tiered', {'kv_rerank_interval': 1}); values as bool (True /
    False), int, float or str."""
    name, *opts = spec.split(":")
    options = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if value in ("True", "False"):
            options[key] = value == "True"
            continue
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return name, options


def decode_tail_ppl(llm, domains: dict[str, Path], window: int, scored: int, per_domain: int):
    """Perplexity of the last `scored` tokens of `per_domain` non-overlapping `window`-token windows of
    each text, every scored token fed by a decode step (one batch for all windows of all domains)."""
    engine = llm.engine
    fmt = engine.runner.kv_format
    prompts, owners = [], []
    for name, path in domains.items():
        ids = engine.tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace"),
                                      add_special_tokens=False)
        for i in range(min(per_domain, len(ids) // window)):
            prompts.append(ids[i * window:(i + 1) * window])
            owners.append(name)
    fmt.reset_read_counters()  # tiered: count what the decode steps read (fused kernel included)
    fmt.count_decode_reads(True)
    start = time.perf_counter()
    first = window - 1 - scored  # logits row r predicts token r + 1; rows from `first` on come from decode steps
    logits = llm.score([{"prompt_token_ids": ids} for ids in prompts], decode_from=[first] * len(prompts))
    sums: dict[str, list[float]] = {}
    for name, ids, rows in zip(owners, prompts, logits):
        nll = float(nll_from_logits(rows[first:window - 1], torch.tensor(ids[first + 1:window])))
        agg = sums.setdefault(name, [0.0, 0])
        agg[0] += nll
        agg[1] += scored
    seconds = time.perf_counter() - start
    cfg = engine.model_config
    bits = fmt.bits_per_element(cfg.num_kv_heads, engine.config.cache.block_size, cfg.head_dim)
    read = counts.bits_per_element if (counts := fmt.read_counts(decode=True)) is not None else None
    at_window = fmt.bits_per_element_at(window, cfg.num_kv_heads, engine.config.cache.block_size, cfg.head_dim)

    def result(nll: float, count: int, text: str) -> PerplexityResult:
        return PerplexityResult(ppl=math.exp(nll / count), nll=nll / count, tokens=count, window=window,
                                stride=scored, mode="decode-tail", kv_cache_dtype=fmt.name, seconds=seconds,
                                text=text, bits_per_element=bits, bits_per_element_read=read,
                                bits_per_element_at_window=at_window)

    per = {name: result(v[0], v[1], str(domains[name])) for name, v in sums.items()}
    total = result(sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values()), ", ".join(sums))
    return per, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--device", default="cuda")
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=8, help="keys per (length, depth) cell")
    p.add_argument("--filler", default=None, help="filler text (default: the held-out prose)")
    p.add_argument("--heldout", default=None,
                   help="folder of held-out texts, one per domain (default: the model's heldout/, else domain-moe's, "
                        "whose texts domain-mla shares)")
    p.add_argument("--ppl-max-tokens", type=int, default=32768, help="scored tokens per domain")
    p.add_argument("--ppl-mode", choices=("prefill", "decode", "decode-tail"), default="prefill")
    p.add_argument("--tail-windows", type=int, default=8, help="decode-tail: windows per domain")
    p.add_argument("--tail-tokens", type=int, default=256, help="decode-tail: scored tokens per window")
    p.add_argument("--ppl-stride", type=int, default=None, help="scored tokens per window (default: half of it)")
    p.add_argument("--no-retrieval", action="store_true", help="perplexity only")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the formats of --out into PNG")
    p.add_argument("--replot", action="store_true", help="only draw --plot from an existing --out")
    args = p.parse_args()
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot PNG")
        plot(json.loads(Path(args.out).read_text()), Path(args.plot))
        return

    model = Path(args.model)
    heldout = Path(args.heldout) if args.heldout else model / "heldout"
    if not heldout.is_dir() and args.heldout is None:
        heldout = MODEL / "heldout"
    filler = args.filler or heldout / "prose.txt"
    domains = text_files(heldout)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    record = {"model": str(model.name), "device": args.device, "dtype": dtype, "filler": repo_path(filler),
              "command": "python benchmarks/quality/domain_model_tables.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "model")),
              "formats": {}}
    for fmt in args.formats:
        start = time.perf_counter()
        name, options = parse_format(fmt)
        llm = LLM(model=str(model), device=args.device, dtype=dtype, kv_cache_dtype=name,
                  max_model_len=max(args.lengths), max_num_seqs=64, **options)
        retrieval = {} if args.no_retrieval else evaluate_retrieval(
            llm, filler, lengths=args.lengths, depths=args.depths, trials=args.trials, seed=0,
            progress=False).to_dict()
        if args.ppl_mode == "decode-tail":
            per_domain, total = decode_tail_ppl(llm, domains, max(args.lengths), args.tail_tokens, args.tail_windows)
        else:
            per_domain, total = perplexity_domains(llm, domains, max_tokens=args.ppl_max_tokens,
                                                   mode=args.ppl_mode, stride=args.ppl_stride, progress=False)
        record["formats"][fmt] = {
            "retrieval": {k: retrieval[k] for k in retrieval if k != "answers"},
            "ppl": {name: r.to_dict() for name, r in per_domain.items()} | {"total": total.to_dict()},
            "seconds": time.perf_counter() - start,
        }
        acc = retrieval.get("accuracy")
        print(f"{fmt}: retrieval {acc} by length {retrieval.get('accuracy_by_length')}; ppl "
              + ", ".join(f"{n} {r.ppl:.3f}" for n, r in per_domain.items())
              + f"; {total.bits_per_element:.2f} bits stored, read {total.bits_per_element_read} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        Path(args.out).write_text(json.dumps(repo_relative(record), indent=1))
        del llm
    if args.plot:
        plot(record, Path(args.plot))


def plot(record: dict, png: Path) -> None:
    """Two panels over the prefill rows of `record` (one run, or several under `runs`): total perplexity
    change against bf16 and retrieval accuracy at the longest length, each against bits per element
    stored at that length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record.get("runs", [record])
    rows = {fmt: r for run in runs for fmt, r in run["formats"].items() if r["ppl"]["total"]["mode"] == "prefill"}
    base = rows["bf16"]["ppl"]["total"]["ppl"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (fmt, r) in enumerate(rows.items()):
        color = f"C{i}"  # one colour a format in both panels
        name, options = parse_format(fmt)
        label = name + (" (page codebooks)" if name == "nuq2" and options.get("kv_codebook") == "page" else "")
        total = r["ppl"]["total"]
        bits = total["bits_per_element_at_window"]
        if fmt != "bf16":  # the baseline: 0% on a log axis
            change = 100 * (total["ppl"] / base - 1)
            left.scatter(bits, change, color=color)
            left.annotate(label, (bits, change), fontsize=8, xytext=(4, 3), textcoords="offset points")
        ret = r["retrieval"]
        if ret:
            longest = str(max(int(k) for k in ret["accuracy_by_length"]))
            right.scatter(bits, 100 * ret["accuracy_by_length"][longest], color=color)
            right.annotate(label, (bits, 100 * ret["accuracy_by_length"][longest]), fontsize=8,
                           xytext=(4, 3), textcoords="offset points")
    left.set_yscale("log")
    left.set_xlabel("bits per element stored (at 4k, staged page included)")
    left.set_ylabel("perplexity change vs bf16, all domains (%)")
    right.set_xlabel("bits per element stored (at 4k, staged page included)")
    right.set_ylabel("passkeys right at the longest length (%)")
    right.set_ylim(0, 105)
    fig.suptitle(f"KV formats on {record.get('model', runs[0].get('model'))}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
