"""What each KV format lets the engine replay from CUDA graphs (GraphSupport, one value per format)
and which formats keep host-side state around a replay (the GraphStepHooks opt-in)."""
from __future__ import annotations

import pytest
import torch

from moekv.engine.cuda_graphs import graphs_unsupported_reason, step_fits_graph
from moekv.kvcache.formats import (
    KV_FORMAT_NAMES,
    GraphStepHooks,
    GraphSupport,
    compressed_formats,
    format_class,
    get_kv_format,
)
from moekv.kvcache.formats.plain import PlainKVFormat
from moekv.kvcache.formats.vq import random_calibration

CUDA = torch.device("cuda")


def test_each_value_says_what_is_replayed():
    table = {(s.replays_decode, s.replays_fills, s.lists_fills): s for s in GraphSupport}
    assert table == {(False, False, False): GraphSupport.EAGER_ONLY,
                     (True, False, False): GraphSupport.DECODE_WITHOUT_FILLS,
                     (True, True, False): GraphSupport.DECODE_WITH_FILLS,
                     (True, True, True): GraphSupport.DECODE_WITH_LISTED_FILLS}


@pytest.mark.parametrize("name", KV_FORMAT_NAMES)
def test_the_registered_formats(name, tmp_path):
    options = {"calibration": random_calibration(tmp_path, 2, 32)} if format_class(name).needs_calibration else {}
    fmt = get_kv_format(name, torch.bfloat16, **options)
    plain = name not in compressed_formats()
    assert fmt.graph_support is (GraphSupport.DECODE_WITH_FILLS if plain else GraphSupport.DECODE_WITH_LISTED_FILLS)
    assert isinstance(fmt, GraphStepHooks) == (name == "tiered")  # the only format with host-side page state


class _EagerPlain(PlainKVFormat):
    graph_support = GraphSupport.EAGER_ONLY


class _NoFillsPlain(PlainKVFormat):
    graph_support = GraphSupport.DECODE_WITHOUT_FILLS


def test_an_eager_only_format_never_gets_graphs():
    reason = graphs_unsupported_reason(CUDA, False, _EagerPlain(torch.bfloat16), torch.bfloat16, 16, 32)
    assert "runs decode steps eagerly" in reason and "EAGER_ONLY" in reason
    assert graphs_unsupported_reason(CUDA, False, _NoFillsPlain(torch.bfloat16), torch.bfloat16, 16, 32) is None


def test_page_filling_steps_replay_only_where_the_format_says():
    fills = dict(num_tokens=[1, 1], context_lens=[5, 32], logits_rows=[0, 1], block_size=16, max_batch=4)
    assert not step_fits_graph(**fills, fills_ok=_NoFillsPlain(torch.bfloat16).graph_support.replays_fills)
    assert step_fits_graph(**fills, fills_ok=PlainKVFormat(torch.bfloat16).graph_support.replays_fills)


def test_graph_step_hooks_are_all_or_nothing():
    class HalfHooked(PlainKVFormat, GraphStepHooks):
        def after_graph_replay(self, caches):
            pass

    with pytest.raises(TypeError, match="prepare_graph_step"):
        HalfHooked(torch.bfloat16)
