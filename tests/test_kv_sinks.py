"""Sink tokens (moekv/kvcache/formats/sinks.py) of kivi2, nuq2 and vq: each sequence's first S tokens in a
16-bit buffer, written with the tokens that compute them and read in place of their dequantized values.

On the CPU: gather across page boundaries, prefill chunks, decode steps and two sequences (the stored
pages, the first S positions exact, the newest R exact where a residual window is on); the reference
decode path against float64 dense attention over those values; S = 0 as the format without sinks;
the buffer's bytes in the bits per element; decode steps refused to the fused kernels; through the
engine, sinks over the whole context read what a window over it reads."""
from __future__ import annotations

import pytest
import torch

from moekv.config import EngineConfig
from moekv.kvcache.formats import get_kv_format
from tests.test_kv_residual import HQ, NAMES, P, Sequences, attention64, options

CASES = [(n, s, r) for n in NAMES for s, r in ((4, 0), (64, 0), (70, 32))] + [("nuq2", 0, 32), ("nuq2", 33, 128)]


def expected(seqs: Sequences, s: int, kind: int, S: int, R: int, name: str) -> torch.Tensor:
    want = seqs.expected(s, kind, R, name)
    want[:S] = seqs.kv[s][kind][:min(S, seqs.lens[s])]
    return want


def make(name: str, S: int, R: int):
    return get_kv_format(name, torch.float32, **options(name, R), sink_tokens=S)


@pytest.mark.parametrize("name, S, R", CASES)
def test_gather_reads_the_first_S_exact(name, S, R):
    """Two sequences, prefilled in chunks that cross page boundaries (one in a mixed step beside a decode),
    then decoding past page ends: after each step gather gives the stored pages with the first S and the
    newest R positions exact, for the whole context and for prefixes shorter and longer than S."""
    fmt = make(name, S, R)
    seqs = Sequences(fmt, 200, seed=S + R)
    steps = [[(0, 45)], [(0, 30), (1, 70)], [(0, 1), (1, 1)]] + [[(0, 1), (1, 1)]] * 60
    for i, chunks in enumerate(steps):
        ctx = seqs.step(chunks)
        if i % 7 and i != len(steps) - 1:
            continue
        for b, (s, _) in enumerate(chunks):
            n = seqs.lens[s]
            for kind in (0, 1):
                want = expected(seqs, s, kind, S, R, name)
                for cut in sorted({n, max(S - 3, 1), S + 5}):
                    if cut <= n:
                        got = fmt.gather(seqs.cache, ctx, b, cut, ("key", "value")[kind])
                        assert torch.equal(got, want[:cut]), (i, s, kind, cut)
    assert seqs.lens == {0: 136, 1: 131}


@pytest.mark.parametrize("name, S, R", CASES)
def test_reference_decode_with_sinks_is_dense_attention(name, S, R):
    """The decode path (attend) of both sequences equals float64 attention over the pages as stored with
    the first S (and newest R) positions exact; sinks change the output where they cover positions that
    neither the ring nor the staged page holds."""
    fmt = make(name, S, R)
    seqs = Sequences(fmt, 200, seed=1)
    seqs.step([(0, 100), (1, 150)])
    ctx = seqs.step([(0, 1), (1, 1)])  # 101 and 151 tokens
    q = torch.randn(2, HQ, seqs.kv[0][0].shape[-1], generator=torch.Generator().manual_seed(5))
    scale = q.shape[-1] ** -0.5
    out = fmt.attend(q, seqs.cache, ctx, scale, None)
    for b, s in enumerate((0, 1)):
        ref = attention64(q[b], expected(seqs, s, 0, S, R, name), expected(seqs, s, 1, S, R, name), scale)
        assert (out[b].double() - ref).abs().max() < 1e-5, (b, s)
        n = seqs.lens[s]
        if min(S, n - R, (n - 1) // P * P) > 0:
            without = attention64(q[b], seqs.expected(s, 0, R, name), seqs.expected(s, 1, R, name), scale)
            assert (out[b].double() - without).abs().max() > 1e-4, (b, s)


@pytest.mark.parametrize("name", NAMES)
def test_no_sinks_is_the_format_without_them(name):
    """S = 0 (every format's default): no buffer, no bytes, the fused decode kernels and prefix caching
    as without the option; S > 0 refuses both, naming the reason."""
    fmt = get_kv_format(name, torch.float32, **options(name, 0))
    assert fmt.sink_tokens == 0
    cache = fmt.allocate(4, 2, 64, 128, torch.device("cpu"), 2, torch.float32)
    assert "k_sink" not in cache.tensors
    assert fmt.fused_decode_unavailable(64, 128) is None
    assert fmt.prefix_caching_unsupported() is None
    sinks = make(name, 16, 0)
    assert "sink tokens" in sinks.fused_decode_unavailable(64, 128)
    assert "sinks" in sinks.prefix_caching_unsupported()


@pytest.mark.parametrize("name", NAMES)
def test_bits_count_the_sinks(name):
    """bits_per_element_at counts the buffer as allocated: S rows of K and V in 16 bits and the spare row that
    takes later positions' writes add 16 (S + 1) / L bits per element; sink_bytes_per_seq is what allocate makes."""
    for S in (4, 64):
        with_sinks, without = make(name, S, None), make(name, 0, None)
        for L in (4096, 32768):
            extra = with_sinks.bits_per_element_at(L, 8, 64, 128) - without.bits_per_element_at(L, 8, 64, 128)
            assert extra == pytest.approx(16 * (S + 1) / L)
        cache = with_sinks.allocate(4, 8, 64, 128, torch.device("cpu"), 3, torch.bfloat16)
        sink_bytes = sum(t.numel() * t.element_size() for key, t in cache.tensors.items() if key.endswith("_sink"))
        assert sink_bytes == 3 * with_sinks.sink_bytes_per_seq(8, 128)


def test_option_and_refusals():
    """kv_sink_tokens reaches kivi2, nuq2 and vq; tiered's low tier does not take it; bad values are refused
    naming the option."""
    for name in NAMES:
        assert EngineConfig(kv_cache_dtype=name, kv_sink_tokens=64).kv_format_options()["sink_tokens"] == 64
    assert "sink_tokens" not in EngineConfig(kv_cache_dtype="tiered").kv_format_options()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sink_tokens"):
            get_kv_format("nuq2", sink_tokens=bad)
        with pytest.raises(ValueError, match="kv_sink_tokens"):
            EngineConfig(kv_cache_dtype="nuq2", kv_sink_tokens=bad)


@pytest.mark.parametrize("name", NAMES)
def test_engine_with_sinks_over_the_whole_context_reads_what_a_whole_window_reads(name):
    """Through the engine (float32 on the CPU), prompts prefilled in chunks of 40 tokens then decoded
    past a page end: with no window and sinks longer than every sequence, every cached position is read
    from the 16-bit sink buffer, as it is from the residual window's ring (tested against float64 in
    test_kv_residual.py) with no sinks and a window longer than every sequence, so the greedy tokens and
    their logprobs are the same; with a few sinks later chunks read 2-bit pages and the logprobs move."""
    from moekv import LLM, SamplingParams
    from tests.test_kv_prefill_exact import token_ids

    prompts = [{"prompt_token_ids": token_ids(100, 1)}, {"prompt_token_ids": token_ids(70, 2)}]
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=0)

    def run(kv_cache_dtype, **kwargs):
        llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=32, max_model_len=256,
                  max_num_batched_tokens=40, **kwargs)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(c.token_ids, torch.tensor([lp[t] for t, lp in zip(c.token_ids, c.logprobs)])) for c in outs]

    want = run(name, kv_residual=256, kv_sink_tokens=0)  # vq: the shipped model's calibration
    got = run(name, kv_residual=0, kv_sink_tokens=256)
    few = run(name, kv_residual=0, kv_sink_tokens=8)
    for (t, lp), (tw, lpw), (_, lpf) in zip(got, want, few):
        assert t == tw
        assert (lp - lpw).abs().max() < 1e-5
        assert len(lpf) != len(lpw) or (lpf - lpw).abs().max() > 1e-3
