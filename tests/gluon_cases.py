"""What the Gluon decode tests of nuq2, int4 and kivi2 (tests/test_gluon_*.py) share: random pages
packed by a format itself behind a shuffled block table, the float64 dense-attention oracle over a
format's own dequantized pages (+ the 16-bit tail), staging pages, the sm_90 offline build in a
fresh interpreter, and the GPU comparison of a kernel's partials with its split reference."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekv.ops.gluon.nuq2_decode import reduce_partials
from moekv.ops.reference import decode_attention_ref

P, D = 64, 128
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")


def large_channel_keys(n: int, Hkv: int, g: torch.Generator, shift: float = 0.0) -> torch.Tensor:
    """Random keys [n, Hkv, 64, 128] + shift with two large channels (7 scaled, 91 offset)."""
    k = torch.randn(n, Hkv, P, D, generator=g) + shift
    k[..., 7] *= 8
    k[..., 91] += 6
    return k


def pack(fmt, k: torch.Tensor, v: torch.Tensor, edit=None, layer: int | None = None) -> list[torch.Tensor]:
    """The key and value slabs of pages k, v as fmt quantizes (for `layer`) and packs them
    (edit(fields) may change the fields first)."""
    slabs = []
    for kind, x in (("key", k), ("value", v)):
        fields = fmt.quantize(x, kind, layer)
        if edit is not None:
            edit(fields)
        slabs.append(fmt.layout(kind, P, D).pack(fields))
    return slabs


def shuffled_tables(num_pages: int, lens, g: torch.Generator) -> torch.Tensor:
    """Block tables [B, max pages] int32 for sequences of `lens` tokens over pages 0..num_pages-1
    drawn without repetition in an order shuffled by g (unused entries 0)."""
    pages_per = [-(-n // P) for n in lens]
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        tables[b, :n] = perm[at:at + n]
        at += n
    return tables


def behind_tables(fmt, slabs, lens, g: torch.Generator, to_fragment_order, device="cpu"):
    """Slabs [N, ...] behind a block table shuffled by g, the pages in fragment order ->
    (fmt, frag, block_tables, context_lens, k_pages, v_pages)."""
    tables = shuffled_tables(slabs[0].shape[0], lens, g)
    frag = to_fragment_order(fmt, slabs[0].to(device), slabs[1].to(device))
    return fmt, frag, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), slabs[0], slabs[1]


def num_pages(lens) -> int:
    """Pages for sequences of lengths lens, and two spare."""
    return sum(-(-n // P) for n in lens) + 2


def staged_tail(staged, b: int, quantized: int, n: int):
    """Sequence b's tokens [quantized, n) from its staging page (row t % 64): (k, v) [T, Hkv, D] float64."""
    slot = int(staged[2][b])
    return (staged[0][slot].cpu().double().transpose(0, 1)[: n - quantized],
            staged[1][slot].cpu().double().transpose(0, 1)[: n - quantized])


def dense_reference(fmt, k_pages, v_pages, q, tables, lens, scale, staged=None, sliding_window=None, tail=None,
                    layer=None):
    """decode_attention_ref (float64) over each sequence's pages as fmt dequantizes them (for `layer`);
    with staged = (k_stage, v_stage, seq_slots), tokens from tail(b, n) -> (quantized, k, v) on from the
    tail (by default the staging page from ((n - 1) // 64) * 64 on)."""
    kd = fmt.dequantize(fmt.layout("key", P, D).unpack(k_pages.cpu()), "key", layer)  # [N, H, P, D]
    vd = fmt.dequantize(fmt.layout("value", P, D).unpack(v_pages.cpu()), "value", layer)
    keys, values = [], []
    for b, n in enumerate(lens.tolist()):
        ids = tables[b, :-(-n // P)].long().cpu()
        k = kd[ids].permute(0, 2, 1, 3).reshape(-1, kd.shape[1], D)[:n].double()
        v = vd[ids].permute(0, 2, 1, 3).reshape(-1, vd.shape[1], D)[:n].double()
        if staged is not None:
            if tail is None:
                quantized = (n - 1) // P * P
                kt, vt = staged_tail(staged, b, quantized, n)
            else:
                quantized, kt, vt = tail(b, n)
            k = torch.cat([k[:quantized], kt])
            v = torch.cat([v[:quantized], vt])
        keys.append(k)
        values.append(v)
    return decode_attention_ref(q.double().cpu(), keys, values, scale, sliding_window)


def check_split_reference(reference, build, G: int, tol: float, dense=dense_reference, **options):
    """A format's split reference (reference(q, frag, tables, lens, scale, num_splits)) in float64 against
    dense attention over the format's own dequantized pages (dense: dense_reference or a format's own
    with its signature), pages only: split counts 1, 3, 16 (some splits empty), lengths on and off page
    boundaries; options go to build -> the built frag."""
    Hkv = 8 // G if G > 1 else 2
    lens = [700, 64 * 3, 65, 1]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=G, **options)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64)
    ref = dense(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5)
    for ns in (1, 3, 16):
        o, lse = reference(q, frag, tables, lens_t, D ** -0.5, ns)
        assert torch.allclose(reduce_partials(o, lse), ref, atol=tol, rtol=tol), ns
    return frag


def check_staged_reference(reference, build, window, tol: float) -> None:
    """The staged 16-bit tail as split num_splits (the newest page, even when full, from staging) and the
    sliding window, in a format's split reference (float64) against dense attention over pages + staging."""
    Hkv, G = 2, 4
    lens = [777, 64 * 16, 65, 64]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=5)
    staged = staging(len(lens), Hkv, seed=8)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1, staged, window)
    for ns in (1, 3, 7):
        o, lse = reference(q, frag, tables, lens_t, 0.1, ns, staged=staged, sliding_window=window)
        assert torch.allclose(reduce_partials(o, lse), ref, atol=tol, rtol=tol), ns


def check_ring_reference(reference, build, R: int, window, tol: float, layer: int | None = None) -> None:
    """A residual window's ring in a format's split reference (float64): the tail splits read the newest R
    tokens from the ring (row t % R) and older tail tokens from staging, each its share (1, 3 and 8
    shares: some empty where the tail is short), the pages end where the ring begins (some inside a page),
    sliding windows ending inside the tail (a page split with no valid token); against dense attention
    over the format's pages (dequantized for `layer`), the ring and the staging page. Ring and staging hold
    different values, so a token read from the wrong one shows."""
    from moekv.ops.gluon.splits import quantized_tokens, tail_tokens

    Hkv, G = 2, 4
    lens = [1000, 777, 64 * 16, 65, 64, 130, 5]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=5 + R)
    staged = staging(len(lens), Hkv, seed=8)
    g = torch.Generator().manual_seed(9)
    ring = (torch.randn(len(lens) + 1, Hkv, R, D, generator=g, dtype=torch.float64) + 1.0,
            torch.randn(len(lens) + 1, Hkv, R, D, generator=g, dtype=torch.float64) - 1.0)

    def tokens(b, n):
        quantized = quantized_tokens(n, True, R)
        kt, vt = tail_tokens(staged, ring, b, quantized, n, torch.float64)
        return quantized, kt.transpose(0, 1), vt.transpose(0, 1)

    ref = dense_reference(fmt, k_pages, v_pages, q := torch.randn(len(lens), Hkv * G, D, dtype=torch.float64),
                          tables, lens_t, 0.1, staged, window, tokens, layer)
    for ns, ts in ((1, 1), (3, 3), (7, 8)):
        o, lse = reference(q, frag, tables, lens_t, 0.1, ns, staged=staged, sliding_window=window, residual=ring,
                           tail_splits=ts)
        assert o.shape[2] == ns + ts and lse.shape[2] == ns + ts
        assert relative_error(reduce_partials(o, lse), ref) < tol, (ns, ts)


def reduce_with_sinks(part_o: torch.Tensor, part_lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """reduce_partials with each head's sink logit sinks [Hq] (natural log units) as one more split of
    output 0 (ops/decode/common.reduce_head's merge), float64."""
    lse = part_lse.double()
    sink = sinks.double().to(lse.device)[None, :] * 1.4426950408889634  # log2(e): the partials' base-2 units
    top = torch.maximum(lse.amax(-1), sink)
    w = torch.exp2(lse - top[..., None])
    return (w[..., None] * part_o.double()).sum(2) / (w.sum(-1) + torch.exp2(sink - top))[..., None]


def staging(B, Hkv, seed, device="cpu", dtype=torch.float64):
    """Random 16-bit staging pages [B + 1, Hkv, 64, 128] (one spare) and a permuted slot per sequence."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype)
    v = torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype)
    slots = torch.randperm(B + 1, generator=g)[:B]
    return k.to(device), v.to(device), slots.to(device)


def relative_error(out, ref) -> float:
    return float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm())


def run_sm90_build(script: str, cwd=None) -> list[str]:
    """Run a build script (Triton's compile for GPUTarget('cuda', 90, 32)) in a fresh interpreter
    without TRITON_INTERPRET (other CPU tests set it for the session, which leaves triton.language's
    own helpers uncompilable) -> its printed words; skips where Triton has no Gluon."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600, check=False, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def gpu_case(build, G: int, lens, seed: int, **options):
    """A format's `build` on CUDA for GQA group G (Hkv = 8 // G, 4 for G 1) and a bf16 q ->
    (Hkv, fmt, frag, block_tables, context_lens, k_pages, v_pages, q)."""
    Hkv = 8 // G if G > 1 else 4
    built = build(lens, Hkv, seed=seed, device="cuda", **options)
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    return (Hkv, *built, q)


def check_kernel_matches_reference(partials, reference, build, G: int, lens) -> None:
    """A kernel's partials (partials(q, frag, tables, lens, scale, ns)) against its split reference in
    float64, split counts 1, 5, 64 (some splits empty): the same empty splits (-inf), lse within 2e-2,
    the merged output within 3e-3."""
    _, _, frag, tables, lens_t, _, _, q = gpu_case(build, G, lens, G)
    for ns in (1, 5, 64):
        part_o, part_lse = partials(q, frag, tables, lens_t, D ** -0.5, ns)
        ref_o, ref_lse = reference(q.double(), frag, tables, lens_t, D ** -0.5, ns)
        full = ref_lse > -float("inf")
        assert torch.equal(part_lse.isfinite().cpu(), full.cpu()), "empty splits must be -inf, others finite"
        assert (part_lse - ref_lse)[full].abs().max() < 2e-2
        assert relative_error(reduce_partials(part_o.double(), part_lse.double()),
                              reduce_partials(ref_o, ref_lse)) < 3e-3


def check_prefetch_changes_nothing(partials, build, G: int) -> None:
    """The kernel's partials with the next page prefetched into L2 (2) or L1 (1) are the partials
    without (0), bit for bit: a prefetch writes no register (moekv/ops/gluon/prefetch.py)."""
    check_same_partials(partials, build, G, {"prefetch": 0}, [{"prefetch": 1}, {"prefetch": 2}])


def check_decode_matches_dense(attention, build, G: int, **options) -> None:
    """Kernel + reduce (attention(q, frag, tables, lens, scale, num_splits=4)) against dense attention
    over the format's own dequantized pages: bf16 out within 1e-2."""
    _, fmt, frag, tables, lens_t, k_pages, v_pages, q = gpu_case(build, G, [777, 64 * 16, 65], 10 + G, **options)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5)
    out = attention(q, frag, tables, lens_t, D ** -0.5, num_splits=4)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2


def check_same_partials(partials, build, G: int, base: dict, variants: list[dict]) -> None:
    """The kernel's partials under each launch variant (e.g. smem=True) are those under `base`, bit for
    bit: the variants move data differently, not the arithmetic."""
    _, _, frag, tables, lens_t, _, _, q = gpu_case(build, G, [1000, 64 * 9, 129, 3000], 20 + G)
    ref_o, ref_lse = partials(q, frag, tables, lens_t, D ** -0.5, 5, **base)
    for options in variants:
        part_o, part_lse = partials(q, frag, tables, lens_t, D ** -0.5, 5, **options)
        assert torch.equal(part_o, ref_o) and torch.equal(part_lse, ref_lse), options


def check_staged_decode(attention, build, G: int, window, **options) -> None:
    """The staged bf16 tail as the launch's extra split, and the sliding window, against dense
    attention over pages + staging (split counts 1, 3 and the default; options: the launcher's)."""
    lens = [777, 64 * 16, 65, 64]
    Hkv, fmt, frag, tables, lens_t, k_pages, v_pages, q = gpu_case(build, G, lens, 20 + G)
    k, v, slots = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, (k, v, slots), window)
    for ns in (1, 3, None):
        out = attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, staged=(k, v, slots), sliding_window=window,
                        **options)
        assert relative_error(out, ref) < 1e-2, ns


def check_ring_decode(attention, build, G: int, R: int, window, layer: int | None = None, **options) -> None:
    """A residual window's bf16 ring (and staging) as the launch's tail split, the pages ending where the
    ring begins, and sliding windows: kernel + reduce against dense attention over pages, ring and staging
    (split counts 1, 3 and the default; options: the launcher's)."""
    from moekv.ops.gluon.splits import quantized_tokens, tail_tokens

    lens = [1000, 777, 64 * 16, 65, 130, 5]
    Hkv, fmt, frag, tables, lens_t, k_pages, v_pages, q = gpu_case(build, G, lens, 30 + G)
    staged = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(R)
    ring = tuple((torch.randn(len(lens) + 1, Hkv, R, D, generator=g) + shift).to("cuda", torch.bfloat16)
                 for shift in (1.0, -1.0))
    cpu = lambda t: tuple(x.cpu() for x in t)  # noqa: E731

    def tokens(b, n):
        quantized = quantized_tokens(n, True, R)
        kt, vt = tail_tokens(cpu(staged), cpu(ring), b, quantized, n, torch.float64)
        return quantized, kt.transpose(0, 1), vt.transpose(0, 1)

    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, cpu(staged), window,
                          tokens, layer)
    for ns in (1, 3, None):
        out = attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, staged=staged, sliding_window=window,
                        residual=ring, **options)
        assert relative_error(out, ref) < 1e-2, ns


# (R, sliding window) of check_ring_partials' cases: nuq2's and vq's default rings, windows cutting into
# their tails, a ring shorter than a page (the tail's older tokens from staging)
RING_SPLIT_CASES = [(128, None), (256, None), (128, 100), (256, 200), (32, 64 * 5 + 3)]


def check_ring_partials(partials, attention, reference, build, G: int, R: int, window, **options) -> None:
    """A residual window's bf16 ring read by several tail programs (the launch's last tail_splits splits,
    each a contiguous share of the tail): the kernel's partials against the split reference's (float64) at
    the same page and tail split counts (the same empty splits, lse within 2e-2, merged within 3e-3), then
    kernel + reduce with sinks against the reference partials merged with them (within 1e-2). Lengths
    where the ring wraps (past R, not a multiple of it), shorter than R and than a page; tail splits 1
    to 16 (some shares empty); `window` may cut into the tail. options: the launcher's."""
    lens = [1000, 777, 64 * 16 + 3, max(R - 5, 1), 5]
    Hkv, _, frag, tables, lens_t, _, _, q = gpu_case(build, G, lens, 40 + G)
    staged = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(R)
    ring = tuple((torch.randn(len(lens) + 1, Hkv, R, D, generator=g) + shift).to("cuda", torch.bfloat16)
                 for shift in (1.0, -1.0))
    sinks = (torch.randn(Hkv * G, generator=g) * 3).to("cuda", torch.bfloat16)
    common = dict(staged=staged, sliding_window=window, residual=ring)
    for ns, ts in ((1, 1), (3, 4), (5, 8), (2, 16)):
        part_o, part_lse = partials(q, frag, tables, lens_t, D ** -0.5, ns, tail_splits=ts, **common, **options)
        ref_o, ref_lse = reference(q.double(), frag, tables, lens_t, D ** -0.5, ns, tail_splits=ts, **common)
        assert part_lse.shape[2] == ns + ts and ref_lse.shape[2] == ns + ts
        full = ref_lse > -float("inf")
        assert torch.equal(part_lse.isfinite(), full), ("empty splits must be -inf, others finite", ns, ts)
        assert (part_lse - ref_lse)[full].abs().max() < 2e-2, (ns, ts)
        merged = reduce_partials(ref_o, ref_lse)
        assert relative_error(reduce_partials(part_o.double(), part_lse.double()), merged) < 3e-3, (ns, ts)
        out = attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, tail_splits=ts, sinks=sinks, **common,
                        **options)
        assert relative_error(out, reduce_with_sinks(ref_o, ref_lse, sinks)) < 1e-2, (ns, ts)
