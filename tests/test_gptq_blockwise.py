"""GPTQ block by block (models/gptq.round_blockwise, what quantization_calibration runs): each decoder
layer is rounded on the inputs the already rounded layers give it, as a float64 GPTQ over transformers'
forward does (tests/gptq_reference.py); replaying the recorded calibration steps one layer at a time
reproduces the engine's own pass; and the second moments alive at once are one layer's.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_gptq_blockwise.py
"""
from __future__ import annotations

import random
import weakref

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.engine.llm_engine import CALIBRATION_TOKENS
from moekv.models import gptq
from moekv.ops.quantized_weight import INT4_GROUP, unpack_int4
from tests.checkpoints import CORPUS, build_checkpoint
from tests.gptq_reference import blockwise_gptq_ref

MAX_LEN = 128  # the engine's calibration prompts: min(512, max_model_len - 1) tokens each


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Mixtral with two groups of 128 along its hidden size (w2: one group and a partial
    one) and three layers, so layer 2's inputs pass through two rounded layers."""
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("gptq_blockwise") / "mixtral", seed=7,
                            hidden_size=256, intermediate_size=160, head_dim=64, num_hidden_layers=3)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """~1,400 tokens of the tokenizer's words in a random order: no two prompts share a first page, so
    the engine computes every prompt token (a prefix-cache hit would skip rows the reference sees)."""
    words = CORPUS.split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("gptq_text") / "calibration.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(600)))
    return path


def _codes(model) -> dict[str, torch.Tensor]:
    out = {"lm_head": unpack_int4(model.lm_head.codes).long()}
    for i, layer in enumerate(model.layers):
        for name, w in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                        ("w13", layer.mlp.w13), ("w2", layer.mlp.w2)):
            out[f"layers.{i}.{name}"] = unpack_int4(w.codes).long()
    return out


def _mismatch(a: dict, b: dict, names) -> float:
    """Share of the codes of the named weights that differ."""
    return sum((a[n] != b[n]).sum().item() for n in names) / sum(a[n].numel() for n in names)


def test_blockwise_gptq_matches_a_float64_reference(ckpt, calibration):
    import transformers as tf

    llm = LLM(str(ckpt), dtype="float32", max_model_len=MAX_LEN, quantization="int4",
              quantization_calibration=str(calibration))
    model = llm.engine.runner.model
    mine = _codes(model)
    ids = llm.engine.tokenizer.encode(calibration.read_text())[:CALIBRATION_TOKENS]
    chunk = MAX_LEN - 1
    prompts = [ids[i:i + chunk] for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) > 1]
    assert len(prompts) >= 8

    def reference(**kw):
        hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, experts_implementation="eager")
        return blockwise_gptq_ref(hf.eval(), prompts, INT4_GROUP, torch.float32, **kw)

    # each layer rounded as the reference rounds it on the inputs the engine's rounded layers give
    forced = {n: w.dequantize(torch.float64) for n, w in (
        (f"layers.{i}.{name}", getattr(layer.self_attn if "proj" in name else layer.mlp, name))
        for i, layer in enumerate(model.layers) for name in ("qkv_proj", "o_proj", "w13", "w2"))}
    per_layer = reference(forced=forced)
    for name in mine:
        assert _mismatch(mine, per_layer, [name]) <= 1e-3, name  # fp32 activations: a near-tie may flip
    # the whole chain on its own: layer 0 (16-bit inputs in both) equal, later layers drift only by
    # the near-ties' effect on the next layer's inputs
    chained = reference()
    first = [n for n in mine if n.startswith("layers.0.")]
    later = [n for n in mine if n not in first]
    assert _mismatch(mine, chained, first) <= 1e-3
    assert _mismatch(mine, chained, later) <= 0.02
    # and the check tells the definitions apart: every layer's second moments from the 16-bit model
    # (all at once) round layers 1.. otherwise
    at_once = reference(sequential=False)
    assert _mismatch(mine, at_once, first) <= 1e-3
    assert _mismatch(mine, at_once, [n for n in later if n != "lm_head"]) > 0.1


@pytest.mark.parametrize("kv", ["auto", "int4", "nuq2"])
def test_layer_by_layer_replay_reproduces_the_recorded_pass(ckpt, calibration, kv):
    """The recorded steps run one layer at a time (every step through layer 0, then layer 1, ...)
    give the final hidden states the engine's step-by-step pass gave, with prompts cut into chunks
    (a chunk reads the pages the previous one wrote), decode steps that fill pages, pages freed and
    reused between steps, and compressed KV formats. (Exact where a format's state is its pages and
    staging; tiered's page tiers and attention mass carry on from the pass's end instead, so its
    replay reads some pages from the other tier.)"""
    bs = 16
    llm = LLM(str(ckpt), dtype="float32", max_model_len=MAX_LEN, max_num_batched_tokens=48, max_num_seqs=4,
              kv_cache_dtype=kv, block_size=bs, num_kv_blocks=24)
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    ids = engine.tokenizer.encode(calibration.read_text())
    prompts = [{"prompt_token_ids": ids[i:i + 4 * bs - 2]} for i in range(0, 12 * (4 * bs - 2), 4 * bs - 2)]
    seen = []
    model.hooks.hidden_observer = lambda hidden: seen.append(hidden.clone())
    runner.start_weight_calibration()
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    record = runner._calibration
    runner.finish_weight_calibration(round_weights=False)
    model.hooks.hidden_observer = None
    # every prompt token and 3 decode tokens a prompt (the second fills page 4), pages reused
    assert record.num_tokens == 12 * (4 * bs - 2) + 12 * 3 and any(e[0] == "release" for e in record.events)
    steps = [e for e in record.events if e[0] == "step"]
    assert len(steps) == len(seen) and any(e[2].context_lens.max() > e[1].shape[0] for e in steps)  # chunks
    streams, ctxs = [(e[1], None) for e in steps], [e[2] for e in steps]
    with torch.inference_mode():
        for layer in model.layers:
            streams = gptq._replay_block(layer, record.events, streams, ctxs)
        replayed = [model.norm.add_and_norm(x, delta)[1] for x, delta in streams]
    for a, b in zip(replayed, seen):
        assert torch.equal(a, b)


def test_second_moments_alive_are_one_layers(ckpt, calibration, monkeypatch, capfd):
    """Counted from the tensors themselves (weak references to every second-moment matrix the
    collectors make), each time a matrix is rounded: never more than one layer's, and a progress
    line per layer on stderr."""
    made: list[weakref.ref] = []
    peaks: list[int] = []

    class CountedExperts(gptq.ExpertInputs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.extend(weakref.ref(h) for h in (self.h13, self.h2))

    class CountedMoments(gptq.InputMoments):
        def observe(self, name, x):
            fresh = name not in self.h
            super().observe(name, x)
            if fresh:
                made.append(weakref.ref(self.h[name]))

    rounding = gptq.gptq_int4

    def counting_gptq_int4(*args, **kwargs):
        peaks.append(sum(h().nbytes for h in made if h() is not None))
        return rounding(*args, **kwargs)

    monkeypatch.setattr(gptq, "ExpertInputs", CountedExperts)
    monkeypatch.setattr(gptq, "InputMoments", CountedMoments)
    monkeypatch.setattr(gptq, "gptq_int4", counting_gptq_int4)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=MAX_LEN, quantization="int4",
              quantization_calibration=str(calibration))
    cfg = llm.engine.model_config
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    q = cfg.num_heads * cfg.head_dim
    itemsize = torch.empty(0, dtype=gptq.HESSIAN_DTYPE).element_size()
    one_layer = (E * (H * H + I * I) + H * H + q * q) * itemsize
    assert len(peaks) == cfg.num_layers * (2 * E + 2) + 1  # every matrix rounded, counted
    assert max(peaks) == one_layer  # all of a layer's at its rounding, never two layers'
    assert sum(h() is not None for h in made) == 0  # all freed after
    err = capfd.readouterr().err
    assert all(f"GPTQ block {i}/{cfg.num_layers}" in err for i in range(1, cfg.num_layers + 1))
