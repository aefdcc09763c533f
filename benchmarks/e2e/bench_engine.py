#!/usr/bin/env python3
"""Time per output token through the whole engine (LLMEngine.step), next to the model's step alone.

bench_decode.py times one decode step of the model, replayed from a CUDA graph. A user of
`LLM.generate` or `moekv serve` gets more: the scheduler, the inputs of every step, the steps that
a graph cannot take (page-filling steps, tiered's re-ranking), sampling and detokenization. This
script runs the engine itself on a Mixtral-8x7B-shaped model with random weights
(`load_format="dummy"`: a folder with config.json and a word-level tokenizer.json of the shape's
vocabulary, written here), prefills `batch` prompts of about `context` tokens, and once every
sequence decodes, times `--steps` calls of `engine.step()` (one token per sequence each; each call
ends with the sampled tokens on the host, so wall time is the step's time). Prompt lengths are
spread over one page (context - i * P / batch), as requests arriving at different times are, so
that page fills fall on different steps. In the same run it replays the engine's own graph of
the step (no page fill) with CUDA events: `model_step_ms`, what bench_decode measures.

    PYTHONPATH=. python benchmarks/e2e/bench_engine.py --out benchmarks/results/h200/engine.json

Every point runs in both scheduling modes (--modes): synchronous, and async (each decode step
queued before the host has read the step before it), on the same engine.

Rows: kv_cache_dtype, batch, context, async_scheduling, tpot_ms (mean engine step), tpot_p50_ms, model_step_ms,
overhead_ms (tpot_ms - model_step_ms), graph_share (steps replayed), fill_step_share (steps in
which some sequence completed a page), slow_steps (steps over twice the median, each with the graph
captures and garbage-collector time inside it), batch_range (sequences in the timed steps; every
sequence is given room to decode through all modes), prefill_s (after a short request has compiled
the kernels), floor_ms (bench_decode's: weights and KV read over the measured copy bandwidth),
nuq2_quantize (nuq2 and tiered: kernel or torch).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))

from bench_decode import SHAPES, hf_config, kv_bytes_per_token, measure_bandwidth, weight_bytes_per_step  # noqa: E402

from moekv import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from moekv.kvcache.formats import compressed_formats, format_class  # noqa: E402

# every registered format that runs without a calibration folder
FORMATS = ["bf16", *(name for name in compressed_formats() if not format_class(name).needs_calibration)]
POINTS = [(1, 4096), (16, 4096), (64, 4096)]


def write_checkpoint_folder(folder: Path, shape: str, num_layers: int | None = None) -> Path:
    """config.json of the shape (its first num_layers layers) and a word-level tokenizer.json of its
    vocabulary ('t0', 't1', ...): what the engine reads besides the weights, which load_format='dummy'
    draws at random."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = hf_config(shape)
    if num_layers:
        hf["num_hidden_layers"] = num_layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**hf, "eos_token_id": 2, "bos_token_id": 1}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def prompt_lengths(batch: int, context: int, block_size: int) -> list[int]:
    """context - i * P / batch: the sequences' page boundaries spread evenly over one page."""
    return [context - (i * block_size) // batch for i in range(batch)]


def capture_every_variant(graphs, bucket: int) -> None:
    """Capture the bucket's graphs (with every fill count, where the engine has them) before timing,
    so no capture falls inside the timed steps."""
    if graphs is None:
        return
    if "fills" in inspect.signature(graphs.capture).parameters:
        from moekv.engine.cuda_graphs import fill_buckets

        for fills in fill_buckets(bucket) if graphs.fill_variants else [0]:
            graphs.capture(bucket, fills)
    else:  # an engine without page fills in graphs (the baseline tree)
        graphs.capture(bucket)


def replay_ms(graphs, bucket: int, iters: int = 30) -> float | None:
    """Median time of one replay of the engine's graph for the bucket (no page fill), CUDA events."""
    if graphs is None:
        return None
    key = (bucket, 0) if (bucket, 0) in graphs.graphs else bucket
    if key not in graphs.graphs:
        return None
    graph = graphs.graphs[key][0]
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


class GcClock:
    """Wall time spent in Python's cyclic garbage collector (gc.callbacks), to tell a GC pause
    from a device stall in a slow step."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self)


def time_steps(engine, graphs, steps: int, block_size: int, warmup: int = 4) -> dict:
    """Time `steps` calls of engine.step() (every sequence decoding), after `warmup` untimed ones in
    this mode. Steps slower than twice the median are listed with what else happened in them
    (graph captures, time in the garbage collector)."""
    for _ in range(warmup):
        engine.step()
    replays0 = graphs.num_replays if graphs is not None else 0
    times, fill_steps, events, batches = [], 0, [], []
    clock = GcClock()
    for i in range(steps):
        lens = [s.num_tokens for s in engine.scheduler.running]  # context once this step's token is in
        fill_steps += any(n % block_size == 0 for n in lens)
        batches.append(len(lens))
        captures, gc_s = (graphs.num_captures if graphs is not None else 0), clock.seconds
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
        events.append({"step": i, "ms": round(times[-1], 2), "fills": any(n % block_size == 0 for n in lens),
                       "captures": (graphs.num_captures if graphs is not None else 0) - captures,
                       "gc_ms": round(1e3 * (clock.seconds - gc_s), 2)})
    clock.close()
    replays = (graphs.num_replays if graphs is not None else 0) - replays0
    median = statistics.median(times)
    return dict(tpot_ms=statistics.fmean(times), tpot_p50_ms=median, tpot_max_ms=max(times),
                slow_steps=[e for e in events if e["ms"] > 2 * median], batch_range=[min(batches), max(batches)],
                graph_share=replays / steps, fill_step_share=fill_steps / steps)


def decode_budget(steps: int, num_modes: int, batch: int, context: int, token_budget: int, warmup: int = 4) -> int:
    """Tokens each sequence may generate: every mode's warm-up and timed steps, and one per prefill
    step (the first prompts decode while the others prefill)."""
    prefill_steps = -(-batch * context // token_budget) + batch
    return (steps + warmup + 2) * num_modes + prefill_steps + 16


def compile_kernels(llm, cfg, block_size: int) -> None:
    """One short request (a prefill over two pages and a few decode steps, one of them filling a
    page) before any point is timed: the Triton kernels compile here, not inside the first point's
    prefill_s (which otherwise favoured whichever run came second)."""
    prompt = torch.randint(3, cfg["vocab_size"], (2 * block_size + block_size - 2,),
                           generator=torch.Generator().manual_seed(99)).tolist()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()


def run_point(llm, cfg, fmt_name: str, batch: int, context: int, steps: int, bandwidth: float, seed: int,
              modes: list[str | None], regex: str | None = None) -> list[dict]:
    """Prefill once, then time `steps` decode steps in each scheduling mode, one after the other on
    the same sequences (None: the engine has one mode, the baseline tree's). regex: every request is
    constrained by it (structured outputs: the grammar's bitmask filled and applied every step)."""
    engine = llm.engine
    runner = engine.runner
    block_size = runner.block_size
    base = {"kv_cache_dtype": fmt_name, "batch": batch, "context": context, "block_size": block_size, "steps": steps,
            "regex": regex}
    gen = torch.Generator().manual_seed(seed)
    lengths = prompt_lengths(batch, context, block_size)
    # no sequence may finish inside the timed steps (the batch would shrink into smaller buckets, whose
    # graphs would be captured there): room for every mode's warm-up and timed steps, and for the
    # tokens the first sequences decode while the others still prefill (at most one per prefill step)
    max_tokens = decode_budget(steps, len(modes), batch, context, engine.scheduler.max_num_batched_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not regex,  # (a grammar ends with EOS)
                            structured_outputs=StructuredOutputsParams(regex=regex) if regex else None)
    ids = []
    for n in lengths:
        prompt = torch.randint(3, cfg["vocab_size"], (n,), generator=gen).tolist()
        ids.append(engine.add_request(None, {"prompt_token_ids": prompt}, params, output_kind="delta"))
    if modes[0] is not None:
        engine.async_scheduling = modes[0] == "async"
    start = time.perf_counter()
    while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    base["prefill_s"] = time.perf_counter() - start
    graphs = runner.graphs
    bucket = batch if graphs is None else next(b for b in graphs.buckets if b >= batch)
    capture_every_variant(graphs, bucket)
    mcfg = engine.model_config  # the architecture's own reading of the shape
    _, weights_read = weight_bytes_per_step(mcfg, batch)
    fmt = runner.kv_format  # the engine's own, so the floor reads its pools' layout
    rows = []
    for i, mode in enumerate(modes):
        if mode is not None:
            engine.async_scheduling = mode == "async"
        row = {**base, "async_scheduling": getattr(engine, "async_scheduling", False),
               **time_steps(engine, graphs, steps, block_size)}
        mean_context = context + (i + 0.5) * (steps + 1)
        kv_read = batch * mean_context * kv_bytes_per_token(fmt, mcfg, block_size)
        row["floor_ms"] = 1e3 * (weights_read + kv_read) / bandwidth
        rows.append(row)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # drops a step still queued ahead for the aborted requests
    engine.runner.release_pages(engine.block_manager.drain_freed())
    model_ms = replay_ms(graphs, bucket)
    for row in rows:
        row["model_step_ms"] = model_ms
        if model_ms is not None:
            row["overhead_ms"] = row["tpot_ms"] - model_ms
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(SHAPES))
    p.add_argument("--formats", nargs="*", default=FORMATS)
    p.add_argument("--points", nargs="*", default=None, help="batch:context pairs (default: 1, 16, 64 at 4k)")
    p.add_argument("--steps", type=int, default=96, help="decode steps timed per point")
    p.add_argument("--num-layers", type=int, default=None, help="the shape's first N layers (to fit a smaller GPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--modes", nargs="*", default=["sync", "async"], choices=["sync", "async"],
                   help="scheduling modes timed at every point, in the same run (async: steps queued ahead)")
    p.add_argument("--nuq2-quantize", nargs="*", default=["kernel"], choices=["kernel", "torch"],
                   help="how nuq2 pages are quantized (nuq2, tiered): the fused kernel and/or the torch "
                        "reference (MOEKV_NUQ2_QUANTIZE_KERNEL), each a run of its own")
    p.add_argument("--grammar", metavar="REGEX", default=None,
                   help="time every point once more with every request constrained by REGEX (structured "
                        "outputs; the tokenizer's tokens are 't0' .. 't<V-1>', so '[t0-9]{20000}' allows every "
                        "token and never completes)")
    p.add_argument("--label", default="", help="written into every row (e.g. which tree ran)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_engine needs a CUDA device")
    points = [tuple(int(x) for x in s.split(":")) for s in args.points] if args.points else POINTS
    import triton

    bandwidth = measure_bandwidth(torch.device("cuda"))
    print(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    folder = write_checkpoint_folder(Path(tempfile.mkdtemp(prefix="moekv-dummy-")), args.shape, args.num_layers)
    cfg = hf_config(args.shape)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
              "bandwidth_bytes_per_s": bandwidth, "rows": []}
    runs = [(f, q) for f in args.formats for q in (args.nuq2_quantize if f in ("nuq2", "tiered") else [None])]
    for fmt_name, quantize_impl in runs:
        if quantize_impl is not None:  # read when the format is built
            os.environ["MOEKV_NUQ2_QUANTIZE_KERNEL"] = "1" if quantize_impl == "kernel" else "0"
        max_batch = max(b for b, _ in points)
        max_len = max(c + decode_budget(args.steps, len(args.modes), b, c, args.max_num_batched_tokens)
                      for b, c in points) + 16
        try:
            llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype=fmt_name,
                      max_model_len=max_len, max_num_seqs=max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
                      kv_codebook="page" if fmt_name in ("nuq2", "tiered") else "auto")
        except Exception as e:  # report and go on with the next format
            result["rows"].append({"kv_cache_dtype": fmt_name, "nuq2_quantize": quantize_impl,
                                   "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        modes = args.modes if hasattr(llm.engine, "async_scheduling") else [None]  # (the baseline tree: one mode)
        compile_kernels(llm, cfg, llm.engine.runner.block_size)
        regexes = [None, args.grammar] if args.grammar else [None]  # each point free, then constrained
        for batch, context, regex in [(b, c, r) for b, c in points for r in regexes]:
            try:
                rows = run_point(llm, cfg, fmt_name, batch, context, args.steps, bandwidth, seed=batch, modes=modes,
                                 regex=regex)
            except Exception as e:
                rows = [{"kv_cache_dtype": fmt_name, "batch": batch, "context": context, "regex": regex,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"}]
            for row in rows:
                row["label"] = args.label
                row["nuq2_quantize"] = quantize_impl
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            if args.out:  # after every point: a cut-off run keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'format':10} {'B':>3} {'ctx':>6} {'async':>5} {'engine ms':>10} {'p50':>7} {'model ms':>9} "
          f"{'overhead':>9} {'graphs':>7} {'fills':>6} {'floor':>6}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['kv_cache_dtype']:10} {r.get('batch', '')!s:>3} {r.get('context', '')!s:>6} "
                  f"error: {r['error'][:80]}")
            continue
        model = f"{r['model_step_ms']:.2f}" if r.get("model_step_ms") is not None else "-"
        over = f"{r['overhead_ms']:.2f}" if r.get("overhead_ms") is not None else "-"
        name = r["kv_cache_dtype"] + ("+regex" if r.get("regex") else "")
        print(f"{name:10} {r['batch']:>3} {r['context']:>6} {str(r['async_scheduling']):>5} "
              f"{r['tpot_ms']:>10.2f} {r['tpot_p50_ms']:>7.2f} "
              f"{model:>9} {over:>9} {r['graph_share']:>7.2f} {r['fill_step_share']:>6.2f} {r['floor_ms']:>6.2f}")


if __name__ == "__main__":
    main()
