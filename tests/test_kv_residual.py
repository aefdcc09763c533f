"""The residual window (moekv/kvcache/formats/residual.py) of kivi2, nuq2 and vq: each sequence's newest R
tokens in a 16-bit ring, written with every token and read in place of their dequantized values.

On the CPU: the ring's writes and gather across page boundaries, prefill chunks, decode steps and
several sequences (gather = the stored pages, the newest R positions exact); the reference decode
path (attend) against float64 dense attention over those values; R = 0 as the format without a
window; the ring's bytes in the bits per element at 4k and 32k."""
from __future__ import annotations

import pytest
import torch

from moekv.config import EngineConfig, default_model_path
from moekv.kvcache import roundtrip
from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.fragment import FragmentPagedFormat
from moekv.kvcache.formats.residual import ResidualWindow
from tests.kv_formats import step_context

CALIBRATION = default_model_path() / "kv_calibration"  # the shipped model's (vq needs one): 2 KV heads, head_dim 128
H, HQ, P, D = 2, 4, 32, 128
NAMES = ("kivi2", "nuq2", "vq")


def options(name: str, residual: int | None) -> dict:
    return {**({"calibration": CALIBRATION} if name == "vq" else {}),
            **({} if residual is None else {"residual": residual})}


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention in float64: q [HQ, D] (the last position) over k, v [L, H, D]."""
    group = q.shape[0] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    p = (torch.einsum("hd,lhd->hl", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v)


class Sequences:
    """Sequences written through fmt.write step by step (prefill chunks, then decode tokens), their
    K/V kept to compare with (bf16 values: staging and the ring hold them exactly)."""

    def __init__(self, fmt, lengths: int, seed: int = 0):
        self.fmt = fmt
        self.cache = fmt.allocate(24, H, P, D, torch.device("cpu"), 4, torch.float32)
        g = torch.Generator().manual_seed(seed)
        self.kv = [[torch.randn(lengths, H, D, generator=g).bfloat16().float() for _ in range(2)] for _ in range(2)]
        self.tables = {0: [3, 0, 5, 7, 9, 11, 13], 1: [1, 2, 4, 6, 8, 10, 12]}
        self.slots = {0: 2, 1: 0}
        self.lens = {0: 0, 1: 0}

    def step(self, chunks: list[tuple[int, int]]):
        """chunks: (sequence, new tokens) of one step. Returns its Context."""
        spans = [(s, self.lens[s], self.lens[s] + n) for s, n in chunks]
        ctx = step_context([(self.slots[s], self.tables[s], lo, hi) for s, lo, hi in spans], P)
        k = torch.cat([self.kv[s][0][lo:hi] for s, lo, hi in spans])
        v = torch.cat([self.kv[s][1][lo:hi] for s, lo, hi in spans])
        self.fmt.write(self.cache, k, v, ctx)
        if all(n == 1 for _, n in chunks):  # a decode step quantizes the pages it filled afterwards
            filled = [(s, hi) for s, _, hi in spans if hi % P == 0]
            if filled:
                ctx.fill_slots = torch.tensor([self.slots[s] for s, _ in filled])
                ctx.fill_pages = torch.tensor([self.tables[s][hi // P - 1] for s, hi in filled])
                self.fmt.quantize_filled_pages([self.cache], ctx)
        for s, _, hi in spans:
            self.lens[s] = hi
        return ctx

    def expected(self, s: int, kind: int, R: int, stored_as: str) -> torch.Tensor:
        """Sequence s's K (kind 0) or V as the cache should hold them: full pages (but the newest,
        staged even when full) as stored, the staged page as computed, the newest R positions exact."""
        n = self.lens[s]
        x = self.kv[s][kind][:n]
        rt = {"calibration": CALIBRATION} if stored_as == "vq" else {}
        staged_from = ((n - 1) // P) * P
        want = x.clone()
        if staged_from:
            want[:staged_from] = roundtrip(stored_as, x[:staged_from], ("key", "value")[kind], block_size=P, **rt)[0]
        ring_from = max(n - R, 0)
        want[ring_from:] = x[ring_from:]
        return want


@pytest.mark.parametrize("name, R", [(n, r) for n in NAMES for r in (0, 32, 64)] + [("nuq2", 40), ("vq", 40)])
def test_gather_reads_the_newest_R_from_the_ring(name, R):
    """Two sequences, prefilled in chunks that cross page boundaries (one in a mixed step beside a
    decode), then decoding past page ends: after each step gather gives the stored pages with the
    newest R positions exact, for any prefix length; the ring rows hold position p at p % R."""
    fmt = get_kv_format(name, torch.float32, **options(name, R))
    seqs = Sequences(fmt, 200, seed=R)
    steps = [[(0, 45)], [(0, 30), (1, 70)], [(0, 1), (1, 1)]] + [[(0, 1), (1, 1)]] * 60
    for i, chunks in enumerate(steps):
        ctx = seqs.step(chunks)
        if i % 7 and i != len(steps) - 1:
            continue
        for s in (0, 1):
            b = [c[0] for c in chunks].index(s) if s in [c[0] for c in chunks] else None
            if b is None:
                continue
            n = seqs.lens[s]
            for kind in (0, 1):
                want = seqs.expected(s, kind, R, name)
                got = fmt.gather(seqs.cache, ctx, b, n, ("key", "value")[kind])
                assert torch.equal(got, want), (i, s, kind)
                cut = n - R // 2 - 3  # a prefix ending inside the ring's range
                if cut > 0:
                    got = fmt.gather(seqs.cache, ctx, b, cut, ("key", "value")[kind])
                    assert torch.equal(got, want[:cut]), (i, s, kind, cut)
            if R:
                ring = seqs.cache["k_residual"][seqs.slots[s]]  # [H, R, D]
                for p in range(max(n - R, 0), n):
                    assert torch.equal(ring[:, p % R], seqs.kv[s][0][p])
    assert seqs.lens == {0: 136, 1: 131}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("R", [0, 96, 128])
def test_reference_decode_with_the_ring_is_dense_attention(name, R):
    """The CPU decode path (attend's reference over gather) of both sequences equals float64 attention
    over the pages as stored and the newest R positions exact; a window changes the output."""
    fmt = get_kv_format(name, torch.float32, **options(name, R))
    seqs = Sequences(fmt, 200, seed=1)
    seqs.step([(0, 100), (1, 150)])
    ctx = seqs.step([(0, 1), (1, 1)])  # 101 and 151 tokens
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(5))
    scale = D ** -0.5
    out = fmt.attend(q, seqs.cache, ctx, scale, None)
    for b, s in enumerate((0, 1)):
        ref = attention64(q[b], seqs.expected(s, 0, R, name), seqs.expected(s, 1, R, name), scale)
        assert (out[b].double() - ref).abs().max() < 1e-5, (b, s)
        if R:
            no_window = attention64(q[b], seqs.expected(s, 0, 0, name), seqs.expected(s, 1, 0, name), scale)
            assert (out[b].double() - no_window).abs().max() > 1e-3


@pytest.mark.parametrize("name", ("nuq2", "vq"))
def test_no_window_is_the_format_without_one(name):
    """R = 0: no ring tensors, no ring bytes, and write, gather, the fused RoPE store's target and
    prefix caching as the paged base class has them."""
    fmt = get_kv_format(name, torch.float32, **options(name, 0))
    seqs = Sequences(fmt, 120, seed=2)
    ctx = seqs.step([(0, 70), (1, 90)])
    assert not any(t.endswith("_residual") for t in seqs.cache.tensors)
    base = FragmentPagedFormat
    assert fmt.staging_bytes_per_seq(H, P, D) == base.staging_bytes_per_seq(fmt, H, P, D)
    for b, n in enumerate((70, 90)):
        for kind in ("key", "value"):
            assert torch.equal(fmt.gather(seqs.cache, ctx, b, n, kind), base.gather(fmt, seqs.cache, ctx, b, n, kind))
    decode = seqs.step([(0, 1), (1, 1)])
    decode.fills_no_page = True  # 71 and 91 tokens: the step fills no page
    target = fmt.fused_rope_write_target(seqs.cache, torch.randn(2, H, D), decode)
    assert target.staged and target.k_dest is seqs.cache["k_staging"] and target.index is decode.seq_slots
    assert target.k_ring is None and target.v_ring is None
    assert fmt.prefix_caching_unsupported() is None
    windowed = get_kv_format(name, torch.float32, **options(name, 32))
    assert "residual window" in windowed.prefix_caching_unsupported()


def test_defaults_and_refusals():
    """nuq2 keeps 128 tokens, vq 256 and kivi2 128 unless kv_residual says otherwise; tiered's low tier
    none; a bad R is refused naming the option."""
    assert get_kv_format("nuq2").residual == 128
    assert get_kv_format("vq", calibration=CALIBRATION).residual == 256
    assert get_kv_format("kivi2").residual == 128
    assert get_kv_format("tiered").lo.residual == 0
    for name in NAMES:
        assert isinstance(get_kv_format(name, **options(name, 0)), ResidualWindow)
        assert EngineConfig(kv_cache_dtype=name, kv_residual=64).kv_format_options()["residual"] == 64
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="residual"):
            get_kv_format("nuq2", residual=bad)
        with pytest.raises(ValueError, match="kv_residual"):
            EngineConfig(kv_cache_dtype="nuq2", kv_residual=bad)
    with pytest.raises(ValueError, match="multiple of 32"):
        get_kv_format("kivi2", residual=48)
    with pytest.raises(ValueError, match="kv_residual=48 must be a multiple of 32"):
        EngineConfig(kv_cache_dtype="kivi2", kv_residual=48)
    assert EngineConfig(kv_cache_dtype="nuq2", kv_residual=48).kv_format_options()["residual"] == 48


@pytest.mark.parametrize("name, R", [("nuq2", 128), ("vq", 256), ("kivi2", 128)])
def test_bits_count_the_ring(name, R):
    """bits_per_element_at counts the ring: at context L, (L // P full pages + staging page + ring) over
    L tokens; the ring's R tokens of K and V in 16 bits add 16 R / L bits per element."""
    with_ring = get_kv_format(name, **options(name, R))
    without = get_kv_format(name, **options(name, 0))
    for L in (4096, 32768):
        extra = with_ring.bits_per_element_at(L, 8, 64, 128) - without.bits_per_element_at(L, 8, 64, 128)
        assert extra == pytest.approx(16 * R / L)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")
@pytest.mark.parametrize("name, R", [("nuq2", 128), ("nuq2", 256), ("vq", 256), ("kivi2", 128)])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_gluon_decode_reads_the_ring_in_several_programs(monkeypatch, name, R, window):
    """The engine's decode over a fragment-order pool on CUDA (the format's attend: its Gluon kernel at
    the default launch) with the ring: at batch 3 the launch reads the tail in R / 32 programs
    (launch.plan_splits), and the output matches the reference path over the same pool, with sinks and
    a window cutting into the tail; lengths past R (the ring wrapped) and shorter than R."""
    import importlib

    from tests.test_gluon_engine import H as HKV
    from tests.test_gluon_engine import P as PAGE
    from tests.test_gluon_engine import decode_ctx, filled_pools

    fmt, pool = filled_pools(name, "gluon", "cuda", torch.bfloat16, R)
    decode = importlib.import_module(f"moekv.ops.gluon.{name}_decode")
    launches = []
    real = decode.plan_launch
    monkeypatch.setattr(decode, "plan_launch", lambda *a, **k: launches.append(real(*a, **k)) or launches[-1])
    ctx = decode_ctx([3 * PAGE + 40, PAGE + 1, 2 * PAGE + 5], [2, 0, 1], [[0, 3, 1, 5], [5, 4, 0, 0], [1, 2, 3, 0]],
                     "cuda")
    g = torch.Generator().manual_seed(R)
    q = torch.randn(3, 4 * HKV, D, generator=g).to("cuda", torch.bfloat16)
    sinks = (torch.randn(4 * HKV, generator=g) * 3).to("cuda", torch.bfloat16)
    out = fmt.attend(q, pool, ctx, D ** -0.5, window, None, sinks)
    assert launches and launches[-1].tail_splits == R // 32, "the ring's tail in shares of 32 tokens"
    ref = fmt.attend_reference(q, pool, ctx, D ** -0.5, window, None, sinks)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
