#!/usr/bin/env python3
"""Batch-1 decode time per token (TPOT) with expert L2 prefetch and with expert offload (issue 28).

Random bf16 weights (the loader's `--load-format dummy`: N(0, 0.02), norms at 1), KV pools of bf16
pages filled as if `--context` tokens were cached, one decode step timed per variant:

- `l2` part (all layers of the shape): (a) all-resident, the step replayed from a CUDA graph; (b)
  the same with moekv/experts/l2_prefetch.py's side stream (pre-gating prediction, then
  prefetch.global.L2 over the first bytes of each predicted expert's w13) at several byte budgets,
  at two launch points (`router`: after the attention block, beside the norm, router and top-k;
  `attention`: as soon as the prediction is done, beside the attention), and the bulk-prefetch
  variant. Variants are timed in two interleaved rounds (their spread is the noise figure); one
  replay with and without the prefetch is profiled (kernels per stream, what ran beside the prefetch).
- `offload` part (the first `--offload-layers` layers of the shape: the experts of the whole model
  would not fit pinned in the machine's host memory next to the rest): (a) all-resident, eager and
  graph; (c) experts in pinned host memory, half of each layer's experts resident in an LRU expert
  cache, misses copied on demand; (d) the same budget with the predicted experts copied in before
  each layer on the copy stream: pre-gating (its recall on dummy weights is what it is: reported),
  and a replayed-routing predictor at recall 1.0 and 0.85 (the issue's target), which returns the
  step's true experts (recorded on the resident model for the same token) with a share replaced by
  random ones. Each predictor runs in the modes of `--offload-modes`: lookahead 1 or 2 (the
  prediction of layer L made before layer L or before layer L - 1), with the host sync (`.tolist()`)
  or sync-free (`-async`: pinned buffer + event on a side stream, polled; moekv/experts/offload.py).
  Offload steps run eagerly (the engine does the same). Per run: step time, hit rate and prediction
  recall per layer, host->device bytes per token, predictions acted on / late (dropped) / waited for.

    PYTHONPATH=. python benchmarks/e2e/bench_expert_offload.py --shapes mixtral-8x7b qwen3-30b-a3b \\
        --out benchmarks/results/h200/expert_offload.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))

from bench_decode import capture_graph, install_filled_caches, measure_bandwidth, time_ms  # noqa: E402

from moekv.experts.l2_prefetch import ExpertL2Prefetch, l2_prefetch_budget  # noqa: E402
from moekv.experts.observe import observed  # noqa: E402
from moekv.experts.offload import ExpertCache, ExpertOffload, OffloadedExperts  # noqa: E402
from moekv.experts.predictor import ExpertPredictor, recall  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.models import mixtral  # noqa: E402
from moekv.models.loader import empty_model, init_dummy_weights, install_routers, moe_layers  # noqa: E402
from moekv.models.model_config import apply_routing_fields  # noqa: E402
from moekv.routing.tap import tapped  # noqa: E402

COMMON = dict(rope_theta=1e6, max_position_embeddings=262144, rms_norm_eps=1e-6)
SHAPES = {
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2),
    # Qwen3-30B-A3B's sizes on the Mixtral layer (no q/k norm: it does not change the bytes moved)
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=768, num_local_experts=128,
                          num_experts_per_tok=8),
    "small": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024, num_local_experts=8,
                  num_experts_per_tok=2),
}
MB = 10**6


def build(shape: str, layers: int | None, device: torch.device):
    hf = {"architectures": ["MixtralForCausalLM"], "torch_dtype": "bfloat16", **COMMON, **SHAPES[shape]}
    if layers is not None:
        hf["num_hidden_layers"] = min(layers, hf["num_hidden_layers"])
    cfg = apply_routing_fields(mixtral.config_from_hf(hf), hf)
    model = init_dummy_weights(empty_model(cfg, torch.bfloat16, device))
    install_routers(model, cfg, routing="flat")
    return model, cfg


def expert_bytes(cfg) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- L2 prefetch ------------------------------------------------------------------------------------
class FixedRouting:
    """A predictor that always names the timed token's true experts (recorded once): the L2
    prefetch's gain at recall 1, apart from what pre-gating gets right on dummy weights."""

    kind = "true routing"

    def __init__(self, ids: dict, num_experts: int, top_k: int, device) -> None:
        self.top_k = top_k
        self.by_layer = {i: torch.zeros(1, num_experts, device=device).scatter_(1, e.reshape(1, -1), 1.0)
                         for i, e in ids.items()}

    def scores(self, layer_idx: int, residual: torch.Tensor) -> torch.Tensor:
        return self.by_layer[layer_idx]


def l2_part(shape: str, context: int, iters: int, budgets_mb: list[float], device, recall_tokens: int = 31) -> dict:
    t0 = time.time()
    model, cfg = build(shape, None, device)
    ctx = install_filled_caches(model, cfg, get_kv_format("bf16", torch.bfloat16), 1, context, 16, device)
    ids = torch.randint(0, cfg.vocab_size, (1,), device=device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    pregate = ExpertPredictor(model)
    # the timed token's true routing, and pre-gating's recall on these dummy weights (eager)
    true_ids, recalls = {}, {}
    first = [True]

    def seen(i, residual, hidden, weights, expert_ids):
        if first[0]:
            true_ids[i] = expert_ids.clone()
        recalls.setdefault(i, []).append(float(recall(pregate.predict(i, residual), expert_ids).mean()))

    gen = torch.Generator(device).manual_seed(2)
    with torch.no_grad(), observed(model, seen):
        model(ids, ctx)
        first[0] = False
        for _ in range(recall_tokens):
            model(torch.randint(0, cfg.vocab_size, (1,), device=device, generator=gen), ctx)
    oracle = FixedRouting(true_ids, cfg.num_experts, cfg.top_k, device)
    hook = ExpertL2Prefetch(model, pregate, l2_prefetch_budget(l2), device)
    model.hooks.before_layer, model.hooks.after_layers = hook, hook.after_layers

    holder = [None]

    def step():
        holder[0] = model.compute_logits(model(ids, ctx))  # at capture: the graph's output buffer
        return holder[0]

    mid = budgets_mb[len(budgets_mb) // 2]
    variants = [("off", None, False, None, None)] + \
        [(f"router {mb:g} MB", mb, False, "router", pregate) for mb in budgets_mb] + \
        [(f"attention {mb:g} MB", mb, False, "attention", pregate) for mb in (mid, budgets_mb[-1])] + \
        [(f"router {mid:g} MB bulk", mid, True, "router", pregate)] + \
        [(f"router {mb:g} MB, true routing", mb, False, "router", oracle) for mb in (mid, budgets_mb[-1])]
    rows = {name: {"variant": name, "budget_mb": mb, "bulk": bulk, "when": when, "times_ms": [],
                   "predictor": None if p is None else getattr(p, "kind", "pregate")}
            for name, mb, bulk, when, p in variants}
    graphs, outputs = {}, {}
    with torch.no_grad():
        for name, mb, bulk, when, predictor in variants:
            hook.enabled = mb is not None
            if mb is not None:
                # above half the L2 the benchmark sets the bytes itself (the engine never does)
                hook.budget_bytes = int(mb * MB)
                hook.bulk, hook.when, hook.predictor = bulk, when, predictor
            try:
                launches = hook.launches
                graphs[name] = capture_graph(step)
                outputs[name] = holder[0]
                rows[name]["prefetch_mb_per_layer"] = hook.budget_bytes / MB if mb is not None else 0.0
                rows[name]["layer_prefetches_captured"] = hook.launches - launches
            except Exception as e:  # one failing variant must not lose the others
                rows[name]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                hook._pending = hook._ready = None
                torch.cuda.synchronize()
        for name in graphs:  # the prefetch writes nothing: every variant's logits are the plain graph's
            graphs[name].replay()
            torch.cuda.synchronize()
            if "off" in outputs:
                rows[name]["logits_equal_off"] = bool(torch.equal(outputs[name], outputs["off"]))
                rows[name]["logits_max_abs_diff_vs_off"] = float((outputs[name] - outputs["off"]).abs().max())
        for _ in range(2):  # two interleaved rounds
            for name, *_ in variants:
                if name in graphs:
                    rows[name]["times_ms"].append(time_ms(graphs[name].replay, iters))
    profiled = next((v[0] for v in variants[1:] if v[0] in graphs and v[1] == mid), None)
    profile = {name: profile_kernels(graphs[name].replay) for name in ("off", profiled) if name in graphs}
    for r in rows.values():
        if r["times_ms"]:
            r["tpot_ms"] = min(r["times_ms"])
    base = rows["off"].get("tpot_ms")
    for r in rows.values():
        if base and r.get("tpot_ms"):
            r["vs_off"] = r["tpot_ms"] / base - 1
    record = {"shape": shape, "layers": cfg.num_layers, "context": context, "l2_bytes": l2,
              "pregate_recall_per_layer_dummy_weights": {str(i): sum(v) / len(v) for i, v in recalls.items()},
              "recall_tokens": recall_tokens + 1,
              "expert_w13_bytes": 2 * cfg.hidden_size * cfg.moe_intermediate_size * 2,
              "default_budget_mb": l2_prefetch_budget(l2) / MB, "rows": list(rows.values()),
              "profile_variant": profiled, "profile": profile,
              "seconds": round(time.time() - t0, 1)}
    del graphs, outputs, hook
    for attn in model.attention_layers:
        attn.hooks.kv_cache = None
    model.hooks.before_layer = model.hooks.after_layers = None
    free(model)
    return record


def profile_kernels(fn, first: int = 48) -> dict:
    """One call of fn under the profiler: the first `first` kernels (name, stream, start and
    duration in us from the first kernel) and, per prefetch kernel, the compute-stream kernels that
    ran while it did (the overlap)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            trace = json.loads(Path(path).read_text())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    kernels = sorted((ev for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel"), key=lambda ev: ev["ts"])
    if not kernels:
        return {"error": "no kernel events in the trace (graph replays not traced per kernel)"}
    t0 = kernels[0]["ts"]
    rows = [{"name": ev["name"][:80], "stream": ev.get("args", {}).get("stream", ev.get("tid")),
             "start_us": round(ev["ts"] - t0, 2), "dur_us": round(ev.get("dur", 0), 2)} for ev in kernels]
    pf = [r for r in rows if "l2_prefetch" in r["name"]]
    streams = {r["stream"] for r in pf}
    overlap = []
    for r in pf[:4]:
        end = r["start_us"] + r["dur_us"]
        beside = [c["name"][:40] for c in rows if c["stream"] not in streams
                  and c["start_us"] < end and c["start_us"] + c["dur_us"] > r["start_us"]]
        overlap.append({"prefetch_start_us": r["start_us"], "prefetch_dur_us": r["dur_us"],
                        "compute_kernels_beside": beside})
    by_name: dict[str, list] = {}
    for r in rows:
        c = by_name.setdefault(r["name"][:60], [0, 0.0])
        c[0] += 1
        c[1] = round(c[1] + r["dur_us"], 2)
    return {"kernels": len(rows), "prefetch_kernels": len(pf),
            "step_us": round(rows[-1]["start_us"] + rows[-1]["dur_us"], 1),
            "count_and_total_us_by_kernel": dict(sorted(by_name.items(), key=lambda kv: -kv[1][1])),
            "first_kernels": rows[:first], "overlap": overlap}


# -- offload -----------------------------------------------------------------------------------------
class ReplayedRouting:
    """A predictor that knows each step's true experts (recorded on the resident model) and keeps a
    share `recall` of them, the rest replaced by random other experts: recall under control."""

    def __init__(self, routing: dict, top_k: int, num_experts: int, recall: float, seed: int = 0) -> None:
        self.routing, self.top_k, self.num_experts, self.recall = routing, top_k, num_experts, recall
        self.gen = torch.Generator().manual_seed(seed)
        self.step = 0
        self.kind = f"replayed routing, recall {recall:g}"

    def scores(self, layer_idx: int, residual: torch.Tensor) -> torch.Tensor:
        true = self.routing[(self.step, layer_idx)]  # [T, k] on the host
        T = true.shape[0]
        s = torch.rand(T, self.num_experts, generator=self.gen)
        keep = torch.rand(true.shape, generator=self.gen) < self.recall
        s.scatter_(1, true, torch.where(keep, 2.0, -1.0))
        if residual.is_cuda:  # from pinned memory without blocking: a plain .to() would sync the stream
            return s.pin_memory().to(residual.device, non_blocking=True)
        return s


OFFLOAD_MODES = {"1": (1, False), "2": (2, False), "1-async": (1, True), "2-async": (2, True)}


def mode_name(mode: str) -> str:
    lookahead, sync_free = OFFLOAD_MODES[mode]
    parts = ([f"lookahead {lookahead}"] if lookahead != 1 else []) + (["sync-free"] if sync_free else [])
    return ", ".join(parts)


def offload_part(shape: str, layers: int, context: int, steps: int, warmup: int, device,
                 modes: tuple[str, ...] = tuple(OFFLOAD_MODES)) -> dict:
    t0 = time.time()
    model, cfg = build(shape, layers, device)
    cuda = device.type == "cuda"
    ctx = install_filled_caches(model, cfg, get_kv_format("bf16", torch.bfloat16), 1, context, 16, device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (warmup + steps,), generator=gen).tolist()
    moes = moe_layers(model)
    E, k = cfg.num_experts, cfg.top_k
    slots = E // 2
    record = {"shape": shape, "layers": cfg.num_layers, "context": context, "steps": steps, "warmup": warmup,
              "experts": E, "top_k": k, "slots_per_layer": slots, "expert_bytes": expert_bytes(cfg), "runs": []}

    logits_of: list = []  # each step's logits of the last run_steps call (on the host)

    def run_steps(before=None) -> list[float]:
        times = []
        logits_of.clear()
        with torch.no_grad():
            for s, tok in enumerate(tokens):
                if before is not None:
                    before(s)
                ids = torch.tensor([tok], device=device)
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                logits = model.compute_logits(model(ids, ctx))
                if cuda:
                    torch.cuda.synchronize()
                if s >= warmup:
                    times.append((time.perf_counter() - start) * 1e3)
                logits_of.append(logits.cpu())
        return times

    # (a) all-resident, recording each step's true routing
    routing = {}
    current = [0]

    def record_ids(layer_idx, hidden, logits, weights, ids):
        routing[(current[0], layer_idx)] = ids.detach().cpu()

    def set_step(s):
        current[0] = s

    with tapped(moes, record_ids):
        run_steps(set_step)
    eager = run_steps()
    resident_logits = list(logits_of)
    row = {"run": "all-resident, eager", "step_ms_median": sorted(eager)[len(eager) // 2]}
    if cuda:
        ids = torch.tensor([tokens[0]], device=device)
        with torch.no_grad():
            graph = capture_graph(lambda: model.compute_logits(model(ids, ctx)))
            row["graph_tpot_ms"] = time_ms(graph.replay, 20)
        del graph
    record["runs"].append(row)
    print(f"  {shape} x{cfg.num_layers} all-resident: eager {row['step_ms_median']:.2f} ms, graph "
          f"{row.get('graph_tpot_ms', float('nan')):.3f} ms", flush=True)

    # experts to (pinned) host memory
    host = {}
    for i, moe in moes.items():
        h13 = torch.empty(moe.w13.shape, dtype=moe.w13.dtype, pin_memory=cuda)
        h2 = torch.empty(moe.w2.shape, dtype=moe.w2.dtype, pin_memory=cuda)
        h13.copy_(moe.w13.data)
        h2.copy_(moe.w2.data)
        host[i] = (h13, h2)
        moe.w13 = moe.w2 = None
    free()
    copy_stream = torch.cuda.Stream(device) if cuda else None
    # a pinned -> device copy of one expert, for the link's rate
    if cuda:
        i0 = next(iter(host))
        dst = torch.empty_like(host[i0][0][0], device=device)
        link_ms = time_ms(lambda: dst.copy_(host[i0][0][0], non_blocking=True), 10)
        record["h2d_bytes_per_s"] = host[i0][0][0].numel() * 2 / (link_ms / 1e3)
        del dst

    pregate = ExpertPredictor(model)
    predictors = [("(d) pre-gating prefetch", pregate)]
    for r in (1.0, 0.85):
        p = ReplayedRouting(routing, k, E, r)
        predictors.append((f"(d) {p.kind}", p))
    runs = [("(c) on demand", None, "1")]
    for mode in modes:  # by default "1" first (lookahead 1 with the host sync: the engine's default)
        runs += [(name + (f", {mode_name(mode)}" if mode_name(mode) else ""), p, mode) for name, p in predictors]
    read_stream = torch.cuda.Stream(device) if cuda else None
    for name, predictor, mode in runs:
        lookahead, sync_free = OFFLOAD_MODES[mode]
        if isinstance(predictor, ReplayedRouting):  # the same random replacements in every mode
            predictor.gen.manual_seed(0)
        caches = {}
        for i, moe in moes.items():
            cache = ExpertCache(i, host[i][0], host[i][1], slots, device, copy_stream)
            cache.fill(list(range(slots)))
            moe.hooks.experts = OffloadedExperts(cache)
            caches[i] = cache
        offload = ExpertOffload(caches, predictor, lookahead=lookahead, sync_free=sync_free,
                                read_stream=read_stream if sync_free else None)
        model.hooks.before_layer = offload
        before = (lambda s, p=predictor: setattr(p, "step", s)) if isinstance(predictor, ReplayedRouting) else None
        try:
            times = run_steps(before)
        except Exception as e:
            record["runs"].append({"run": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"  {name}: failed {e}", flush=True)
            for moe in moes.values():
                moe.hooks.experts = None  # (its experts left the device: no executor until the next run's cache)
            model.hooks.before_layer = None
            continue
        diff = max(float((a - b).abs().max()) for a, b in zip(logits_of, resident_logits))
        same_tokens = all(int(a.argmax()) == int(b.argmax()) for a, b in zip(logits_of, resident_logits))
        st = offload.stats()
        n_tok = warmup + steps
        row = {"run": name, "lookahead": lookahead, "sync_free": sync_free,
               "step_ms_median": sorted(times)[len(times) // 2], "step_ms_mean": sum(times) / len(times),
               "greedy_tokens_equal_resident": same_tokens, "logits_max_abs_diff_vs_resident": diff,
               "hit_rate": st["hit_rate"], "prediction_recall": st["prediction_recall"],
               "misses_per_token": st["misses"] / n_tok, "bytes_per_token": st["bytes_per_token"],
               "bytes_prefetch_per_token": st["bytes_prefetch"] / n_tok,
               "bytes_demand_per_token": st["bytes_demand"] / n_tok,
               "prefetch_unused": st["prefetch_unused"], "copies_prefetch": st["copies_prefetch"],
               "evicted_incoming": st["evicted_incoming"],
               **{key: st[key] for key in ("predictions_made", "predictions_acted", "predictions_late",
                                           "predictions_waited")},
               "per_layer_hit_rate": {str(i): s["hit_rate"] for i, s in st["layers"].items()},
               "per_layer_recall": {str(i): (int(c.recall_hits) / int(c.recall_pairs) if int(c.recall_pairs) else None)
                                    for i, c in caches.items()}}
        record["runs"].append(row)
        print(f"  {name}: {row['step_ms_median']:.2f} ms/token, hit rate {row['hit_rate']:.3f}, recall "
              f"{row['prediction_recall']}, {row['bytes_per_token'] / MB:.1f} MB/token, predictions acted "
              f"{st['predictions_acted']} / late {st['predictions_late']} / waited {st['predictions_waited']}",
              flush=True)
        for moe in moes.values():
            moe.hooks.experts = None  # (its experts left the device: no executor until the next run's cache)
        model.hooks.before_layer = None
        del caches, offload
        free()
    base = next((r for r in record["runs"] if r["run"] == "(c) on demand" and "error" not in r), None)
    if base:
        for r in record["runs"]:
            if r["run"].startswith("(d)") and "error" not in r:
                r["speedup_vs_on_demand"] = base["step_ms_median"] / r["step_ms_median"]
    for attn in model.attention_layers:
        attn.hooks.kv_cache = None
    record["seconds"] = round(time.time() - t0, 1)
    free(model, host)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=["mixtral-8x7b", "qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--parts", nargs="*", default=["l2", "offload"], choices=["l2", "offload"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--budgets-mb", type=float, nargs="*", default=[8, 16, 24, 32, 40],
                   help="MB per layer for the L2 prefetch (the middle and last one also for the other variants)")
    p.add_argument("--offload-layers", type=int, nargs="*", default=[4, 8],
                   help="layers of each shape in the offload part (one number per shape, or one for all)")
    p.add_argument("--offload-modes", nargs="*", default=list(OFFLOAD_MODES), choices=list(OFFLOAD_MODES),
                   help="prefetch modes of the offload part: lookahead 1 or 2, with the host sync or sync-free "
                        "('-async'); each with every predictor")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu --parts offload for a smoke run)")
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "command": " ".join(["python"] + sys.argv), "l2": [], "offload": []}
    if device.type == "cuda":
        import triton

        record["triton"] = triton.__version__
        record["hbm_copy_bandwidth_bytes_per_s"] = measure_bandwidth(device)
    started = time.time()

    def save():
        record["seconds"] = round(time.time() - started, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2))

    layers = dict(zip(args.shapes, args.offload_layers if len(args.offload_layers) == len(args.shapes)
                      else args.offload_layers[:1] * len(args.shapes)))
    for shape in args.shapes:
        for part in args.parts:
            print(f"{shape}: {part}", flush=True)
            free()
            try:
                if part == "l2":
                    rec = l2_part(shape, args.context, args.iters, args.budgets_mb, device)
                    for r in rec["rows"]:
                        print(f"  L2 {r['variant']:>12}: {r.get('tpot_ms', float('nan')):.3f} ms "
                              f"({100 * r.get('vs_off', 0):+.2f}%) {r['times_ms']} {r.get('error', '')}", flush=True)
                else:
                    rec = offload_part(shape, layers[shape], args.context, args.steps, args.warmup, device,
                                       tuple(args.offload_modes))
            except Exception as e:
                import traceback

                traceback.print_exc()
                rec = {"shape": shape, "error": f"{type(e).__name__}: {str(e)[:500]}"}
                free()
            record[part].append(rec)
            free()
            save()
    print(f"done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
