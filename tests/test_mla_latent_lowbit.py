"""The low-bit latent caches (kvcache/formats/latent_lowbit.py): int4 (per-token groups) and the 2-bit
latents (kivi2: KIVI's per-channel recipe, nuq2: per channel with a Gaussian codebook; each with a
16-bit window of the newest entries; the per-token grouping too). Round trips, bits counted byte by
byte, absorbed attention against float64 attention over what the format reads back, the int4 Triton
decode kernel under the interpreter, the engine on a tiny DeepSeek-V3 checkpoint with each format."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.context import Context, HostLists
from moekv.kvcache.formats.latent_choice import latent_format_for
from moekv.kvcache.formats.latent_lowbit import Latent2BitFormat, LatentInt4Format
from moekv.ops.reference import (
    LATENT_2BIT_LEVELS,
    latent_2bit_dequantize_ref,
    latent_2bit_quantize_ref,
    latent_int4_dequantize_ref,
    latent_int4_quantize_ref,
    mla_decode_ref,
)
from tests.checkpoints import build_deepseek_checkpoint
from tests.triton_kernels import INTERPRET, kernel_modules

(mla,) = kernel_modules("moekv.ops.decode.mla")
DEVICE = "cpu" if INTERPRET else "cuda"
LOW_BIT = {"int4": {}, "kivi2": {"residual": 32}, "nuq2": {"residual": 32}}
# the per-token 2-bit grouping no engine name takes (measured against the per-channel one), without a window too
TOKEN_2BIT = {"token_gaussian_w32": ("gaussian", 32), "token_uniform_w0": ("uniform", 0)}


def make(name: str, rank: int):
    if name in TOKEN_2BIT:
        codebook, window = TOKEN_2BIT[name]
        return Latent2BitFormat(rank, name, "token", codebook, 32, window)
    return latent_format_for(name, torch.float32, rank, LOW_BIT[name])


def step_context(lengths_before: list[int], counts: list[int], tables: list[list[int]], page: int,
                 device=DEVICE) -> Context:
    """A step writing counts[b] tokens of sequence b (seq slot b) after its lengths_before[b]."""
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(lengths_before, counts)])
    table_of = torch.cat([torch.full((n,), b) for b, n in enumerate(counts)])
    padded = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for b, table in enumerate(tables):
        padded[b, :len(table)] = torch.tensor(table)
    slots = padded[table_of, pos // page].long() * page + pos % page
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    ends = [a + n for a, n in zip(lengths_before, counts)]
    return Context(positions=pos.to(device), slot_mapping=slots.to(device), block_tables=padded.to(device),
                   context_lens=torch.tensor(ends, dtype=torch.int32, device=device),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device), logits_indices=None,
                   seq_slots=torch.arange(len(counts), device=device), max_query_len=max(counts),
                   host=HostLists(ends, starts, list(range(len(counts))), [list(t) for t in tables]))


def filled(fmt, lengths: list[int], page: int, rank: int, rope: int, chunks=(7, 1, 1, 40), seed: int = 0,
           bf16_values: bool = False):
    """Each sequence written through the format in prefill chunks and decode steps (`chunks` cycled),
    pages shuffled. -> (cache, tables [B, max_pages] int32, lens [B] int32, entries per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(pages_per) + 1, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in pages_per]
    cache = fmt.allocate(sum(pages_per) + 1, 1, page, rank + rope, torch.device(DEVICE), len(lengths), torch.float32)
    entries = []
    for n in lengths:
        x = torch.randn(n, rank + rope, generator=gen)
        x[:, :rank] *= torch.rand(n, 1, generator=gen) * 2 + 0.5  # tokens of different magnitudes
        x[:, :rank] *= torch.linspace(0.2, 3, rank)  # and channels (kv_a_layernorm's weight)
        entries.append(x.to(torch.bfloat16).float() if bf16_values else x)
    done, c = [0] * len(lengths), 0
    while any(d < n for d, n in zip(done, lengths)):
        counts = [min(chunks[c % len(chunks)], n - d) for d, n in zip(done, lengths)]
        c += 1
        active = [b for b, k in enumerate(counts) if k > 0]
        ctx = step_context(done, counts, tables, page)
        if len(active) == len(lengths):
            fmt.write(cache, torch.cat([entries[b][done[b]:done[b] + counts[b]] for b in active]).to(DEVICE), None,
                      ctx)
        else:  # a sequence done: the others' step alone (empty rows are not a step the engine makes)
            for b in active:
                one = step_context([done[b]], [counts[b]], [tables[b]], page)
                one.seq_slots = torch.tensor([b], device=DEVICE)
                one.host = HostLists(one.host.context_lens, one.host.query_start, [b], one.host.block_tables)
                fmt.write(cache, entries[b][done[b]:done[b] + counts[b]].to(DEVICE), None, one)
        done = [d + k for d, k in zip(done, counts)]
    padded = torch.zeros(len(tables), max(pages_per), dtype=torch.int32)
    for b, table in enumerate(tables):
        padded[b, :len(table)] = torch.tensor(table)
    return cache, padded.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE), entries


def test_int4_latent_quantize_round_trip():
    """Per (token, group): the group's minimum and maximum come back exactly (fp16-representable
    here), every element within half a step; a constant group decodes to itself."""
    x = (torch.randn(5, 64) * 8).to(torch.float16).float()
    x[4, :32] = 1.5
    codes, scale, zero = latent_int4_quantize_ref(x, 32)
    assert codes.shape == (5, 32) and scale.shape == zero.shape == (5, 2) and scale.dtype == torch.float16
    back = latent_int4_dequantize_ref(codes, scale, zero)
    groups, back_groups = x.view(5, 2, 32), back.view(5, 2, 32)
    torch.testing.assert_close(back_groups.amin(-1), groups.amin(-1), rtol=0, atol=0)
    assert ((back_groups - groups).abs() <= scale.float()[..., None] / 2 * (1 + 1e-3) + 1e-6).all()
    assert (back[4, :32] == 1.5).all()


@pytest.mark.parametrize("codebook", ["uniform", "gaussian"])
def test_2bit_quantize_codes_nearest_level(codebook):
    """Each element takes the level nearest it on its group's grid; uniform reproduces min and max;
    a mask keeps unwritten rows out of the statistics; a constant slice decodes to its value."""
    x = torch.randn(3, 32, 16)
    x[2, :, 0] = -0.75
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 20:] = False
    x[1, 20:] = 1e4  # unwritten rows: huge, but masked out of the grid
    codes, offset, step = latent_2bit_quantize_ref(x, -2, codebook, mask)
    assert codes.max() <= 3 and offset.shape == step.shape == (3, 16)
    back = latent_2bit_dequantize_ref(codes, offset, step, -2, codebook)
    assert step[1].float().max() < 10  # the masked rows did not stretch the grid
    levels = torch.tensor(LATENT_2BIT_LEVELS[codebook])
    grid = offset.float() + step.float() * levels.view(4, 1, 1)  # [4, 3, 16]
    nearest = (x[None] - grid[:, :, None]).abs().argmin(0)  # [3, 32, 16]
    graded = mask & (step > 0)[:, None, :]  # a constant slice's levels all tie
    assert (nearest[graded] == codes.long()[graded]).float().mean() > 0.999  # fp16 rounding ties aside
    if codebook == "uniform":
        torch.testing.assert_close(back[0].amax(0), x[0].amax(0), rtol=2e-3, atol=2e-3)
    assert torch.allclose(back[2, :, 0], torch.tensor(-0.75))


@pytest.mark.parametrize("name", [*LOW_BIT, *TOKEN_2BIT])
def test_formats_store_what_they_read_back(name):
    """Written in prefill chunks and decode steps: the pages read back exactly what `stored`
    predicts (values bf16-representable, so the window's rounding changes nothing), the rotary key
    in bf16, the window's entries (with seq_slot) as written; the latent error is a 4- or 2-bit one."""
    rank, rope, page = 64, 16, 32
    fmt = make(name, rank)
    cache, tables, _, entries = filled(fmt, [70, 45], page, rank, rope, bf16_values=True)
    for b, x in enumerate(entries):
        n = x.shape[0]
        pages_only = fmt.gather(cache, tables[b].tolist(), n, torch.float32).cpu()
        assert torch.equal(pages_only, fmt.stored(x)), name
        assert torch.equal(pages_only[:, rank:], x[:, rank:])
        with_window = fmt.gather(cache, tables[b].tolist(), n, torch.float32, b, n).cpu()
        window = getattr(fmt, "residual", 0)
        assert torch.equal(with_window[n - window:], x[n - window:]) if window else torch.equal(with_window, pages_only)
        assert torch.equal(with_window[:n - window], pages_only[:n - window])
        rel = ((pages_only - x)[:, :rank].norm() / x[:, :rank].norm()).item()
        assert (rel < 0.12) if name == "int4" else (0.2 < rel < 0.6), (name, rel)


def test_kivi2_latent_window_must_hold_a_group_and_names_take_their_options():
    with pytest.raises(ValueError, match="multiple of group_size"):
        latent_format_for("kivi2", torch.float32, 64, {"residual": 0})
    with pytest.raises(ValueError, match="takes.*not kv_outlier_sigma"):
        latent_format_for("nuq2", torch.float32, 64, {"outlier_sigma": 2.0})
    assert latent_format_for("int4", torch.float32, 64, {"group_size": 64}).group == 64
    with pytest.raises(ValueError, match="not a multiple of group_size=64"):
        latent_format_for("int4", torch.float32, 32, {"group_size": 64})
    kivi = latent_format_for("kivi2", torch.float32, 64, {"group_size": 64, "residual": 128})
    assert (kivi.grouping, kivi.codebook, kivi.group, kivi.residual) == ("channel", "uniform", 64, 128)
    nuq = latent_format_for("nuq2", torch.float32, 64, {"residual": None})
    assert (nuq.grouping, nuq.codebook, nuq.residual) == ("channel", "gaussian", 128)
    assert kivi.prefix_caching_unsupported() and nuq.prefix_caching_unsupported()
    with pytest.raises(ValueError, match="multiple of group_size"):
        latent_format_for("nuq2", torch.float32, 64, {"residual": 0})
    assert Latent2BitFormat(64, "x", "token", "uniform", 32, 0).prefix_caching_unsupported() is None


def test_bits_per_element_count_every_byte():
    """DeepSeek's entry (512 + 64), pages of 64: int4 G=32 256 + 64 + 128 = 448 bytes a token (6.22
    bits), G=64 416 (5.78); 2-bit 128 + 64 + 128 = 320 (4.44) plus the window's 128 x 576 x 2 bytes
    spread over the context."""
    W, P = 576, 64
    assert LatentInt4Format(512, 32).page_bytes(1, P, W) == 448 * P
    assert LatentInt4Format(512, 64).page_bytes(1, P, W) == 416 * P
    assert LatentInt4Format(512, 32).bits_per_element(1, P, W) == pytest.approx(448 * 8 / W)
    for grouping in ("token", "channel"):
        fmt = Latent2BitFormat(512, "x", grouping, "uniform", 32, 128)
        assert fmt.page_bytes(1, P, W) == 320 * P
        assert fmt.bits_per_element_at(4096, 1, P, W) == pytest.approx((4096 * 320 + 128 * W * 2) * 8 / (4096 * W))
    assert Latent2BitFormat(512, "x", "token", "gaussian", 32, 0).bits_per_element_at(100, 1, P, W) == pytest.approx(
        2 * P * 320 * 8 / (100 * W))


@pytest.mark.parametrize("name", [*LOW_BIT, *TOKEN_2BIT])
def test_attend_reference_matches_float64(name):
    """Absorbed decode through the format's attend (the reference path on the CPU) equals float64
    attention over what the format reads back (the window included)."""
    rank, rope, page, heads = 64, 16, 32, 3
    fmt = make(name, rank)
    lengths = [70, 45]
    cache, tables, lens, _ = filled(fmt, lengths, page, rank, rope, seed=2)
    tables_host = [[t for t in row.tolist()][:-(-n // page)] for row, n in zip(tables, lengths)]
    ctx = Context(positions=torch.tensor([n - 1 for n in lengths]), slot_mapping=None, block_tables=tables,
                  context_lens=lens, query_start_loc=torch.tensor([0, 1, 2]), logits_indices=None,
                  seq_slots=torch.arange(2), max_query_len=1, host=HostLists(lengths, [0, 1, 2], [0, 1], tables_host))
    q = torch.randn(2, heads, rank + rope, generator=torch.Generator().manual_seed(5))
    scale = 0.2
    out = fmt.attend(q, cache, ctx, scale, None)
    stored = [fmt.gather(cache, tables_host[b], n, torch.float64, b, n) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    if getattr(fmt, "residual", 0):  # the window is read: pages alone would give another answer
        pages_only = [fmt.gather(cache, tables_host[b], n, torch.float64) for b, n in enumerate(lengths)]
        assert (mla_decode_ref(q.double(), pages_only, rank, scale) - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_int4_kernel_matches_float64_reference(group, num_splits):
    """The int4 latent's Triton kernel (interpreter on the CPU): heads not a multiple of the head
    block, 1 token to several pages, splits with no tile, against float64 over the dequantized latent."""
    rank, rope, page, heads = 64, 8, 16, 5
    fmt = LatentInt4Format(rank, group)
    lengths = [1, 37, 70]
    cache, tables, lens, _ = filled(fmt, lengths, page, rank, rope)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = 24 ** -0.5
    assert fmt.fused_decode_unavailable(page, rank + rope) is None
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16, block_n=16,
                         num_splits=num_splits)
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5 * ref.abs().max().item() + 1e-6, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("config", [None, *sorted(n for n, c in mla.tuning()["configs"].items() if not c.swap)])
def test_int4_kernel_at_deepseek_shape_matches_float64(group, config):
    """DeepSeek-V3's entry (512 + 64) and 128 heads, bf16 queries, pages of 64, the table's launch and
    each of its configs the int4 kernel takes."""
    rank, rope, page, heads = 512, 64, 64, 128
    fmt = LatentInt4Format(rank, group)
    lengths = [1, 700, 3000]
    cache, tables, lens, _ = filled(fmt, lengths, page, rank, rope, chunks=(1000,))
    q = (torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(1)) / 8)
    q = q.to(DEVICE).to(torch.bfloat16)
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, 192 ** -0.5, rank, config=config)
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, 192 ** -0.5)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    return build_deepseek_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3"), q_lora_rank=None)


@pytest.mark.parametrize("kv_cache_dtype,options", [("int4", {}), ("kivi2", {"kv_residual": 32}),
                                                     ("nuq2", {"kv_residual": 32}), ("nuq2", {})])
def test_engine_serves_a_v3_checkpoint_with_each_format(v3_checkpoint, kv_cache_dtype, options):
    """The engine on a tiny V3 checkpoint (kv_lora_rank 32): next-token distributions near the fp32
    cache's (a chunked prompt reads its earlier chunks from the low-bit pages; the random model's
    largest logit errors are fp8's size too, so the bound is on the KL divergence: fp8 0.010,
    int4 0.012, kivi2 0.022 measured), greedy decode runs past a page, every page back."""
    prompt = [{"prompt_token_ids": [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14] * 3}]
    kwargs = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=32)
    exact = LLM(v3_checkpoint, **kwargs).score(prompt)[0]
    llm = LLM(v3_checkpoint, kv_cache_dtype=kv_cache_dtype, **kwargs, **options)
    fmt = llm.engine.runner.kv_format
    assert fmt.name == kv_cache_dtype
    approx = llm.score(prompt)[0]
    kl = (exact.softmax(-1) * (exact.log_softmax(-1) - approx.log_softmax(-1))).sum(-1)
    assert kl[:16].max().item() < 1e-9  # the first chunk attends to itself as computed
    if options.get("kv_residual", 0 if kv_cache_dtype == "int4" else 128) >= len(prompt[0]["prompt_token_ids"]):
        assert kl[16:].mean().item() < 1e-5  # the 16-bit window (default 128) holds the whole context
    else:
        assert 1e-4 < kl[16:].mean().item() < 0.2, kl[16:].mean().item()  # quantized, not broken
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 20
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
