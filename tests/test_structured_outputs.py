"""Structured outputs (response_format, vLLM's guided_* fields, SamplingParams.structured_outputs):
every sampled output parses and satisfies its constraint, over many seeds, through the openai client
against the test server and through LLM.generate; a constraint that cannot compile is a 400 naming
its field; a constrained request ends and returns its pages."""
from __future__ import annotations

import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'moekv[structured]')")
jsonschema = pytest.importorskip("jsonschema", reason="validates the sampled JSON independently of the grammar engine")
openai = pytest.importorskip("openai", reason="the server tests drive the official client")

from moekv import EngineConfig, SamplingParams, StructuredOutputsParams  # noqa: E402
from moekv.config import default_model_path  # noqa: E402
from moekv.engine.llm_engine import LLMEngine  # noqa: E402
from moekv.layers.sampler import apply_bitmask_, unpack_bitmask  # noqa: E402
from moekv.sampling_params import SamplingParamsError  # noqa: E402
from moekv.structured_outputs import StructuredOutputsError  # noqa: E402
from tests.server_harness import ServerThread, assert_pool_empty  # noqa: E402

MODEL = default_model_path()

# bounded in length (a free "number" or an unbounded string could fill any max_tokens under a small model)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    with ServerThread(MODEL, max_queue=256, max_model_len=256, max_num_seqs=32) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_outputs_validate_over_many_seeds(server, client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe a person."}], n=24, seed=11,
        temperature=1.0, max_tokens=160, response_format=_schema_format(PERSON))
    assert len(r.choices) == 24
    texts = set()
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 1  # the seeds did sample different outputs
    assert_pool_empty(server)


def test_streamed_completion_json_schema_validates(server, client):
    chunks = list(client.completions.create(
        model="tiny", prompt="The record:", n=8, seed=3, temperature=1.0, max_tokens=160, stream=True,
        extra_body={"response_format": _schema_format(PERSON)}))  # (the client's completions lack the keyword)
    texts, finish = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(texts) == list(range(8)) and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert_pool_empty(server)


def test_json_object_outputs_are_objects(client):
    """Any JSON object is unbounded (a small model may write keys and digits until max_tokens, as
    OpenAI's json_object may): each output that stops parses as an object, one cut at max_tokens
    is one's beginning."""
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Some JSON please."}], n=16, seed=5,
        temperature=1.0, max_tokens=200, response_format={"type": "json_object"})
    stopped = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 8
    for text in stopped:
        assert isinstance(json.loads(text), dict), text
    for choice in r.choices:
        assert choice.finish_reason in ("stop", "length") and choice.message.content.startswith("{")


def test_guided_regex_and_choice(client):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    r = client.completions.create(model="tiny", prompt="Code:", n=12, seed=1, temperature=1.0, max_tokens=20,
                                  extra_body={"guided_regex": pattern})
    for choice in r.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
    options = ["yes", "no", "maybe later"]
    r = client.completions.create(model="tiny", prompt="Answer:", n=12, seed=2, temperature=1.0, max_tokens=20,
                                  extra_body={"guided_choice": options})
    assert {c.text for c in r.choices} <= set(options)


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": _schema_format({"type": "objectx"})}, "response_format", ["JSON schema", "objectx"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     ["schema"]),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex", ["regular expression", "parenthesis"]),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", ["non-empty list"]),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     ["send one"]),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos",
     ["structured_outputs"]),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(server, client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       **kwargs)
    error = exc.value.body
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert_pool_empty(server)


def test_text_response_format_is_no_constraint(client):
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True, "response_format": {"type": "text"}})
    plain = client.completions.create(model="tiny", prompt="Once", max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == plain.choices[0].text


def test_engine_finishes_grammar_requests_and_frees_pages():
    """Constrained and free requests share batches through preemption (a pool too small for all of
    them at once) and an abort; every page comes back and every finished output is valid."""
    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", max_model_len=128, block_size=16,
                                    num_kv_blocks=12, max_num_seqs=8))
    spec = StructuredOutputsParams(json=PERSON)
    for i in range(8):
        params = (SamplingParams(max_tokens=100, temperature=1.0, seed=i, structured_outputs=spec) if i % 2 == 0
                  else SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True))
        engine.add_request(str(i), "A person is described as follows:", params)
    aborted, finals = False, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not aborted and engine.num_running:
            engine.abort_request("6")
            aborted = True
    assert engine.scheduler.num_preemptions > 0  # the pool was too small: recomputed grammar sequences too
    for i in (0, 2, 4):
        out = finals[str(i)].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])


def test_llm_generate_with_structured_outputs(offline_llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -99, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema))) for s in range(16)]
    for out in offline_llm.generate(["x"] * 16, params):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    greedy = offline_llm.generate("x", SamplingParams(max_tokens=8, temperature=0.0,
                                                      structured_outputs=StructuredOutputsParams(choice=["A1", "B2"])))
    assert greedy[0].outputs[0].text in ("A1", "B2")


@pytest.fixture(scope="module")
def offline_llm():
    from moekv import LLM
    return LLM(MODEL, dtype="float32", max_model_len=128)


def test_bad_structured_outputs_params_are_refused(offline_llm):
    with pytest.raises(StructuredOutputsError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(StructuredOutputsError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(StructuredOutputsError, match="EBNF grammar could not be compiled.*undefined_rule"):
        offline_llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            grammar="root ::= undefined_rule")))


def test_bitmask_unpacking_matches_xgrammar_s_kernel():
    """unpack_bitmask (the GPU path's unpacking, plain torch) against xgrammar's CPU kernel, which
    apply_bitmask_ uses on the CPU."""
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # a row without a grammar: all allowed
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, backend="cpu")
    assert torch.equal(unpack_bitmask(bitmask, vocab), torch.isfinite(expected))
    assert torch.equal(apply_bitmask_(logits.clone(), bitmask), expected)
    assert unpack_bitmask(bitmask, vocab)[2].all() and not unpack_bitmask(bitmask, vocab).all()


def test_async_scheduling_follows_on_grammar_sequences_with_the_same_outputs():
    """With async scheduling a grammar sequence's next step is queued before the host has its token
    (the matcher takes it once the step's forward is queued): the outputs equal the synchronous
    engine's, token for token, and steps were queued ahead."""
    spec = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=s, structured_outputs=spec) for s in range(6)]
    params += [SamplingParams(max_tokens=30, temperature=0.8, seed=9, ignore_eos=True)]
    outputs = {}
    for mode in (False, True):
        engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", max_model_len=128, async_scheduling=mode))
        for i, p in enumerate(params):
            engine.add_request(str(i), "A person:", p)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        outputs[mode] = {k: (o.outputs[0].token_ids, o.outputs[0].text) for k, o in finals.items()}
        if mode:
            assert engine.num_follow_on_steps > 10
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outputs[True] == outputs[False]
    for i in range(6):
        jsonschema.validate(json.loads(outputs[True][str(i)][1]), PERSON)
