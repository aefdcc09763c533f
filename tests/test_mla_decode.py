"""The absorbed MLA decode kernel (ops/decode/mla.py) against its float64 reference
(reference.mla_decode_ref over the latent format's gather), bf16 and fp8 latents; on the CPU under
Triton's interpreter at small shapes. Also the latent formats' write / gather round trip."""
from __future__ import annotations

import pytest
import torch

from moekv.context import Context
from moekv.kvcache.formats.latent import LatentFormat, LatentFP8Format
from moekv.ops.reference import fp8_latent_dequantize_ref, fp8_latent_quantize_ref, mla_decode_ref
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3"])
def test_kernel_at_deepseek_shape_matches_float64(fmt_name):
    """DeepSeek-V3's entry (512 + 64) and 128 heads, bf16 queries, pages of 64, the default launch:
    within bf16's rounding of the probabilities of the float64 reference."""
    rank, rope, page, heads = 512, 64, 64, 128
    fmt = LatentFormat(torch.bfloat16, rank) if fmt_name == "bf16" else LatentFP8Format(rank)
    lengths = [1, 700, 3000]
    cache, tables, lens, _ = filled_cache(fmt, lengths, page, rank, rope)
    q = torch.randn(len(lengths), heads, rank + rope, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = (q / 8).to(torch.bfloat16)
    scale = 192 ** -0.5
    out = mla.mla_decode(q, fmt.kernel_tensors(cache), tables, lens, scale, rank)
    stored = [fmt.gather(cache, tables[b].tolist(), n, torch.float64) for b, n in enumerate(lengths)]
    ref = mla_decode_ref(q.double(), stored, rank, scale)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err
