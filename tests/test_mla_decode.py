"""The absorbed MLA decode kernel (ops/decode/mla.py) against its float64 reference
(reference.mla_decode_ref over the latent format's gather), bf16 and fp8 latents; on the CPU under
Triton's interpreter at small shapes. Also the latent formats' write / gather round trip."""
from __future__ import annotations

import pytest
import torch

from moekv.context import Context
from moekv.kvcache.formats.latent import LatentFormat, LatentFP8Format
from moekv.ops.reference import (
    e4m3_round,
    fp8_latent_dequantize_ref,
    fp8_latent_quantize_ref,
    mla_decode_mma_ref,
    mla_decode_ref,
    mla_query_fp8_ref,
)
from tests.triton_kernels import INTERPRET, kernel_modules

(mla,) = kernel_modules("moekv.ops.decode.mla")
DEVICE = "cpu" if INTERPRET else "cuda"


def filled_cache(fmt, lengths: list[int], page: int, rank: int, rope: int, seed: int = 0):
    """A pool with each sequence's entries written through the format, pages in shuffled order.
    -> (cache, block_tables [B, max_pages] int32, context_lens [B] int32, entries per sequence fp32)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lengths]
    num_pages = sum(pages_per) + 1
    order = torch.randperm(num_pages, generator=gen).tolist()
    cache = fmt.allocate(num_pages, 1, page, rank + rope, torch.device(DEVICE), 4, torch.float32)
    tables = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32)
    entries = []
    for b, n in enumerate(lengths):
        table = [order.pop() for _ in range(pages_per[b])]
        tables[b, :len(table)] = torch.tensor(table)
        x = torch.randn(n, rank + rope, generator=gen)
        x[:, :rank] *= torch.rand(n, 1, generator=gen) * 3  # tokens of different magnitudes (per-token scales)
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // page] * page + pos % page
        ctx = Context(positions=pos, slot_mapping=slots.to(DEVICE), block_tables=tables, context_lens=None,
                      query_start_loc=None, logits_indices=None, seq_slots=None)
        fmt.write(cache, x.to(DEVICE), None, ctx)
        entries.append(x)
    return cache, tables.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE), entries


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_float64_reference(fmt_name, num_splits):
    """Heads not a multiple of the head block, contexts of 1 token to several pages, tiles across
    pages, splits with no tile: the kernel equals the float64 reference over what the format stores."""
    rank, rope, page, heads = 32, 8, 16, 5
    fmt = LatentFormat(torch.bfloat16, rank) if fmt_name == "bf16" else LatentFP8Format(rank)
    lengths = [1, 37, 70]
    cache, tables, lens, _ = filled_cache(fmt, lengths, page, rank, rope)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = (24 ** -0.5)
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16, block_n=16,
                         num_splits=num_splits)
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    assert out.shape == (len(lengths), heads, rank)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5 * ref.abs().max().item() + 1e-6, err


def test_formats_store_what_they_read_back():
    """bf16: the entries rounded to bf16; fp8: the latent within e4m3's half step of its token's
    scale, the rotary key in bf16; `stored` predicts gather exactly."""
    rank, rope, page = 32, 8, 16
    for fmt in (LatentFormat(torch.bfloat16, rank), LatentFP8Format(rank)):
        cache, tables, _, entries = filled_cache(fmt, [21], page, rank, rope, seed=3)
        back = fmt.gather(cache, tables[0].tolist(), 21, torch.float32).cpu()
        assert torch.equal(back, fmt.stored(entries[0]))
        assert torch.equal(back[:, rank:], entries[0][:, rank:].to(torch.bfloat16).float())
        err = (back[:, :rank] - entries[0][:, :rank]).abs()
        amax = entries[0][:, :rank].abs().amax(-1, keepdim=True)
        bound = amax / 448 * 16 if isinstance(fmt, LatentFP8Format) else amax / 128  # e4m3 step at 448; bf16 2**-8
        assert (err <= bound).all()


def test_fp8_latent_quantize_round_trip():
    """Per-token scales: each token's largest entry maps to +-448 and comes back to itself; an
    all-zero token gets scale 1 and zeros."""
    x = torch.randn(6, 64) * torch.tensor([0.01, 1, 10, 100, 1, 0.0])[:, None]
    codes, scales = fp8_latent_quantize_ref(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (6,)
    assert scales[5] == 1 and (fp8_latent_dequantize_ref(codes, scales)[5] == 0).all()
    back = fp8_latent_dequantize_ref(codes, scales)
    top = x.abs().argmax(-1)
    rows = torch.arange(5)
    torch.testing.assert_close(back[rows, top[:5]], x[rows, top[:5]], rtol=1e-6, atol=0)
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 16).all()


DEEPSEEK_RANK, DEEPSEEK_ROPE, DEEPSEEK_SCALE = 512, 64, 192 ** -0.5


def deepseek_decode(fmt, config):
    """DeepSeek-V3's entry (512 + 64), 128 heads, bf16 queries, pages of 64, sequences of 1, 700 and 3000
    tokens through the kernel with `config`: (its output, the queries, each sequence's stored entries in
    float64 on the device)."""
    lengths = [1, 700, 3000]
    cache, tables, lens, _ = filled_cache(fmt, lengths, 64, DEEPSEEK_RANK, DEEPSEEK_ROPE)
    q = torch.randn(len(lengths), 128, DEEPSEEK_RANK + DEEPSEEK_ROPE, generator=torch.Generator().manual_seed(1))
    q = (q.to(DEVICE) / 8).to(torch.bfloat16)
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, DEEPSEEK_SCALE, DEEPSEEK_RANK, config=config)
    return out, q, [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("config", [None, *sorted(n for n, c in mla.tuning()["configs"].items() if not c.fp8_mma)])
def test_kernel_at_deepseek_shape_matches_float64(fmt_name, config):
    """DeepSeek-V3's entry (512 + 64) and 128 heads, bf16 queries, pages of 64, the table's launch and
    each of its configs: within bf16's rounding of the probabilities of the float64 reference."""
    rank = DEEPSEEK_RANK
    fmt = LatentFormat(torch.bfloat16, rank) if fmt_name == "bf16" else LatentFP8Format(rank)
    out, q, stored = deepseek_decode(fmt, config)
    ref = mla_decode_ref(q.double(), stored, rank, DEEPSEEK_SCALE)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", sorted(n for n, c in mla.tuning()["configs"].items() if c.fp8_mma))
def test_fp8_mma_at_deepseek_shape_within_e4m3_rounding(config):
    """The table's fp8-MMA configs at DeepSeek-V3's entry (512 + 64) and 128 heads on the fp8 latent, the
    table's splits: within test_fp8_mma_within_e4m3_rounding_of_float64's bound of the float64 reference
    with the queries rounded as the kernel rounds them."""
    rank = DEEPSEEK_RANK
    fmt = LatentFP8Format(rank)
    out, q, stored = deepseek_decode(fmt, config)
    stored = [entries.cpu() for entries in stored]
    codes, q_scales = mla_query_fp8_ref(q[..., :rank].cpu())
    q_rounded = torch.cat([codes.double() * q_scales.double()[..., None], q[..., rank:].double().cpu()], -1)
    ref = mla_decode_ref(q_rounded, stored, rank, DEEPSEEK_SCALE)
    for b, entries in enumerate(stored):
        vmax = entries[:, :rank].abs().max().item()
        bound = (2 ** -4 + 2 ** -9) * vmax + entries.shape[0] * 2 ** -10 * fmt.token_scales(entries).max().item()
        err = (out[b].double().cpu() - ref[b]).abs().max().item()
        assert err <= bound, (b, err, bound)


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_transposed_scores_match_float64_reference(fmt_name, num_splits):
    """The kernel's transposed form (config.swap: scores as [tokens, heads], P transposed into the value
    product) equals the float64 reference as the plain form does: heads not a multiple of the block,
    1 token to several pages, splits with no tile."""
    rank, rope, page, heads = 32, 8, 16, 5
    fmt = LatentFormat(torch.bfloat16, rank) if fmt_name == "bf16" else LatentFP8Format(rank)
    lengths = [1, 37, 70]
    cache, tables, lens, _ = filled_cache(fmt, lengths, page, rank, rope, seed=4)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    scale = 24 ** -0.5
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16,
                         num_splits=num_splits, config=mla.MLAConfig(16, 4, 1, True))
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5 * ref.abs().max().item() + 1e-6, err


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("swap", [False, True])
def test_bf16_queries_within_the_probabilities_rounding(fmt_name, swap):
    """bf16 queries, as the engine's decode passes them: the kernel rounds P to bf16 for the value
    product (fp8: after the token's scale is folded in) while the normaliser sums the unrounded P, so an
    output is off by at most one bf16 rounding of the largest |value| it averages; the scores are bf16
    products summed in fp32, and the output's own rounding to bf16 adds one rounding of |out|. A bf16
    rounding is 2^-9 relative on the GPU (to nearest) and under 2^-8 under Triton 3.6's interpreter
    (which truncates), so the bound is two roundings of max |stored latent| per sequence; a kernel that
    dropped a tile or mixed two sequences' entries is off by O(1)."""
    rank, rope, page, heads = 32, 16, 16, 6
    fmt = LatentFormat(torch.bfloat16, rank) if fmt_name == "bf16" else LatentFP8Format(rank)
    lengths = [5, 50, 96]
    cache, tables, lens, _ = filled_cache(fmt, lengths, page, rank, rope, seed=5)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(3))
    q = q.to(torch.bfloat16).to(DEVICE)
    scale = 48 ** -0.5
    config = mla.MLAConfig(32 if swap else 16, 4, 2, swap)
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16, num_splits=2,
                         config=config)
    assert out.dtype == torch.bfloat16
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    for b, entries in enumerate(stored):
        bound = 2 * (2 ** -8 if INTERPRET else 2 ** -9) * entries[:, :rank].abs().max().item()
        err = (out[b].double() - ref[b]).abs().max().item()
        assert err <= bound, (b, err, bound)


def fp8_mma_case(seed: int):
    """An fp8 latent of 3 sequences (5 to 96 entries over 16-entry pages), 6 heads of bf16 queries.
    -> (fmt, cache, tables, lens, q, stored entries float64 per sequence, scale)."""
    rank, rope, page, heads = 32, 16, 16, 6
    fmt = LatentFP8Format(rank)
    lengths = [5, 50, 96]
    cache, tables, lens, _ = filled_cache(fmt, lengths, page, rank, rope, seed=seed)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(seed + 1))
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    return fmt, cache, tables, lens, q.to(torch.bfloat16).to(DEVICE), stored, 48 ** -0.5


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_mma_matches_its_float64_emulation(swap):
    """The kernel's fp8-MMA form (queries and probabilities in e4m3) against reference.mla_decode_mma_ref
    computed in float64 with the same tile (one split): what differs is the bf16 rounding of the output
    (2^-9 relative to nearest on the GPU, under 2^-8 under the interpreter, which truncates) and e4m3
    roundings that fall the other way at a near-tie between fp32 and float64 (one step of one element:
    under 2^-9 of max |value| here). A probability left unrounded, a scale not folded back or a tile
    dropped is off by more than 1% (their distance from the exact reference, test below)."""
    fmt, cache, tables, lens, q, stored, scale = fp8_mma_case(seed=5)
    rank = fmt.kv_lora_rank
    block_n = 32 if swap else 16
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16, num_splits=1,
                         config=mla.MLAConfig(block_n, 4, 2, swap, True))
    assert out.dtype == torch.bfloat16
    for b, entries in enumerate(stored):
        emulated = mla_decode_mma_ref(q[b].double().cpu(), entries, rank, scale, "fp8", fmt.token_scales(entries),
                                      block_n=block_n)
        vmax = entries[:, :rank].abs().max().item()
        bound = ((2 ** -8 if INTERPRET else 2 ** -9) + 2 ** -9) * vmax
        err = (out[b].double().cpu() - emulated).abs().max().item()
        assert err <= bound, (b, err, bound)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_mma_within_e4m3_rounding_of_float64(num_splits):
    """Against the float64 reference over the stored entries with the queries rounded as the kernel
    rounds them (torch's e4m3 of q_lat / (amax / 448) per head): each probability times its token's
    scale is rounded to e4m3 at 448 / (the tile's largest token scale), within 2^-4 of itself as a
    normal number or 2^-10 of a step of 448 as a subnormal, and the normaliser sums the unrounded ones,
    so an output is within 2^-4 of max |value| plus length x 2^-10 x max token scale, plus its own
    bf16 rounding; splits merge exactly (fp32 partials). Without the rounded queries in the reference
    the same outputs are off by more (the score error of e4m3 queries), so that part is checked apart."""
    fmt, cache, tables, lens, q, stored, scale = fp8_mma_case(seed=7)
    rank = fmt.kv_lora_rank
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank, block_h=16,
                         num_splits=num_splits, config=mla.MLAConfig(16, 4, 2, False, True))
    codes, q_scales = mla_query_fp8_ref(q[..., :rank].cpu())
    q_rounded = torch.cat([codes.double() * q_scales.double()[..., None], q[..., rank:].double().cpu()], -1)
    ref = mla_decode_ref(q_rounded, stored, rank, scale)
    exact = mla_decode_ref(q.double().cpu(), stored, rank, scale)
    for b, entries in enumerate(stored):
        vmax = entries[:, :rank].abs().max().item()
        smax = fmt.token_scales(entries).max().item()
        bound = 2 ** -4 * vmax + entries.shape[0] * 2 ** -10 * smax + (2 ** -8 if INTERPRET else 2 ** -9) * vmax
        err = (out[b].double().cpu() - ref[b]).abs().max().item()
        assert err <= bound, (b, err, bound)
        assert (exact[b] - ref[b]).abs().max().item() > 1e-3 * vmax  # the queries' rounding is seen


def test_fp8_mma_takes_the_fp8_latent_only():
    fmt = LatentFormat(torch.bfloat16, 32)
    cache, tables, lens, _ = filled_cache(fmt, [20], 16, 32, 16)
    q = torch.randn(1, 4, 48).to(DEVICE)
    with pytest.raises(ValueError, match="fp8 MMAs"):
        mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, 0.1, 32, fp8_mma=True)


def test_decode_mma_emulation_rounds_what_it_names():
    """reference.mla_decode_mma_ref: 'auto' is the exact reference in any tiling; 'bf16' within bf16's
    rounding of it; the fp8 forms further off, the probabilities' e4m3 rounding seen only when they are
    rounded; an all-padding-free single tile and a ragged last tile alike."""
    gen = torch.Generator().manual_seed(11)
    rank, heads = 32, 4
    q = torch.randn(heads, rank + 8, generator=gen, dtype=torch.float64)
    entries = torch.randn(70, rank + 8, generator=gen, dtype=torch.float64)
    exact = mla_decode_ref(q[None], [entries], rank, 0.2)[0]
    for block_n in (16, 128):
        assert torch.allclose(mla_decode_mma_ref(q, entries, rank, 0.2, "auto", block_n=block_n), exact,
                              atol=1e-12, rtol=0)
    vmax = entries[:, :rank].abs().max().item()
    errors = {mma: (mla_decode_mma_ref(q, entries, rank, 0.2, mma) - exact).abs().max().item() / vmax
              for mma in ("bf16", "fp8_queries", "fp8_probs", "fp8")}
    assert 0 < errors["bf16"] < 2 ** -6
    assert all(errors[m] > 2 * errors["bf16"] for m in ("fp8_queries", "fp8_probs", "fp8"))
    # queries: e4m3 of q_lat / (amax / 448), each head's largest element kept exactly
    codes, scales = mla_query_fp8_ref(q[:, :rank])
    back = codes.double() * scales[:, None]
    top = q[:, :rank].abs().argmax(-1)
    torch.testing.assert_close(back[torch.arange(heads), top], q[torch.arange(heads), top], rtol=1e-6, atol=0)
    assert torch.equal(e4m3_round(torch.tensor([1.98, 0.49, 500.0, -1e-4])), torch.tensor([2.0, 0.5, 448.0, -0.0]))


@pytest.mark.parametrize("batch,context", [(1, 4096), (4, 4096), (16, 32768), (64, 32768), (7, 1000)])
def test_splits_fill_the_last_wave_at_least_as_well_as_twice_the_sms(batch, context):
    """num_splits_for's count (chosen among half the two-wave target up to it) keeps the last wave of
    programs at least as full as the plain two-wave count would, and every split gets two tiles."""
    sms, head_blocks, block_n = 132, 2, 64
    pairs = batch * head_blocks
    tiles = -(-context // block_n)
    splits = mla.num_splits_for(batch, head_blocks, context, block_n, sms)
    plain = max(1, min(-(-2 * sms // pairs), -(-tiles // 2), 64))

    def fill(s):
        return pairs * s / (-(-pairs * s // sms) * sms)

    assert 1 <= splits <= max(plain, 1) and -(-tiles // splits) >= min(2, tiles)
    assert fill(splits) >= fill(plain) - 1e-9
    assert mla.num_splits_for(batch, head_blocks, context, block_n, None) == min(tiles, 4)


def test_launch_table_names_its_configs_and_picks_the_larger_tile_when_it_fills_the_gpu(monkeypatch):
    """Every format's preference list names configs of the table; the first of a list (here 64-token
    tiles) is taken where its tiles still give two waves of programs two tiles each, the last otherwise
    (and for programs of fewer than 64 heads). The rule is checked on a two-entry list, whatever the
    shipped table prefers."""
    table = mla.tuning()
    for storage, names in table["formats"].items():
        assert names and all(n in table["configs"] for n in names), storage
    table["formats"]["16bit"] = ["n64", "v1"]
    monkeypatch.setattr(mla, "tuning", lambda device_name=None: table)
    first, last = table["configs"]["n64"], table["configs"]["v1"]
    assert first != last
    assert mla.launch_for("16bit", 512, 64, 2, 32768, 132) == first
    assert mla.launch_for("16bit", 512, 1, 2, 4096, 132) == last
    assert mla.launch_for("16bit", 512, 64, 8, 32768, 132, block_h=16) == last  # the table is for 64-head programs
    assert mla.launch_for("16bit", 64, 64, 2, 32768, 132) == mla.SMALL_LATENT
    with pytest.raises(ValueError, match="no launch config"):
        mla.named_config("no-such-config")
