"""Prefill on exact K/V: a prefill chunk attends to its own tokens' K/V as the layer computed them and
to earlier tokens as the cache stores them (dequantized pages, the staged page, the 16-bit window of
kivi2, nuq2 and vq); the pages are written quantized all the same, and one-token rows (decode) read
the cache."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM
from moekv.config import default_model_path
from moekv.context import Context
from moekv.kvcache import roundtrip
from moekv.kvcache.formats import compressed_formats, get_kv_format
from tests.kv_formats import step_context

COMPRESSED = list(compressed_formats())
CALIBRATION = default_model_path() / "kv_calibration"  # the shipped model's (vq needs one): 2 KV heads, head_dim 128
# kivi2, nuq2, vq: a window shorter than the prompts, so that later chunks read earlier ones from
# 2-bit pages; tiered: re-ranked at every step, prefill chunks included
ENGINE_OPTIONS = {"kivi2": {"kv_residual": 32}, "nuq2": {"kv_residual": 32}, "vq": {"kv_residual": 32},
                  "tiered": {"kv_rerank_interval": 1}}


def token_ids(n: int, seed: int) -> list[int]:
    return [(7 * j + 13 * seed) % 300 + 5 for j in range(n)]


def score(kv_cache_dtype: str, prompts: list[list[int]], **kwargs) -> list[torch.Tensor]:
    llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=32, max_model_len=256, **kwargs)
    return llm.score([{"prompt_token_ids": p} for p in prompts])


@pytest.mark.parametrize("name", COMPRESSED)
def test_one_chunk_prefill_gives_the_model_dtype_logits(name):
    """Two prompts prefilled in one step, each in one chunk, attend only to K/V computed in that step:
    every compressed format gives the logits of the float32 cache (float32 noise at most). Prefilled in
    chunks of 40 tokens, later chunks read earlier ones as stored, and the logits move."""
    prompts = [token_ids(100, 1), token_ids(70, 2)]
    want = score("fp32", prompts)
    got = score(name, prompts, **ENGINE_OPTIONS.get(name, {}))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g - w).abs().max() < 1e-4
    chunked = score(name, prompts, max_num_batched_tokens=40, **ENGINE_OPTIONS.get(name, {}))
    assert max(float((c - w).abs().max()) for c, w in zip(chunked, want)) > 1e-2


# -- one layer's attention against float64 ---------------------------------------------------------
H, HQ, P, D = 2, 4, 32, 128  # KV heads, query heads, page size, head_dim (the shipped calibration's shape)


def step(chunks: list[tuple[int, list[int], int, int]]) -> Context:
    """chunks: (staging slot, block table, first position, end position) of each sequence in the step."""
    return step_context(chunks, P)


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: q [Tq, HQ, D], the last Tq positions of k, v [L, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)


# (format, its options, what roundtrip stores its pages as, its 16-bit window)
CASES = [("fp8_e4m3", {}, "fp8_e4m3", 0), ("int4", {}, "int4", 0), ("nuq2", {"residual": 0}, "nuq2", 0),
         ("nuq2", {"residual": 64}, "nuq2", 64), ("vq", {"calibration": CALIBRATION, "residual": 0}, "vq", 0),
         ("vq", {"calibration": CALIBRATION, "residual": 48}, "vq", 48), ("kivi2", {"residual": 0}, "kivi2", 0),
         ("kivi2", {"residual": 32}, "kivi2", 32), ("kivi2", {"residual": 64}, "kivi2", 64),
         ("tiered", {}, "fp8_e4m3", 0)]  # tiered: fresh pages go to FP8 (its pool has room for them all)


@pytest.mark.parametrize("name, options, stored_as, window", CASES,
                         ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items() if k != 'calibration')}".rstrip("-")
                              for n, o, _, _ in CASES])
def test_a_later_chunk_reads_earlier_ones_as_stored_and_itself_exact(name, options, stored_as, window):
    """Sequence 0 is prefilled in chunks [0, 40) and [40, 100); sequence 1, 70 tokens cached, decodes
    beside the second chunk (a mixed step). The chunk's queries attend, in float32, as float64
    attention does over positions 0-39 as the cache stored them when the step began (page 0 through
    the format's quantize -> dequantize; positions 32-39, staged in 16 bits, as staged, though the
    chunk's write completes and quantizes their page; kivi2's window, in 16 bits, as computed) and
    40-99 exactly as computed; reading its own positions back from the cache instead (no step_kv) is
    further from that. The decode row reads the cache alone, step_kv or not. gather reads any prefix
    of a sequence."""
    fmt = get_kv_format(name, torch.float32, **options)
    cache = fmt.allocate(12, H, P, D, torch.device("cpu"), 3, torch.float32)
    g = torch.Generator().manual_seed(3)
    # bf16 values: staging and the window keep them exactly
    kv = {s: [torch.randn(100, H, D, generator=g).bfloat16().float() for _ in range(2)] for s in (0, 1)}
    tables = {0: [3, 0, 5, 7], 1: [1, 2, 4, 6]}
    slots = {0: 2, 1: 0}

    def write(chunks):
        ctx = step([(slots[s], tables[s], lo, hi) for s, lo, hi in chunks])
        k = torch.cat([kv[s][0][lo:hi] for s, lo, hi in chunks])
        v = torch.cat([kv[s][1][lo:hi] for s, lo, hi in chunks])
        fmt.write(cache, k, v, ctx)
        return ctx, (k, v)

    write([(0, 0, 40), (1, 0, 70)])
    ctx, step_kv = write([(0, 40, 100), (1, 70, 71)])
    q = torch.randn(61, HQ, D, generator=g)
    scale = D ** -0.5
    exact = fmt.attend(q, cache, ctx, scale, None, step_kv)
    from_cache = fmt.attend(q, cache, ctx, scale, None)

    rt_options = {"calibration": CALIBRATION} if stored_as == "vq" else {}
    stored = [roundtrip(stored_as, x, kind, block_size=P, **rt_options)[0]
              for x, kind in zip(kv[0], ("key", "value"))]  # [100, H, D]: 3 full pages, a staged tail
    ref_kv = []
    for x, x_hat in zip(kv[0], stored):
        earlier = x_hat[:40].clone()
        earlier[P:40] = x[P:40]  # staged before the step (bf16 values: exact)
        if 100 - window < 40:  # the ring holds positions [100 - window, 100)
            earlier[100 - window:] = x[100 - window:40]
        ref_kv.append(torch.cat([earlier, x[40:100]]))
    ref = attention64(q[:60], *ref_kv, scale)
    assert (exact[:60].double() - ref).abs().max() < 1e-5
    if window < 60:  # some of the chunk's own tokens lie outside the window: read back, they are quantized
        assert (from_cache[:60].double() - ref).abs().max() > 1e-3
    assert torch.equal(exact[60], from_cache[60])  # the decode row

    for b, length in ((0, 100), (1, 71)):
        for kind in ("key", "value"):
            whole = fmt.gather(cache, ctx, b, length, kind)
            for n in (1, 31, 32, 33, 40, 64, 65, length - 1, length):
                assert torch.equal(fmt.gather(cache, ctx, b, n, kind), whole[:n]), (b, kind, n)
