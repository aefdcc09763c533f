#!/usr/bin/env python3
"""Decode time per output token of DeepSeek-shaped models (random bf16 weights) beside its floor.

`deepseek-v2-lite`: the whole model (27 layers, 64 experts top-6, 2 shared, MLA with kv_lora_rank
512, no q_lora). `deepseek-v3-stack`: DeepSeek-V3's layer shapes (128 heads, q_lora 1536, 256
experts top-8 in 8 groups, 1 shared) in a stack of a dense layer and two MoE layers, the most one
80 GB card holds; its time over its floor, times the whole V3's floor, projects the whole model.

Each latent pool is filled as if `context` tokens were cached; one decode step (embedding -> layers
-> logits, the latent write included) is captured in a CUDA graph and replayed. Floor: the bytes the
step must read (attention and dense weights, the distinct experts of the batch, router, shared
experts, LM head, every sequence's latent entries) over the copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/e2e/bench_mla_decode.py --out mla_e2e.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # profile_decode_step, for --profile

from bench_decode import capture_graph, decode_context, measure_bandwidth, time_ms  # noqa: E402

from moekv.kvcache.formats.latent_choice import latent_format_for  # noqa: E402
from moekv.models import deepseek  # noqa: E402
from moekv.models.loader import empty_model, init_dummy_weights, install_routers  # noqa: E402
from moekv.models.model_config import apply_routing_fields  # noqa: E402

V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
               num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
               num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
               max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0)
V3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
          num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
          num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
          routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
          rope_theta=10000.0)
SHAPES = {"deepseek-v2-lite": (V2_LITE, None), "deepseek-v3-stack": (V3, dict(num_hidden_layers=3,
                                                                              first_k_dense_replace=1))}
BLOCK_SIZE = 64


def config(hf: dict):
    hf = dict(hf)
    return apply_routing_fields(deepseek.config_from_hf(hf), hf)


def bytes_read(cfg, batch: int, context: int, latent_bytes_per_token: int) -> int:
    """One decode step's reads (bf16 weights): every layer's attention and norms, dense MLPs, and per MoE
    layer the router, shared experts and the E * (1 - (1 - k/E)^B) distinct experts random tokens
    touch; the LM head; every sequence's latent entries in every layer."""
    m, H = cfg.mla, cfg.hidden_size
    q = H * cfg.num_heads * m.qk_head_dim if m.q_lora_rank is None else \
        H * m.q_lora_rank + m.q_lora_rank * cfg.num_heads * m.qk_head_dim
    attn = q + H * m.latent_width + m.kv_lora_rank * cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim) \
        + cfg.num_heads * m.v_head_dim * H + 2 * H
    expert = 3 * H * cfg.moe_intermediate_size
    distinct = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** batch)
    total = cfg.vocab_size * H + batch * H  # LM head, embedding rows
    for is_moe in cfg.moe_layers:
        total += attn
        total += (cfg.num_experts * H + 3 * H * cfg.shared_expert_intermediate_size + distinct * expert) if is_moe \
            else 3 * H * cfg.dense_intermediate_size
    return 2 * int(total) + batch * (context + 1) * cfg.num_layers * latent_bytes_per_token


def fill_latent_pools(model, cfg, fmt, batch: int, context: int, device) -> None:
    """Every attention layer gets a pool holding `context` random entries per sequence (and room for the next)."""
    pages = batch * (context // BLOCK_SIZE + 1)
    for attn in model.attention_layers:
        attn.hooks.kv_format = fmt
        attn.hooks.kv_cache = fmt.allocate(pages, 1, BLOCK_SIZE, cfg.head_dim, device, batch, torch.bfloat16)
        for t in attn.hooks.kv_cache.tensors.values():
            if t.dtype == torch.float8_e4m3fn:
                t.copy_(torch.randn(t.shape, device=device).clamp(-448, 448).to(t.dtype))
            elif t.dtype == torch.uint8:  # int4 codes
                t.random_(0, 256)
            else:
                t.normal_(0, 0.01 if t.dim() == 2 else 1.0)  # per-token scales small, entries unit


def run(shape: str, kvs: list[str], points: list[tuple[int, int]], bandwidth: float, iters: int,
        device: torch.device, use_graph: bool = True, profile: bool = False) -> list[dict]:
    hf, stack = SHAPES[shape]
    cfg = config({**hf, **(stack or {})})
    model = init_dummy_weights(empty_model(cfg, torch.bfloat16, device))
    install_routers(model, cfg)
    rows = []
    for kv in kvs:
        fmt = latent_format_for(kv, torch.bfloat16, cfg.mla.kv_lora_rank)
        per_token = fmt.page_bytes(1, BLOCK_SIZE, cfg.head_dim) // BLOCK_SIZE
        for batch, context in points:
            fill_latent_pools(model, cfg, fmt, batch, context, device)
            ctx = decode_context(batch, context, BLOCK_SIZE, device)
            ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)

            def step():
                return model.compute_logits(model(ids, ctx))

            with torch.no_grad():
                eager = time_ms(step, 5)
                graph = capture_graph(step) if use_graph else None
                ms = time_ms(graph.replay, iters) if use_graph else eager
                if profile:
                    from profile_decode_step import print_kernel_table
                    print_kernel_table(graph.replay if use_graph else step,
                                       f"{shape} {kv}, batch {batch}, context {context}")
            floor_ms = 1e3 * bytes_read(cfg, batch, context, per_token) / bandwidth
            row = {"shape": shape, "layers": cfg.num_layers, "kv_cache_dtype": kv, "batch": batch,
                   "context": context, "tpot_ms": round(ms, 3), "tpot_eager_ms": round(eager, 3),
                   "floor_ms": round(floor_ms, 3), "tpot_over_floor": round(ms / floor_ms, 3)}
            if stack:  # the whole model: its floor, times this stack's time over its floor
                whole_floor = 1e3 * bytes_read(config(hf), batch, context, per_token) / bandwidth
                row.update(whole_model_floor_ms=round(whole_floor, 2),
                           whole_model_projected_ms=round(whole_floor * ms / floor_ms, 2))
            print(json.dumps(row), flush=True)
            rows.append(row)
            for attn in model.attention_layers:
                attn.hooks.kv_cache = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3", "int4"])
    p.add_argument("--points", nargs="+", default=["1:4096", "64:4096"], help="batch:context pairs")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", action="store_true",
                   help="also print each point's kernels under torch.profiler "
                   "(benchmarks/tools/profile_decode_step.py)")
    args = p.parse_args()
    points = [tuple(int(x) for x in pt.split(":")) for pt in args.points]
    bandwidth = measure_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes:
        rows += run(shape, args.kv, points, bandwidth, args.iters, torch.device("cuda"), profile=args.profile)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
            "command": " ".join(sys.argv), "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows,
            "moekv_tree": str(Path(sys.modules["moekv"].__file__).resolve().parents[1])}, indent=1))  # which ran


if __name__ == "__main__":
    main()
