"""benchmarks/quality/hf_quantized_cache_ppl.py's bits accounting (against a hand computation and
against what transformers' quantized cache layers hold), its decode-tail windows, and
plot_kv_tradeoff.py's reading of result records."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quality"))

import hf_quantized_cache_ppl as peers  # noqa: E402
import plot_kv_tradeoff as tradeoff  # noqa: E402


def test_peer_bits_by_hand():
    # int2, groups of 32 with a 16-bit scale and zero: 3 bits; 127 window tokens at 16 bits
    assert peers.peer_bits_per_element(2, 32, 4096, 127) == pytest.approx(((4096 - 127) * 3 + 127 * 16) / 4096)
    assert peers.peer_bits_per_element(4, 64, 32768, 0) == pytest.approx(4.5)
    assert peers.peer_bits_per_element(2, 32, 100, 100) == pytest.approx(16.0)
    assert peers.peer_bits_per_element(2, 32, 1000, 0, param_bits=32) == pytest.approx(4.0)


def test_window_and_bits_record():
    assert peers.window_tokens_held(128) == 127
    spec = {"backend": "quanto", "nbits": 2, "q_group_size": 32, "residual_length": 128}
    rec = peers.bits_record(spec, [64, 4096])
    assert rec["64"] == pytest.approx(16.0)  # a context shorter than the window is all window
    assert rec["4096"] == pytest.approx(peers.peer_bits_per_element(2, 32, 4096, 127))
    assert peers.bits_record({"backend": None}, [4096]) == {"4096": 16.0}


@pytest.mark.parametrize("args", [(0, 32, 10, 0), (2, 0, 10, 0), (2, 32, 0, 0), (2, 32, 10, 11), (2, 32, 10, -1)])
def test_bad_bits_arguments_are_refused(args):
    with pytest.raises(ValueError):
        peers.peer_bits_per_element(*args)
    with pytest.raises(ValueError):
        peers.window_tokens_held(0)


def test_tail_windows_are_the_first_non_overlapping_windows_of_each_domain():
    ids = {"a": list(range(10)), "b": list(range(100, 105))}
    out = peers.tail_windows(ids, 4, 2)
    assert out == [("a", [0, 1, 2, 3]), ("a", [4, 5, 6, 7]), ("b", [100, 101, 102, 103])]


@pytest.mark.parametrize("backend, module", [("quanto", "optimum.quanto"), ("hqq", "hqq")])
def test_stored_bits_match_what_the_cache_layer_holds(backend, module):
    pytest.importorskip(module, reason=f"the {backend} backend needs {module} (pip install -e .[peers])")
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[backend]
    axis = peers.BACKEND_AXIS[backend]
    torch.manual_seed(0)
    for nbits in (2, 4):
        layer = cls(nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=32, residual_length=16)
        b, h, d = 2, 2, 64
        layer.update(torch.randn(b, h, 96, d), torch.randn(b, h, 96, d))  # the prefill: all quantized
        for _ in range(5):  # five tokens in the float32 window
            layer.update(torch.randn(b, h, 1, d), torch.randn(b, h, 1, d))
        assert layer.keys.shape[-2] == 5
        expected = peers.peer_bits_per_element(nbits, 32, 101, 5, param_bits=32, window_bits=32)
        assert peers.stored_bits_per_element(layer) == pytest.approx(expected)


def table_record(mode: str, rows: dict[str, tuple[float, float | None, float]]) -> dict:
    """A domain_model_tables.py-shaped record: format -> (total ppl, accuracy at 4096 or None, bits)."""
    formats = {}
    for spec, (ppl, acc, bits) in rows.items():
        retrieval = {} if acc is None else {"accuracy_by_length": {"4096": acc},
                                            "bits_per_element_at_length": {"4096": bits}}
        formats[spec] = {"retrieval": retrieval, "ppl": {"total": {"ppl": ppl, "mode": mode, "window": 4096,
                                                                   "bits_per_element_at_window": bits}}}
    return {"formats": formats}


def test_table_points_are_against_their_own_runs_bf16_and_decode_tail_wins():
    prefill = table_record("prefill", {"bf16": (10.0, 1.0, 16.0), "int4": (10.5, 1.0, 5.6), "kivi2": (12.0, 0.9, 3.75)})
    tail = {"runs": [table_record("decode-tail", {"bf16": (20.0, None, 16.0), "kivi2": (20.2, None, 3.75)})]}
    points = tradeoff.table_points(prefill, 4096) + tradeoff.table_points(tail, 4096)
    ppl, ret = tradeoff.merge(points)
    assert ppl["int4"].ppl_change == pytest.approx(5.0) and not ppl["int4"].decode_tail
    assert ppl["kivi2"].ppl_change == pytest.approx(1.0) and ppl["kivi2"].decode_tail
    assert ret["kivi2"].retrieval == pytest.approx(90.0)
    assert "bf16" not in ppl and "bf16" not in ret
    # a later prefill row does not replace a decode-tail one
    ppl, _ = tradeoff.merge(points + tradeoff.table_points(prefill, 4096))
    assert ppl["kivi2"].decode_tail


def test_peer_points_need_the_unquantized_row():
    def setting(backend, nbits, ppl):
        return {"label": str(backend), "backend": backend, "nbits": nbits, "q_group_size": 32,
                "ppl": {"total": {"ppl": ppl}},
                "bits_per_element_at": {"4096": 16.0 if backend is None else 3.4},
                "retrieval": {"accuracy_by_length": {"4096": 0.75}}}
    record = {"protocol": "decode-tail", "settings": [setting(None, None, 8.0), setting("hqq", 2, 8.4),
                                                      {"label": "x", "backend": "quanto", "error": "ImportError"}]}
    (point,) = tradeoff.peer_points(record, 4096)
    assert point.label == "HQQ int2 g32" and point.peer and point.decode_tail
    assert point.ppl_change == pytest.approx(5.0) and point.retrieval == pytest.approx(75.0)
    with pytest.raises(ValueError, match="DynamicCache"):
        tradeoff.peer_points({"settings": record["settings"][1:]}, 4096)
    retrieval_only = {"settings": [{k: v for k, v in s.items() if k != "ppl"} for s in record["settings"][:2]]}
    (point,) = tradeoff.peer_points(retrieval_only, 4096)  # a --no-ppl run: retrieval, no perplexity
    assert point.ppl_change is None and point.retrieval == pytest.approx(75.0)
    with pytest.raises(ValueError, match="no bits at 2048"):
        tradeoff.peer_points(record, 2048)


def test_label_offsets_move_only_labels_that_would_overlap():
    # two labels at one point, a third far to the right: the second moves by one label height
    offsets = tradeoff.label_offsets([(0.0, 0.0), (0.0, 0.0), (500.0, 0.0)], [50.0, 50.0, 50.0], 10.0)
    assert offsets[0] == 0.0 and abs(offsets[1]) == 10.0 and offsets[2] == 0.0
    # a label whose box would cross an earlier one only in x, not in y, stays where it is
    assert tradeoff.label_offsets([(0.0, 0.0), (20.0, 30.0)], [50.0, 50.0], 10.0) == [0.0, 0.0]


def test_format_labels_name_what_changes_a_format_and_skip_drops_rows():
    assert tradeoff.format_label("nuq2:kv_codebook=page") == "nuq2 (page codebooks)"
    assert tradeoff.format_label("nuq2:kv_keys_before_rope=True") == "nuq2 (keys before RoPE)"
    assert tradeoff.format_label("tiered:kv_codebook=page:kv_tier1_fraction=0.1:kv_outlier_sigma=3.0") == \
        "tiered (10% FP8)"
    assert tradeoff.format_label("tiered:kv_rerank_interval=1") == "tiered"
    record = table_record("decode-tail", {"bf16": (10.0, 1.0, 16.0), "tiered:kv_tier1_fraction=0.1": (10.1, 1.0, 4.5),
                                          "tiered:kv_tier1_fraction=0.1:kv_rank_window=32": (10.2, 1.0, 4.5)})
    points = tradeoff.table_points(record, 4096, frozenset({"tiered:kv_tier1_fraction=0.1:kv_rank_window=32"}))
    assert [p.label for p in points] == ["tiered (10% FP8)"] and points[0].ppl_change == pytest.approx(1.0)
