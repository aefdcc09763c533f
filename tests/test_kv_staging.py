"""The vectorized decode write (a step that fills no page: one indexed copy, no host sync, so it
can be captured in a CUDA graph) stores exactly what the general staging loop stores."""
from __future__ import annotations

import pytest
import torch

from moekv.context import Context
from moekv.kvcache.formats import get_kv_format


def decode_ctx(context_lens, slots, block_size, fills_no_page):
    B = len(context_lens)
    pages = max(-(-n // block_size) for n in context_lens)
    return Context(
        positions=torch.tensor([n - 1 for n in context_lens]),
        slot_mapping=torch.zeros(B, dtype=torch.long),  # unused by staged formats
        block_tables=torch.arange(B * pages, dtype=torch.int32).reshape(B, pages),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
        logits_indices=torch.arange(B),
        seq_slots=torch.tensor(slots),
        max_query_len=1,
        fills_no_page=fills_no_page,
    )


@pytest.mark.parametrize("name", ["int4", "nuq2", "kivi2"])
def test_vectorized_decode_write_matches_the_loop(name):
    fmt = get_kv_format(name, torch.float32, residual=64)
    H, P, D = 2, 64, 32
    caches = [fmt.allocate(16, H, P, D, torch.device("cpu"), 4, torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    context_lens, slots = [5, 70, 130], [2, 0, 3]  # none lands on a page boundary
    for _ in range(3):  # a few steps, each appending one token per sequence
        k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
        for cache, vectorized in zip(caches, (False, True)):
            fmt.write(cache, k, v, decode_ctx(context_lens, slots, P, fills_no_page=vectorized))
        context_lens = [n + 1 for n in context_lens]
    for key in caches[0].tensors:
        assert torch.equal(caches[0][key], caches[1][key]), key
    assert caches[1]["k_staging"].abs().sum() > 0  # something was written
