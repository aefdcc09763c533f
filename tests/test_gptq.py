"""GPTQ rounding of INT4 weights (moekv/models/gptq.py, quantization_calibration=): the rounding keeps
the layer's output error below round-to-nearest's, the collectors' second moments are the rows each
weight sees, and an engine calibrated at start serves the rounded experts, attention projections and
LM head.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_gptq.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekv import LLM
from moekv.models.gptq import HESSIAN_DTYPE, ExpertInputs, InputMoments, gptq_int4
from moekv.ops.quantized_weight import QuantizedWeight, quantize_int4
from moekv.ops.reference import fused_moe_ref


def _correlated_inputs(rows: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(K) + 2 * torch.randn(K, K, generator=g) / K ** 0.5
    return torch.randn(rows, K, generator=g) @ mix


def test_gptq_lowers_the_output_error_below_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 200, generator=g)  # a partial last group
    x = _correlated_inputs(1024, 200, 1)
    q = gptq_int4(w, x.T.double() @ x.double(), group_size=64)
    rtn = quantize_int4(w, 64, zero_point=True)
    assert q.method == "int4" and q.zeros is not None and tuple(q.shape) == (48, 200)

    def out_err(qw):
        return ((x @ w.T - x @ qw.dequantize().T) ** 2).sum().item()

    assert out_err(q) < 0.7 * out_err(rtn)
    # every code is a valid 4-bit code in its group's range: the weight stays within a step of w's range
    assert (q.dequantize().abs().amax(1) <= w.abs().amax(1) * 1.5).all()
    # no inputs: round-to-nearest
    assert torch.equal(gptq_int4(w, torch.zeros(200, 200), 64).codes, rtn.codes)


def test_act_order_keeps_the_layout_and_lowers_the_output_error():
    """Columns rounded by descending input energy (act_order): the group scales and zero points are
    round-to-nearest's (taken before any column moves), so the groups stay contiguous; the output
    error is below round-to-nearest's, and below natural order's where a few inputs carry most energy."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 200, generator=g)
    energy = torch.ones(200)
    energy[torch.randperm(200, generator=g)[:12]] = 30.0  # a few large input channels, scattered
    x = _correlated_inputs(1024, 200, 4) * energy
    h = x.T.double() @ x.double()
    ao, natural = gptq_int4(w, h, group_size=64, act_order=True), gptq_int4(w, h, group_size=64)
    rtn = quantize_int4(w, 64, zero_point=True)
    assert torch.equal(ao.scales, rtn.scales) and torch.equal(ao.zeros, rtn.zeros)

    def out_err(qw):
        return ((x @ w.T - x @ qw.dequantize().T) ** 2).sum().item()

    assert out_err(ao) < 0.7 * out_err(rtn)
    assert out_err(ao) < out_err(natural)


def test_input_moments_add_up_over_calls():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 8, generator=g), torch.randn(2, 1, 8, generator=g)
    moments = InputMoments()
    moments.observe("w", a)
    moments.observe("w", b)
    rows = torch.cat([a, b.reshape(2, 8)]).double()
    assert moments.h["w"].dtype == HESSIAN_DTYPE == torch.float32
    assert torch.allclose(moments.h["w"].double(), rows.T @ rows, rtol=1e-6, atol=1e-6)
    exact = InputMoments(torch.float64)  # the accumulation dtype is a choice
    exact.observe("w", a)
    exact.observe("w", b)
    assert exact.h["w"].dtype == torch.float64 and torch.allclose(exact.h["w"], rows.T @ rows, rtol=1e-12)


def test_expert_inputs_are_the_routed_rows_second_moments():
    g = torch.Generator().manual_seed(2)
    E, H, I = 4, 16, 8
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [3, 1], [0, 3]])
    weights = torch.rand(5, 2, generator=g)
    collector = ExpertInputs(fused_moe_ref, E, H, I, torch.device("cpu"))
    out = collector(x, w13, w2, weights, ids)
    assert torch.equal(out, fused_moe_ref(x, w13, w2, weights, ids))
    rows = x[[0, 2, 4]].double()
    assert torch.allclose(collector.h13[0].double(), rows.T @ rows, rtol=1e-6, atol=1e-5)
    gate, up = F.linear(rows, w13[0].double()).chunk(2, dim=-1)
    act = F.silu(gate) * up
    assert torch.allclose(collector.h2[0].double(), act.T @ act, rtol=1e-6, atol=1e-5)
    assert collector.rows.tolist() == [3, 3, 2, 2]


def test_engine_rounds_its_weights_on_the_calibration_text(mixtral_ckpt, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("It was the best of times, it was the worst of times. To be, or not to be. " * 40)
    engine = dict(dtype="float32", max_model_len=128)
    gptq = LLM(str(mixtral_ckpt), **engine, quantization="int4", quantization_calibration=str(text))
    rtn = LLM(str(mixtral_ckpt), **engine, quantization="int4")
    model, rtn_model = gptq.engine.runner.model, rtn.engine.runner.model
    ours, theirs = model.layers[0], rtn_model.layers[0]
    # experts, attention projections and LM head: int4 in quantize-on-load's layout, rounded otherwise
    for mine, other in ((ours.mlp.w13, theirs.mlp.w13), (ours.mlp.w2, theirs.mlp.w2),
                        (ours.self_attn.qkv_proj, theirs.self_attn.qkv_proj),
                        (ours.self_attn.o_proj, theirs.self_attn.o_proj), (model.lm_head, rtn_model.lm_head)):
        assert isinstance(mine, QuantizedWeight) and mine.scale_block == other.scale_block
        assert mine.codes.shape == other.codes.shape and not torch.equal(mine.codes, other.codes)
    assert model.hooks.hidden_observer is None and ours.hooks.projection_observer is None  # observers removed
    stats = gptq.engine.stats(device=False)
    assert stats.prompt_tokens == 0 and stats.kv_pages_used == 0  # the calibration left nothing behind
    assert stats.weight_bytes == rtn.engine.stats(device=False).weight_bytes
    out = gptq.generate({"prompt_token_ids": [5, 6, 7, 8]})
    assert len(out[0].outputs[0].token_ids) > 0


def test_calibration_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="quantization='int4'"):
        LLM(quantization="fp8", quantization_calibration=__file__)
    with pytest.raises(ValueError, match="not a text file"):
        LLM(quantization="int4", quantization_calibration=str(tmp_path / "missing.txt"))
