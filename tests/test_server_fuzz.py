"""Property-based: generated JSON bodies (valid, nearly valid, and junk) posted to every endpoint
never get a 5xx, and the server is healthy with every KV page back in the pool afterwards."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moekv.config import default_model_path
from tests.server_harness import ServerThread

FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# text in plausible bodies; lone surrogates (JSON carries them as \ud800 escapes) come with the
# junk, drawn on purpose, as the full character range would rarely hit them
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
surrogate = st.builds(lambda a, s, b: a + s + b, text, st.characters(categories=["Cs"]), text)
# prompts and message contents: now and then with a lone surrogate in them
prompt_text = st.builds(lambda i, good, bad: bad if i == 3 else good, st.integers(0, 7), text, surrogate)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text | surrogate
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=8)

token_ids = st.lists(st.integers(0, 330), min_size=1, max_size=6)
SAMPLING = {  # plausible values, mostly valid (edges included)
    "model": st.just("tiny"),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": text | st.lists(text, max_size=3),
    "stop_token_ids": token_ids,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 4),
    "skip_special_tokens": st.booleans(),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                 "content": prompt_text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                           "text": prompt_text}),
                                                                      max_size=2)})
FIELDS = {  # endpoint -> (required fields, optional fields)
    "/v1/completions": ({"prompt": prompt_text | st.lists(prompt_text, min_size=1, max_size=3) | token_ids
                         | st.lists(token_ids, min_size=1, max_size=2), "max_tokens": st.integers(1, 6)},
                        {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
    "/v1/chat/completions": ({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
                             {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
                              "add_generation_prompt": st.booleans()}),
    "/tokenize": ({}, {"prompt": prompt_text, "messages": st.lists(message, min_size=1, max_size=3),
                       "model": st.just("tiny"), "add_special_tokens": st.booleans(),
                       "add_generation_prompt": st.booleans()}),
    "/detokenize": ({"tokens": token_ids}, {"model": st.just("tiny")}),
}


def bodies(path: str):
    """Plausible bodies, the same with one field replaced by anything, and anything."""
    required, optional = FIELDS[path]
    plausible = st.fixed_dictionaries(required, optional=optional)
    keys = sorted({*required, *optional, "unknown_field"})
    mutated = st.builds(lambda body, key, value: {**body, key: value}, plausible, st.sampled_from(keys), junk)
    return st.one_of(plausible, mutated, junk)


@pytest.fixture(scope="module")
def server():
    with ServerThread(default_model_path(), max_model_len=64, max_num_seqs=8,
                                          max_queue=16) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            srv.client = client
            yield srv


def post(srv: ServerThread, path: str, raw: bytes) -> int:
    r = srv.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in r.text, r.text[:300]  # no engine error inside the stream
    return r.status_code


def assert_healthy(srv: ServerThread) -> None:
    assert srv.client.get("/health").status_code == 200
    srv.wait_idle()
    bm = srv.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no page leaked
    bm.check_invariants([])


@pytest.mark.slow
@pytest.mark.parametrize("path", list(FIELDS))
def test_generated_bodies_never_get_a_5xx(server, path):
    statuses = []

    @FUZZ
    @given(body=bodies(path))
    def run(body):  # Python's json writes NaN/Infinity too; the server refuses them
        statuses.append(post(server, path, json.dumps(body).encode()))

    run()
    assert_healthy(server)
    # the bodies reach past validation often enough to exercise tokenizing and generation
    assert statuses.count(200) >= 5 and sum(s == 400 for s in statuses) >= 5, statuses


@pytest.mark.slow
def test_generated_bytes_never_get_a_5xx(server):
    @FUZZ
    @given(path=st.sampled_from(list(FIELDS)), raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
    def run(path, raw):
        post(server, path, raw)

    run()
    assert_healthy(server)
