#!/usr/bin/env python3
"""What the parallel code path costs on one device: decode TPOT of the Mixtral-8x7B shape (random
bf16 weights) through the single-device path and through the tensor/expert-parallel path at
world size 1, in the same run and on the same weights.

The model is built once and cut by the engine's own code (`engine/parallel.py` ParallelGroup at
world size 1: the gloo command group and the compute group, NCCL on CUDA; `shard_model`), which at
world size 1 keeps every weight. Three variants then run the same decode step, switched by the
layers' `tp` / `ep` attributes only (the weights are the same tensors):

- `single`: tp = ep = None, the path every tensor_parallel_size=1 engine takes;
- `tp`: attention, dense MLPs and experts with their all-reduce on the compute group (the path of
  tensor_parallel_size > 1 without expert parallelism);
- `tp+ep`: as `tp`, the experts through ExpertParallel with token dispatch (placement: every
  expert on rank 0), the path of enable_expert_parallel;
- `tp+ep-static`: as `tp+ep` with the shape-static dispatch (StaticDispatch active: all_to_all_single
  of fixed [world, T, H] buffers), the path a captured decode step of an N > 1 engine takes.

Each variant is timed eagerly and captured in a CUDA graph (its NCCL all-reduces inside the graph),
interleaved over `--rounds` rounds (the median of the rounds' medians is reported). Each row also
says how far its logits are from `single`'s (0 expected at world size 1) and what the per-step
command round of a parallel engine costs on the host (rank 0 broadcasting the step's inputs,
every rank reporting its status: `protocol_ms`), which an N > 1 engine pays on top of the step.

    PYTHONPATH=. python benchmarks/e2e/bench_parallel_cost.py --out benchmarks/results/h200/parallel_cost.json
    PYTHONPATH=. python benchmarks/e2e/bench_parallel_cost.py --smoke   # the CPU rehearsal (gloo, tiny shape)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import SHAPES, capture_graph, install_filled_caches, kv_bytes_per_token, time_ms  # noqa: E402

from moekv.engine.parallel import ParallelGroup, StepInputs, shard_model  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.layers.moe import SparseMoE  # noqa: E402
from moekv.layers.parallel import StaticDispatch, shard_moe  # noqa: E402
from moekv.models import mixtral  # noqa: E402
from moekv.models.loader import empty_model, init_dummy_weights, install_routers  # noqa: E402
from moekv.models.model_config import apply_routing_fields  # noqa: E402

SMOKE_SHAPE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                   max_position_embeddings=4096, rms_norm_eps=1e-5)
POINTS = [(1, 4096), (32, 32768)]
SMOKE_POINTS = [(1, 64), (4, 256)]
VARIANTS = ("single", "tp", "tp+ep", "tp+ep-static")
ACTIVATION_RESERVE = 6 << 30


def build(shape: dict, layers: int | None, device: torch.device):
    hf = {"architectures": ["MixtralForCausalLM"], "torch_dtype": "bfloat16", **shape}
    if layers:
        hf["num_hidden_layers"] = layers
    cfg = apply_routing_fields(mixtral.config_from_hf(hf), hf)
    model = init_dummy_weights(empty_model(cfg, torch.bfloat16, device))
    install_routers(model, cfg, routing="flat")
    return model, cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Variants:
    """The layers' parallel attributes for each variant, set by `use(name)`."""

    def __init__(self, model, cfg, group: ParallelGroup) -> None:
        self.model, self.tp = model, group.tp
        shard_model(model, cfg, group.tp, None)  # world size 1: every head, every expert's whole width
        self.ep, self.local = {}, {}  # each MoE layer's two expert executors
        device = next(model.parameters()).device
        self.static = StaticDispatch(device)  # its rows: set to the batch by run_point
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mlp, SparseMoE):  # every expert on rank 0, tokens dispatched
                self.local[i] = layer.hooks.experts
                shard_moe(layer.mlp, group.tp, torch.zeros(cfg.num_experts, dtype=torch.long), dispatch=True)
                self.ep[i] = layer.hooks.experts.to(device)
                self.ep[i].static = self.static
                layer.hooks.experts = self.local[i]

    def use(self, name: str) -> None:
        tp = None if name == "single" else self.tp
        self.static.active = name == "tp+ep-static"
        for i, layer in enumerate(self.model.layers):
            layer.hooks.tp = tp
            if i in self.ep:
                layer.hooks.experts = self.ep[i] if name.startswith("tp+ep") else self.local[i]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def step_inputs(batch: int, context: int, block_size: int) -> StepInputs:
    """The decode step's inputs as a parallel engine broadcasts them (host lists)."""
    pages = context // block_size + 1
    return StepInputs(
        input_ids=[1] * batch, positions=[context] * batch,
        slots=[b * pages * block_size + (pages - 1) * block_size + context % block_size for b in range(batch)],
        block_tables=[list(range(b * pages, (b + 1) * pages)) for b in range(batch)],
        context_lens=[context + 1] * batch, query_start=list(range(batch + 1)), logits_rows=list(range(batch)),
        seq_slots=list(range(batch)), max_query_len=1, fills_no_page=True, fill_slots=[], fill_pages=[],
        split_mixed=False)


def run_point(model, cfg, variants: Variants, group: ParallelGroup, fmt_name: str, batch: int, context: int,
              device, free_bytes: int, iters: int, rounds: int) -> dict:
    fmt = get_kv_format(fmt_name, torch.bfloat16)
    block_size = 16 if fmt_name in ("bf16", "auto") else 64
    row = {"kv_cache_dtype": fmt_name, "batch": batch, "context": context, "block_size": block_size}
    need = batch * (context // block_size + 1) * block_size * kv_bytes_per_token(fmt, cfg, block_size)
    if need > free_bytes:
        row["skipped"] = (f"KV of {need / 2**30:.1f} GiB does not fit beside the weights "
                          f"({free_bytes / 2**30:.1f} GiB free)")
        return row
    ctx = install_filled_caches(model, cfg, fmt, batch, context, block_size, device)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=torch.Generator(device).manual_seed(0))
    variants.static.count_rows(batch)  # every row real (tp+ep-static)
    use_graphs = device.type == "cuda"
    logits, graphs, eager, replay = {}, {}, {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}

    def step():
        return model.compute_logits(model(ids, ctx))

    with torch.inference_mode():
        for v in VARIANTS:
            variants.use(v)
            # the same step on the same cache each time (the written slot is overwritten with the same K/V)
            logits[v] = step().float().cpu()
            if use_graphs:
                try:
                    graphs[v] = capture_graph(step)
                except Exception as e:  # a host sync or an uncapturable collective: eager only, with the reason
                    row[f"graph_error_{v}"] = f"{type(e).__name__}: {str(e)[:300]}"
                    torch.cuda.synchronize()
        for _ in range(rounds):  # interleaved, so drift (clocks, heat) spreads over all variants
            for v in VARIANTS:
                variants.use(v)
                eager[v].append(time_ms(step, max(3, iters // 4)))
                if v in graphs:
                    replay[v].append(time_ms(graphs[v].replay, iters))
    inputs = step_inputs(batch, context, block_size)

    def protocol():
        with group.lock:
            group.send("step", inputs)
            group.finish_step(None)

    row["protocol_ms"] = time_ms(protocol, max(5, iters))
    for v in VARIANTS:
        r = {"tpot_eager_ms": median(eager[v]), "eager_rounds_ms": eager[v],
             "max_abs_logit_diff_vs_single": float((logits[v] - logits["single"]).abs().max())}
        if replay[v]:
            r.update(tpot_graph_ms=median(replay[v]), graph_rounds_ms=replay[v])
        row[v] = r
    for v in VARIANTS[1:]:
        for key in ("tpot_eager_ms", "tpot_graph_ms"):
            if key in row[v] and key in row["single"]:
                row[v][key.replace("tpot_", "ratio_vs_single_").replace("_ms", "")] = row[v][key] / row["single"][key]
    variants.use("single")
    graphs.clear()
    for attn in model.attention_layers:
        attn.hooks.kv_cache = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: tiny shape, gloo, eager only")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's 32)")
    p.add_argument("--formats", nargs="*", default=None, help="KV formats (default: bf16 int4; a point whose KV "
                   "does not fit beside the weights is skipped with its reason)")
    p.add_argument("--points", nargs="*", default=None, help="batch:context pairs (default: 1:4096 32:32768)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=130.0,
                   help="points not started this many seconds after the start are skipped (so the run ends in time)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    started = time.time()
    if args.smoke:
        device, shape = torch.device("cpu"), SMOKE_SHAPE
        points = SMOKE_POINTS
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_parallel_cost needs a CUDA device (or --smoke for the CPU rehearsal)")
        device, shape, points = torch.device("cuda"), SHAPES["mixtral-8x7b"], POINTS
    if args.points:
        points = [tuple(int(x) for x in s.split(":")) for s in args.points]
    formats = args.formats or ["bf16", "int4"]
    group = ParallelGroup(0, 1, f"tcp://127.0.0.1:{free_port()}", device, timeout=300)
    model, cfg = build(shape, args.layers, device)
    variants = Variants(model, cfg, group)
    if device.type == "cuda":  # the sharding's copies left the replaced weights' blocks cached
        torch.cuda.empty_cache()
    free_bytes = (torch.cuda.mem_get_info(device)[0] - ACTIVATION_RESERVE) if device.type == "cuda" else 1 << 34
    print(f"{cfg.num_layers} layers on {device}; compute group {group.backend}; "
          f"{free_bytes / 2**30:.1f} GiB for the KV cache ({time.time() - started:.0f} s)", flush=True)
    rows = []
    for fmt_name in formats:
        for batch, context in points:
            if time.time() - started > args.deadline_s:
                rows.append({"kv_cache_dtype": fmt_name, "batch": batch, "context": context,
                             "skipped": f"not started: past --deadline-s {args.deadline_s:.0f}"})
                print(f"{fmt_name:>6} B={batch:<3} ctx={context:<6} skipped: past the deadline", flush=True)
                continue
            try:
                row = run_point(model, cfg, variants, group, fmt_name, batch, context, device, free_bytes,
                                args.iters, args.rounds)
            except Exception as e:  # one failing point must not lose the others
                row = {"kv_cache_dtype": fmt_name, "batch": batch, "context": context,
                       "skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"}
                variants.use("single")
                for attn in model.attention_layers:
                    attn.hooks.kv_cache = None
            rows.append(row)
            head = f"{fmt_name:>6} B={batch:<3} ctx={context:<6}"
            if "skipped" in row:
                print(f"{head} skipped: {row['skipped']}", flush=True)
                continue
            for v in VARIANTS:
                r = row[v]
                graph = f"graph {r['tpot_graph_ms']:8.3f} ms" if "tpot_graph_ms" in r else (
                    "graph -" + (f" [{row.get('graph_error_' + v)}]" if row.get("graph_error_" + v) else ""))
                print(f"{head} {v:>12}: eager {r['tpot_eager_ms']:8.3f} ms  {graph}  "
                      f"max|dlogit| {r['max_abs_logit_diff_vs_single']:.3g}", flush=True)
            print(f"{head} command round (broadcast + status) {row['protocol_ms']:.3f} ms", flush=True)
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "command": " ".join(["python"] + sys.argv), "shape": "smoke" if args.smoke else "mixtral-8x7b",
        "layers": cfg.num_layers, "compute_backend": group.backend, "iters": args.iters, "rounds": args.rounds,
        "seconds": round(time.time() - started, 1), "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")
    print(f"done in {record['seconds']} s", flush=True)
    sys.stdout.flush()
    # no destroy_process_group: after NCCL work was captured in a graph it can hang (pytorch#115388)
    os._exit(0)


if __name__ == "__main__":
    main()
