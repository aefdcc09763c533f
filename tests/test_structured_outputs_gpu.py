"""Structured outputs on a CUDA device: the mask applied to the logits a replayed decode graph returns,
under async scheduling and without it; every output parses and satisfies its schema, and both modes
give the same tokens."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'moekv[structured]')")

from moekv import EngineConfig, SamplingParams, StructuredOutputsParams  # noqa: E402
from moekv.config import default_model_path  # noqa: E402
from moekv.engine.llm_engine import LLMEngine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "pet": {"enum": ["cat", "dog"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4}},
          "required": ["n", "pet", "tags"], "additionalProperties": False}


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"n", "pet", "tags"} and isinstance(value["n"], int) and 0 <= value["n"] <= 999
            and value["pet"] in ("cat", "dog") and len(value["tags"]) <= 4 and set(value["tags"]) <= {"a", "b"})


def test_constrained_batch_on_cuda_graphs_sync_and_async():
    spec = StructuredOutputsParams(json=SCHEMA)
    outputs = {}
    for mode in (False, True):
        engine = LLMEngine(EngineConfig(model=default_model_path(), dtype="bfloat16", device="cuda",
                                        max_model_len=256, max_num_seqs=32, async_scheduling=mode))
        for i in range(24):
            engine.add_request(str(i), "A record:", SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                                                                   structured_outputs=spec))
        engine.add_request("free", "Once", SamplingParams(max_tokens=60, temperature=1.0, seed=99, ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        outputs[mode] = {k: o.outputs[0].token_ids for k, o in finals.items()}
        for i in range(24):
            out = finals[str(i)].outputs[0]
            assert out.finish_reason == "stop" and _valid(out.text), out.text
        assert engine.runner.graphs is not None  # (a replay that failed would have dropped them)
        if mode:
            assert engine.num_follow_on_steps > 10
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outputs[True] == outputs[False]


def test_pinned_bitmasks_alternate_and_mask_as_an_unpinned_bitmask():
    """The engine's pinned bitmask buffers: two in turn (a step never refills the one the step before
    copied from), every bit set when taken, and the masked logits equal those of a plain host bitmask."""
    from moekv.layers.sampler import PinnedBitmasks, apply_bitmask_

    pool = PinnedBitmasks()
    a = pool.take(3, 5)
    a[1, 2] = 0b1010
    b = pool.take(3, 5)
    assert a.is_pinned() and b.is_pinned() and a.data_ptr() != b.data_ptr()
    assert (b == -1).all() and a[1, 2].item() == 0b1010  # the other buffer is untouched
    c = pool.take(3, 5)
    assert c.data_ptr() == a.data_ptr() and (c == -1).all()
    g = torch.Generator().manual_seed(0)
    plain = torch.randint(-2**31, 2**31 - 1, (3, 5), generator=g, dtype=torch.int64).to(torch.int32)
    c.copy_(plain)
    logits = torch.randn(3, 150, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = apply_bitmask_(logits.clone(), plain)
    got = apply_bitmask_(logits.clone(), c)
    assert torch.equal(torch.isinf(want), torch.isinf(got)) and torch.equal(want, got)
