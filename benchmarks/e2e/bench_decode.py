#!/usr/bin/env python3
"""End-to-end decode time per output token (TPOT) of a Mixtral-8x7B-shaped model on one GPU (or of
another shape of SHAPES: GLM-4.5-Air's, cut to its first 10 layers to fit one GPU; gpt-oss-20b's, with
sinks, sliding windows, YaRN and biased experts).

The model is built with random bf16 weights (no checkpoint: `--random-weights --shape
mixtral-8x7b`), its KV pools are filled with valid pages of each format as if `context` tokens
were already cached, and one decode step (embedding -> 32 layers -> logits, the KV write
included) is timed, captured in a CUDA graph (`graph`) and run eagerly (`eager`). Each figure sits
beside its floor: the bytes the step must read (every attention weight, the distinct experts the
batch routes to, the LM head, the KV pages of every sequence) over the HBM bandwidth measured in
the same run. `transformers` runs the same shape at batch 1 as the naive baseline.

    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --shape mixtral-8x7b \\
        --out benchmarks/results/h200/decode.json
    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --formats nuq2 --decode-kernel gluon ...
        # nuq2 through the Gluon decode kernel (pools in fragment order)
    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --shape glm-4.5-air-10l \
        --points 1:4096 32:32768 --no-transformers --out FILE   # Glm4Moe: partial RoPE, shared expert
    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --shape gpt-oss-20b --no-transformers ...
        # gpt-oss-20b's shape in bf16 (its MXFP4 experts dequantized: 42 GB of weights)
    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --weights bf16 fp8 int4 --formats bf16 ...
        # quantized weights (fp8, int4) beside bf16, each with its own floor
    PYTHONPATH=. python benchmarks/e2e/bench_decode.py --random-weights --weights int4 --f16-dots both ...
        # int4's GEMVs with fp32 and packed-half dots (quant_tiles.F16_DOTS_DEFAULT off, then on), one model
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

from moekv.context import Context  # noqa: E402
from moekv.engine.cuda_graphs import capture_after_warmup  # noqa: E402
from moekv.kvcache.formats import DECODE_KERNELS, compressed_formats, get_kv_format  # noqa: E402
from moekv.kvcache.formats.fragment import FragmentPagedFormat, decode_kernel_for_model  # noqa: E402
from moekv.models.loader import ARCH_MODULES, DUMMY_STD, empty_model, init_dummy_weights, install_routers  # noqa: E402
from moekv.models.model_config import apply_routing_fields  # noqa: E402
from moekv.models.quantize import install_empty_quantized, matrix_bytes  # noqa: E402
from moekv.ops import quant_tiles  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight  # noqa: E402

SHAPES = {
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=262144, rms_norm_eps=1e-5),
    # Mixtral-8x22B (mistralai/Mixtral-8x22B-v0.1's config.json): 141 B parameters, 282 GB in bf16; with int4
    # weights (~75 GB) it fits one H200 beside a 2-bit cache for 128 sequences of 4k (issue 47's load)
    "mixtral-8x22b": dict(vocab_size=32768, hidden_size=6144, num_hidden_layers=56, num_attention_heads=48,
                          num_key_value_heads=8, head_dim=128, intermediate_size=16384, num_local_experts=8,
                          num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=65536, rms_norm_eps=1e-5),
    # GLM-4.5-Air (Glm4MoeForCausalLM) with its first 10 of 46 layers (one dense, nine with 128 experts top-8 and
    # a shared expert; about 45 GiB in bf16), so that it fits one GPU beside a KV cache: partial RoPE (64 of 128),
    # q/k/v biases, sigmoid routing with the selection bias. A step's time scales with the layers it runs.
    "glm-4.5-air-10l": dict(architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
                            num_hidden_layers=10, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                            intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
                            num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
                            use_qk_norm=False, num_nextn_predict_layers=0, max_position_embeddings=131072,
                            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                "partial_rotary_factor": 0.5}),
    # a quick check of the whole path (seconds, any GPU)
    # gpt-oss-20b (openai/gpt-oss-20b's config.json): sliding windows of 128 on every other layer, sinks
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096},
                        swiglu_limit=7.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "small": dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, intermediate_size=2048, num_local_experts=8,
                  num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=262144, rms_norm_eps=1e-5),
}
POINTS = [(1, 4096), (16, 4096), (64, 4096), (32, 32768)]
FORMATS = ["bf16", *compressed_formats()]  # every registered format; vq on a random calibration
ACTIVATION_RESERVE = 6 << 30  # bytes kept free for activations, graphs and the allocator


def hf_config(shape: str) -> dict:
    return {"architectures": ["MixtralForCausalLM"], "torch_dtype": "bfloat16", **SHAPES[shape]}


def model_config(shape: str, num_layers: int | None = None):
    """The ModelConfig of a shape, read by its architecture's module as the loader reads a config.json."""
    hf = hf_config(shape)
    if num_layers is not None:
        hf["num_hidden_layers"] = num_layers
    return apply_routing_fields(ARCH_MODULES[hf["architectures"][0]].config_from_hf(hf), hf)


def is_mixtral(shape: str) -> bool:
    return hf_config(shape)["architectures"] == ["MixtralForCausalLM"]


def build_random_model(shape: str, device: torch.device, weights: str = "bf16", num_layers: int | None = None):
    """MoEDecoder of the shape with the loader's dummy weights (N(0, 0.02), norms at 1), built on the GPU
    directly, routing as its checkpoint would (Mixtral: softmax top-k; GLM: sigmoid with the selection bias);
    weights 'fp8' / 'int4': the experts, attention projections and LM head built quantized (random codes in
    quantize-on-load's layout; never a 16-bit copy)."""
    cfg = model_config(shape, num_layers)
    cut = None if weights == "bf16" else (lambda m: install_empty_quantized(m, weights, torch.bfloat16))
    model = init_dummy_weights(empty_model(cfg, torch.bfloat16, device, cut))
    fill_random_quantized(model)
    install_routers(model, cfg, routing="auto")
    return model, cfg


@torch.no_grad()
def fill_random_quantized(model, seed: int = 0) -> None:
    """Random codes for every QuantizedWeight, scaled so the weights are about N(0, 0.02)."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for m in model.modules():
        if not isinstance(m, QuantizedWeight):
            continue
        if m.method == "fp8":
            for chunk in m.codes.view(-1, m.codes.shape[-1]).split(2048):
                chunk.copy_(torch.randn(chunk.shape, generator=gen, device=chunk.device) * 64)
            m.scales.fill_(DUMMY_STD / 64)
        else:
            m.codes.random_(generator=gen)
            m.scales.fill_(DUMMY_STD / 4)
            m.zeros.fill_(8)


def weight_bytes_per_step(cfg, batch: int, weights: str = "bf16") -> tuple[int, float]:
    """(bytes of all weights, bytes one decode step reads): attention (with its biases and q/k norms),
    norms, dense MLP layers, routers, shared experts and the LM head for every step, routed experts
    only for the expected distinct experts a batch of random tokens touches per layer,
    E * (1 - (1 - k/E)^B); the experts, attention projections and LM head as `weights` stores them
    (codes, scales, zero points), everything else two bytes an element."""
    H, E, k, I = cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    method = None if weights == "bf16" else weights
    attn = matrix_bytes(cfg.q_size + 2 * cfg.kv_size, H, method) + matrix_bytes(H, cfg.q_size, method)
    small = (cfg.q_size + 2 * cfg.kv_size if cfg.qkv_bias else 0) + (H if cfg.o_bias else 0)
    small += 2 * cfg.head_dim if cfg.qk_norm == "per_head" else (cfg.q_size + cfg.kv_size if cfg.qk_norm else 0)
    small += cfg.num_heads * cfg.attention_sinks  # gpt-oss: a sink logit per head
    attn += 2 * (small + 2 * H)  # with the two norms
    expert = matrix_bytes(2 * I, H, method) + matrix_bytes(H, I, method)
    expert += 2 * (2 * I + H) * (cfg.clamped_swiglu is not None)  # gpt-oss: expert biases
    shared = 3 * H * cfg.shared_expert_intermediate_size
    shared += H if cfg.shared_expert_intermediate_size and cfg.shared_expert_gated else 0
    router = E * H + (E if cfg.router_bias else 0) + E * cfg.router_logit_bias
    distinct = E * (1 - (1 - k / E) ** batch)
    total = read = 0.0
    for is_moe in cfg.moe_layers:
        common = attn + 2 * (router + shared if is_moe else 3 * H * cfg.dense_intermediate_size)
        total += common + (E * expert if is_moe else 0)
        read += common + (distinct * expert if is_moe else 0)
    head = matrix_bytes(cfg.vocab_size, H, method)
    total += head + 2 * (cfg.vocab_size * H + H)
    read += head + 2 * H + 2 * batch * H
    return int(total), read


def kv_tokens_read(cfg, context: int) -> float:
    """Cached tokens a decode step's attention must read per layer, averaged over the layers: the
    whole context (and the new token), or a sliding window's last `window` tokens."""
    return sum(min(context + 1, w or context + 1) for w in cfg.layer_windows) / cfg.num_layers


def kv_bytes_per_token(fmt, cfg, block_size: int) -> float:
    return cfg.num_layers * fmt.page_bytes(cfg.num_kv_heads, block_size, cfg.head_dim) / block_size


def kv_read_bytes_per_token(fmt, cfg, block_size: int, cache) -> float:
    """KV bytes attention reads per cached token (all layers): the page bytes, but a tiered page is
    read from one tier only (its FP8 or its nuq2 slabs, as the filled tier map says)."""
    if fmt.name != "tiered":
        return kv_bytes_per_token(fmt, cfg, block_size)
    from moekv.kvcache.formats.tiered import TIER_FP8, TIER_LOW

    n_fp8, n_low = cache.state.tier.count(TIER_FP8), cache.state.tier.count(TIER_LOW)
    hi, lo = (sum(fmt._slabs(kind, block_size, cfg.head_dim)[i] for kind in ("key", "value")) for i in (0, 1))
    per_page = cfg.num_kv_heads * (n_fp8 * hi + n_low * lo) / max(1, n_fp8 + n_low)
    return cfg.num_layers * per_page / block_size


def fill_tiered(fmt, cache, cfg, block_size: int, batch: int, pages_per_seq: int, device) -> None:
    """Both tiers' pools hold one random page, and the tier map is what re-ranking leaves: per
    sequence, its first and newest full pages and every round(1 / tier1_fraction)-th one in FP8, the
    other full pages in nuq2 (the partly filled newest page is staged)."""
    from moekv.kvcache.formats.tiered import TIER_FP8, TIER_LOW

    gen = torch.Generator(device).manual_seed(1)
    H, D = cfg.num_kv_heads, cfg.head_dim
    for name, kind in (("k", "key"), ("v", "value")):
        x = torch.randn(1, H, block_size, D, generator=gen, device=device)
        for tier_fmt, pool in ((fmt.hi, "fp8"), (fmt.lo, "low")):
            slab = tier_fmt.layout(kind, block_size, D).pack(tier_fmt.quantize(x, kind, cache.layer))
            for field, t in fmt.tier_tables(cache, pool, kind, slab).items():
                cache[field].copy_(t.expand_as(cache[field]))
    st = cache.state
    stride = max(1, round(1 / fmt.tier1_fraction)) if fmt.tier1_fraction > 0 else pages_per_seq
    full = pages_per_seq - 1  # pages of sequence b: b * pages_per_seq + [0, pages_per_seq), the last staged
    stored = []
    for b in range(batch):
        for i in range(full):
            page = b * pages_per_seq + i
            if (i % stride == 0 or i == full - 1) and st.free_fp8:
                st.tier[page], st.fp8_slot[page] = TIER_FP8, st.free_fp8.pop()
            else:
                st.tier[page] = TIER_LOW
            stored.append(page)
    fmt._sync_pages(cache, stored)


def fill_pages(fmt, cache, cfg, block_size: int, device) -> None:
    """Every page of the pool holds the same valid page: one random page quantized by the format."""
    gen = torch.Generator(device).manual_seed(1)
    H, D = cfg.num_kv_heads, cfg.head_dim
    if "k_pages" in cache.tensors and cache["k_pages"].dtype != torch.uint8:  # plain 16-bit pages
        cache["k_pages"].normal_(generator=gen)
        cache["v_pages"].normal_(generator=gen)
        return
    for name, kind in (("k", "key"), ("v", "value")):
        x = torch.randn(1, H, block_size, D, generator=gen, device=device)
        slab = fmt.layout(kind, block_size, D).pack(fmt.quantize(x, kind, cache.layer))  # [1, H, bytes]
        if isinstance(fmt, FragmentPagedFormat) and fmt.is_fragment_pool(cache):  # a Gluon kernel's fragment order
            for field, t in fmt.to_fragment(cache, kind, slab).items():
                cache[field].copy_(t.expand_as(cache[field]))
        else:
            cache[f"{name}_pages"].copy_(slab.expand_as(cache[f"{name}_pages"]))


def decode_context(batch: int, context: int, block_size: int, device) -> Context:
    """One decode step per sequence: `context` tokens cached, the new one at position `context`
    (offset 0 of a fresh page when context % block_size == 0, so no page completes)."""
    pages = context // block_size + 1
    tables = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    return Context(
        positions=positions,
        slot_mapping=tables[:, -1].long() * block_size + context % block_size,
        block_tables=tables,
        context_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        logits_indices=torch.arange(batch, device=device),
        seq_slots=torch.arange(batch, device=device),
        max_query_len=1,
        fills_no_page=(context + 1) % block_size != 0,
        graph_step=True,  # the engine's replayed step: tiered's host-side step count is not in it
    )


def page_size(fmt_name: str) -> int:
    return 16 if fmt_name == "bf16" else 64


def install_caches(model, cfg, fmt, batch: int, context: int, block_size: int, device) -> None:
    """Give every attention layer an empty pool of `fmt` pages with room for `context` tokens per sequence
    and the next."""
    pages = batch * (context // block_size + 1)
    for attn in model.attention_layers:
        attn.hooks.kv_format = fmt
        attn.hooks.kv_cache = fmt.allocate(pages, cfg.num_kv_heads, block_size, cfg.head_dim, device, batch,
                                           torch.bfloat16)
        attn.kv_cache.layer = attn.layer_idx


def install_filled_caches(model, cfg, fmt, batch: int, context: int, block_size: int, device) -> Context:
    """install_caches, the pools filled as if they held `context` tokens per sequence; returns the decode
    Context of the step that follows."""
    install_caches(model, cfg, fmt, batch, context, block_size, device)
    for attn in model.attention_layers:
        if fmt.name == "tiered":
            fill_tiered(fmt, attn.kv_cache, cfg, block_size, batch, context // block_size + 1, device)
        else:
            fill_pages(fmt, attn.kv_cache, cfg, block_size, device)
    return decode_context(batch, context, block_size, device)


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """`step` captured in a CUDA graph, after one warm-up on a side stream (Triton compiles, the
    allocator settles)."""
    return capture_after_warmup(step, warmups=1)[0]


def time_ms(fn, iters: int) -> float:
    """Median of `iters` timings after two warm-up calls: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def measure_bandwidth(device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    src = dst = None  # free the buffers (rebound, not del: the timed lambda closes over them)
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / (ms / 1e3)


def vq_calibration(cfg) -> str:
    """A random vq calibration for the model's shape (codebooks fitted on Gaussian pages, the same for
    every layer: moekv.kvcache.formats.vq.random_calibration; the speed does not depend on them)."""
    import tempfile

    from moekv.kvcache.formats.vq import random_calibration

    return str(random_calibration(tempfile.mkdtemp(prefix="vqcal"), cfg.num_kv_heads, cfg.head_dim,
                                  num_layers=cfg.num_layers))


def run_point(model, cfg, fmt_name: str, batch: int, context: int, device, bandwidth: float,
              free_bytes: int, iters: int, block_size: int | None = None, options: dict | None = None,
              decode_kernel: str = "auto", weights: str = "bf16") -> dict:
    decode_kernel = decode_kernel_for_model(decode_kernel, cfg.num_heads, cfg.num_kv_heads)  # as the engine does
    fmt = get_kv_format(fmt_name, torch.bfloat16, decode_kernel=decode_kernel, **(options or {}))
    block_size = block_size or page_size(fmt_name)
    row = {"weights": weights, "kv_cache_dtype": fmt_name, "batch": batch, "context": context,
           "block_size": block_size, "decode_kernel": decode_kernel}
    per_token = kv_bytes_per_token(fmt, cfg, block_size)
    row["kv_bytes_per_token"] = per_token
    row["max_tokens_in_memory"] = int(free_bytes // per_token)
    pages = batch * (context // block_size + 1)
    need = pages * block_size * per_token
    if need > free_bytes:
        row["skipped"] = (f"KV of {need / 2**30:.1f} GiB does not fit beside the weights "
                          f"({free_bytes / 2**30:.1f} GiB free)")
        return row
    if any(cfg.layer_windows) and fmt.sliding_window_unsupported():
        row["skipped"] = f"{fmt_name} {fmt.sliding_window_unsupported()} (the engine refuses it for this model)"
        return row
    if not fmt.graph_support.replays_decode:
        row["skipped"] = ("not graph-safe: the engine runs this format's decode steps eagerly; a graph-captured "
                          "step would not be the engine's")
        return row
    reason = fmt.fused_decode_unavailable(block_size, cfg.head_dim)
    if reason is not None:
        row["skipped"] = f"{fmt_name} {reason}; a reference path is not a benchmark"
        return row
    ctx = install_filled_caches(model, cfg, fmt, batch, context, block_size, device)
    per_token_read = kv_read_bytes_per_token(fmt, cfg, block_size, model.attention_layers[0].kv_cache)
    row["kv_read_bytes_per_token"] = per_token_read
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)

    def step():
        return model.compute_logits(model(ids, ctx))

    with torch.no_grad():
        row["tpot_eager_ms"] = time_ms(step, max(3, iters // 4))
        try:
            graph = capture_graph(step)
            row["tpot_ms"] = time_ms(graph.replay, iters)
            row["graph"] = True
            del graph
        except Exception as e:  # a host sync in the step: report eager only, with the reason
            row["graph"] = False
            row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["tpot_ms"] = row["tpot_eager_ms"]
    _, weights_read = weight_bytes_per_step(cfg, batch, weights)
    kv_read = batch * kv_tokens_read(cfg, context) * per_token_read
    row.update(weights_read_bytes=weights_read, kv_read_bytes=kv_read,
               floor_ms=1e3 * (weights_read + kv_read) / bandwidth)
    row["tpot_over_floor"] = row["tpot_ms"] / row["floor_ms"]
    for attn in model.attention_layers:
        attn.hooks.kv_cache = None
    torch.cuda.empty_cache()
    return row


def transformers_baseline(shape: str, context: int, device, bandwidth: float, iters: int) -> dict:
    """The same shape through transformers' own class of its architecture (random weights, its own
    cache): prefill `context` tokens, then time single-token forwards."""
    row = {"impl": "transformers", "kv_cache_dtype": "bf16", "batch": 1, "context": context}
    try:
        import transformers

        row["transformers"] = transformers.__version__
        arch = hf_config(shape)["architectures"][0]
        hf = {k: v for k, v in hf_config(shape).items() if k not in ("architectures", "torch_dtype")}
        model_class = getattr(transformers, arch)
        config = model_class.config_class(**hf)
        with torch.device(device):
            model = model_class._from_config(config, torch_dtype=torch.bfloat16).eval()
        ids = torch.randint(0, config.vocab_size, (1, context), device=device)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past = out.past_key_values
            nxt = torch.randint(0, config.vocab_size, (1, 1), device=device)
            position = torch.tensor([[context]], device=device)

            def step():
                # the cache grows by one token per call; a few dozen tokens do not move the time
                model(nxt, past_key_values=past, position_ids=position, use_cache=True)

            row["tpot_ms"] = time_ms(step, iters)
        cfg = model_config(shape)
        _, weights_read = weight_bytes_per_step(cfg, 1)
        kv_read = context * cfg.num_layers * 2 * cfg.kv_size * 2
        row["floor_ms"] = 1e3 * (weights_read + kv_read) / bandwidth
        model = out = past = None  # free the model (rebound, not del: step() closes over them)
    except Exception as e:  # report why, keep the rest of the results
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random-weights", action="store_true", required=True,
                   help="build the model with random weights (the only mode: no checkpoint is read)")
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(SHAPES))
    p.add_argument("--formats", nargs="*", default=FORMATS)
    p.add_argument("--points", nargs="*", default=None, help="batch:context pairs (default: the issue's four)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per page for every format (default: the engine's, 16 for bf16 and 64 for the rest)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--decode-kernel", "--kernel", choices=DECODE_KERNELS, default="auto",
                   help="the decode kernel the KV pools are laid out for, as the engine's --decode-kernel "
                        "(default: auto)")
    p.add_argument("--weights", nargs="*", default=["bf16"], choices=["bf16", "fp8", "int4"],
                   help="weight formats to run, each a model of its own (fp8 / int4: quantize-on-load's layouts, "
                        "the experts, attention projections and LM head quantized)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="layers of the shape to build (default: all; fewer where 16-bit weights do not fit the GPU)")
    p.add_argument("--f16-dots", choices=["default", "off", "on", "both"], default="default",
                   help="int4 weights: the GEMVs' dots in fp32 (off) or packed halves (on; quant_tiles.int4_f16_dots), "
                        "both: each point with off then on (rows carry f16_dots); default: F16_DOTS_DEFAULT")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA device")
    device = torch.device("cuda")
    points = [tuple(int(x) for x in s.split(":")) for s in args.points] if args.points else POINTS
    import triton

    started = time.time()
    bandwidth = measure_bandwidth(device)
    print(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows, weights_bytes = [], {}
    for weights in args.weights:
        model, cfg = build_random_model(args.shape, device, weights, args.num_layers)
        total_weights, _ = weight_bytes_per_step(cfg, 1, weights)
        weights_bytes[weights] = total_weights
        free_bytes = torch.cuda.mem_get_info(device)[0] - ACTIVATION_RESERVE
        print(f"{weights} weights {total_weights / 2**30:.1f} GiB ({cfg.num_layers} layers); "
              f"{free_bytes / 2**30:.1f} GiB left for the KV cache", flush=True)
        dots = {"default": [None], "off": [False], "on": [True], "both": [False, True]}[args.f16_dots]
        for fmt_name, batch, context, f16 in [(f, b, c, d) for f in args.formats for b, c in points
                                              for d in (dots if weights == "int4" else [None])]:
            options = {"calibration": vq_calibration(cfg)} if fmt_name == "vq" else {}
            default_dots = quant_tiles.F16_DOTS_DEFAULT
            if f16 is not None:  # read by the launchers at each launch (and capture)
                quant_tiles.F16_DOTS_DEFAULT = f16
            try:
                row = run_point(model, cfg, fmt_name, batch, context, device, bandwidth, free_bytes, args.iters,
                                args.block_size, options, args.decode_kernel, weights)
            except Exception as e:  # one failing point must not lose the others
                row = {"weights": weights, "kv_cache_dtype": fmt_name, "batch": batch, "context": context,
                       "skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"}
                for attn in model.attention_layers:
                    attn.hooks.kv_cache = None
                torch.cuda.empty_cache()
            finally:
                quant_tiles.F16_DOTS_DEFAULT = default_dots
            if weights == "int4":
                row["f16_dots"] = quant_tiles.F16_DOTS_DEFAULT if f16 is None else f16
            rows.append(row)
            where = (f"{weights:>4} {fmt_name:>9} B={batch:<3} ctx={context:<6}"
                     + ("" if f16 is None else f" f16_dots={'on' if f16 else 'off'}"))
            if "skipped" in row:
                print(f"{where} skipped: {row['skipped']}", flush=True)
            else:
                print(f"{where} TPOT {row['tpot_ms']:7.2f} ms (eager {row['tpot_eager_ms']:7.2f}, "
                      f"graph={row['graph']})  floor {row['floor_ms']:6.2f} ms ({row['tpot_over_floor']:.2f}x)"
                      + (f"  [{row.get('graph_error')}]" if not row["graph"] else ""),
                      flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if not args.no_transformers and is_mixtral(args.shape):  # the baseline is transformers' Mixtral
        row = transformers_baseline(args.shape, 4096, device, bandwidth, max(5, args.iters // 2))
        rows.append(row)
        print(f"transformers B=1 ctx=4096: {row.get('tpot_ms', row.get('error'))}", flush=True)
    record = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
        "shape": args.shape, "decode_kernel": args.decode_kernel, "hbm_copy_bandwidth_bytes_per_s": bandwidth,
        "num_layers": args.num_layers, "weights_bytes": weights_bytes,
        "kv_free_bytes": free_bytes, "seconds": round(time.time() - started, 1), "rows": rows,
        "moekv_tree": str(Path(sys.modules["moekv"].__file__).resolve().parents[1]),  # which checkout ran
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
