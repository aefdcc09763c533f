"""`moekv serve` on loopback with the bundled model, driven by the official openai client and,
for the error cases, by raw HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from moekv import LLM
from moekv.config import default_model_path
from tests.server_harness import NO_EOS, ServerThread, assert_pool_empty, scrape

MODEL = default_model_path()


@pytest.fixture(scope="module")
def server():
    with ServerThread(MODEL, max_queue=256, max_model_len=256, max_num_seqs=128) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server():
    """2 running, 2 waiting, and 5 pages of 16 tokens: two 64-token sequences must preempt."""
    with ServerThread(MODEL, max_queue=2, max_model_len=64, max_num_seqs=2, block_size=16, num_kv_blocks=5) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, dtype="float32", max_model_len=256)


def test_completion_matches_offline_generate(client, offline):
    """The request's fields over the model's generation_config.json defaults (its repetition_penalty
    here), as LLM's default SamplingParams take them."""
    r = client.completions.create(model="tiny", prompt="It was a dark and stormy night", max_tokens=12,
                                  temperature=0.0, extra_body=NO_EOS)
    params = dataclasses.replace(offline.get_default_sampling_params(), max_tokens=12, temperature=0.0,
                                 ignore_eos=True)
    assert params.repetition_penalty != 1.0  # the default the server must fill in too
    expected = offline.generate("It was a dark and stormy night", params)[0]
    assert r.choices[0].text == expected.outputs[0].text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)


def test_batch_prompts_and_n_use_derived_seeds(client, offline):
    prompts = ["The old man", "She said"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, seed=7, temperature=1.0, max_tokens=8,
                                  extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):  # choice i of prompt p is what a single request with seed 7 + i gives
            alone = client.completions.create(model="tiny", prompt=prompt, seed=7 + i, temperature=1.0,
                                              max_tokens=8, extra_body=NO_EOS)
            assert r.choices[p * 2 + i].text == alone.choices[0].text
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 32
    assert r.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)


def test_echo_logprobs_score_the_prompt(client, offline):
    """What lm-evaluation-harness asks for: echo + logprobs, the prompt's log-likelihood per token."""
    ids = offline.tokenizer.encode("It is a truth universally acknowledged, that a single man")
    r = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0.0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = offline.score([{"prompt_token_ids": ids}])[0]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), expected, atol=1e-4)
    assert r.choices[0].text.startswith(offline.tokenizer.decode(ids))
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])  # top-1 plus the actual token


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Where are you going?"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                          logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    assert [len(t.top_logprobs) for t in full.choices[0].logprobs.content] == [2] * 10
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_logprobs_and_continuous_usage_add_up(client):
    """Streaming outputs carry deltas (output_kind "delta"): per choice, the chunks' text, logprob
    tokens and running usage add up to the non-streamed result."""
    kw = dict(model="tiny", prompt="It was the best", max_tokens=8, temperature=0.0, logprobs=2, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, n=2, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for index in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.choices[0].text for c in mine) == full.choices[0].text
        tokens = [t for c in mine if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == full.choices[0].logprobs.tokens
        counts = [c.usage.completion_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] == 8  # each choice's own running count
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_streamed_text_never_leaks_a_stop_string(client):
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0.0,
                                     extra_body=NO_EOS).choices[0].text
    stop = text[6:10]  # most likely spans two tokens: its first characters arrive before the engine sees it
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0.0,
                                            stop=[stop], stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


ROLES = ("system", "developer", "user", "assistant", "tool")


def test_unknown_chat_role_is_a_400_naming_the_field(server, client):
    """OpenAI's roles are taken (developer: its name for system on newer models, as vLLM takes it);
    any other is refused, as OpenAI and vLLM refuse it, instead of reaching the template."""
    good = [{"role": role, "content": "Hi"} for role in ROLES]
    r = client.chat.completions.create(model="tiny", messages=good, max_tokens=2)
    assert r.choices[0].finish_reason and r.usage.prompt_tokens > 0
    bad = [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Once"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=bad, max_tokens=2)
    err = exc.value.body
    assert exc.value.status_code == 400 and err["param"] == "messages[1].role" and err["code"] == "invalid_value"
    assert "messages[1].role" in err["message"] and "narrator" in err["message"]
    assert all(f"'{role}'" in err["message"] for role in ROLES)
    for role in ("", "User", "function", 3, None):  # the same from /tokenize, and for any non-role
        r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": role, "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role", r.text
    assert_pool_empty(server)


def test_models_tokenize_detokenize_health(server, offline):
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 256 and card["quantization"] is None
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()
    assert r["tokens"] == offline.tokenizer.encode("Hello there") and r["count"] == len(r["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert offline.tokenizer.decode(chat["tokens"]) == "user: Hi\nassistant:"
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello there"
    assert httpx.get(f"{server.url}/health").status_code == 200


BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999}, 400,
     "max_completion_tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_malformed_input_is_a_4xx_with_a_json_body(server, path, body, status, param):
    content = body if isinstance(body, bytes) else None
    r = httpx.post(f"{server.url}{path}", content=content, json=None if content else body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    if param is not None:
        assert param.split(".")[0] in err["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_100_concurrent_streams_with_a_third_cancelled(server):
    rng = random.Random(0)
    cancelled = set(rng.sample(range(100), 33))
    want = {i: rng.randint(4, 24) for i in range(100)}
    before = scrape(server.url)

    async def one(aclient, i):
        stream = await aclient.completions.create(
            model="tiny", prompt=f"Request {i}: the", max_tokens=200 if i in cancelled else want[i],
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS)
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if i in cancelled and len(chunks) == 2:
                await stream.close()  # the client goes away mid-stream
                return None
        return chunks

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(100)))

    results = asyncio.run(main())
    for i, chunks in enumerate(results):
        if i in cancelled:
            continue
        assert chunks[-1].usage.completion_tokens == want[i], i
        token_chunks = [c for c in chunks if c.choices]
        assert len(token_chunks) == want[i] and token_chunks[-1].choices[0].finish_reason == "length"
    assert_pool_empty(server)
    after = scrape(server.url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta["moekv:request_success_total{finished_reason=abort}"] == 33
    assert delta["moekv:request_success_total{finished_reason=length}"] == 67
    assert after["moekv:num_requests_running"] == 0 and after["moekv:kv_cache_usage_perc"] == 0


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    before = scrape(server.url)["moekv:request_success_total{finished_reason=abort}"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 250, **NO_EOS},
                   timeout=httpx.Timeout(10.0, read=0.1))
    assert_pool_empty(server)
    assert scrape(server.url)["moekv:request_success_total{finished_reason=abort}"] == before + 1


def test_engine_fault_is_a_500_and_frees_the_pages(server, client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel fault")

    monkeypatch.setattr(server.engine.runner, "launch", broken)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 500 and "simulated kernel fault" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="simulated kernel fault"):  # in-stream error event
        list(client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True))
    assert_pool_empty(server)
    monkeypatch.undo()
    assert client.completions.create(model="tiny", prompt="x", max_tokens=4).choices[0].finish_reason
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_full_queue_is_a_503_and_the_server_keeps_serving(small_server):
    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as c:
            body = {"prompt": "The sea", "max_tokens": 40, **NO_EOS}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(main())
    full = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(full) + len(served) == 12 and full and len(served) >= 2  # at least a full queue's worth
    err = full[0].json()["error"]
    assert err["code"] == "queue_full" and "max_queue=2" in err["message"] and full[0].headers["retry-after"]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)
    again = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "The sea", "max_tokens": 5, **NO_EOS})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
    assert_pool_empty(small_server)


def test_metrics_move_as_requests_run(server, small_server, client):
    before = scrape(server.url)
    runner = server.engine.runner  # fp32 K/V: 32 bits per element
    assert before["moekv:kv_cache_config_info{bits_per_element=32.00,block_size="
                  f"{runner.block_size},kv_cache_dtype=fp32,num_blocks={runner.num_blocks}}}"] == 1
    stream = client.completions.create(model="tiny", prompt="A long story", max_tokens=200, stream=True,
                                       extra_body=NO_EOS)
    next(iter(stream))
    during = scrape(server.url)  # gauges are published before the token leaves the engine thread
    assert during["moekv:num_requests_running"] == 1 and during["moekv:kv_cache_usage_perc"] > 0
    assert during["moekv:kv_cache_pages_used"] >= 1
    stream.close()
    client.completions.create(model="tiny", prompt="A short one", max_tokens=5, extra_body=NO_EOS)
    assert_pool_empty(server)
    after = scrape(server.url)
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_time_per_output_token_seconds_count", "request_queue_time_seconds_count"):
        assert after[f"moekv:{name}"] > before[f"moekv:{name}"], name
    assert after["moekv:num_requests_running"] == 0 and after["moekv:kv_cache_usage_perc"] == 0

    async def two():  # two 60-token sequences need 8 pages; the small server has 5
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as c:
            body = {"prompt": "The sea", "max_tokens": 58, **NO_EOS}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2)))

    assert [r.status_code for r in asyncio.run(two())] == [200, 200]
    assert scrape(small_server.url)["moekv:num_preemptions_total"] > 0


def test_tiered_format_reports_its_tiers():
    with ServerThread(MODEL, max_model_len=256, kv_cache_dtype="tiered", block_size=32, kv_rerank_interval=4) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "word " * 100, "max_tokens": 60,
                                                                     "stream": True, **NO_EOS}) as r:
            lines = r.iter_lines()
            for _ in range(100):  # 50 tokens in (a data line and a blank line each): 150 tokens, full pages
                next(lines)
            m = scrape(srv.url)
    runner, cfg = srv.engine.runner, srv.engine.model_config
    bits = runner.kv_format.bits_per_element(cfg.num_kv_heads, runner.block_size, cfg.head_dim)
    assert m["moekv:kv_cache_bits_per_element"] == pytest.approx(bits)
    fractions = m["moekv:kv_cache_tier_fraction{tier=fp8}"] + m["moekv:kv_cache_tier_fraction{tier=nuq2}"]
    assert fractions == pytest.approx(1)
    assert m["moekv:kv_cache_bits_per_element_read"] > 0


@pytest.mark.slow
def test_serve_command_starts_and_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moekv.cli", "serve", "--port", str(port), "--max-model-len",
                             "128", "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.2)
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        assert card["id"] == "tiny" and card["max_model_len"] == 128
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    r = subprocess.run([sys.executable, "-m", "moekv.cli", "serve", "--max-queue", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--max-queue=0 must be >= 1" in r.stderr


CLUSTER_MAP = (Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu"
               / "domain-moe.clusters4.safetensors")


@pytest.mark.parametrize("routing, clusters_per_token", [("hierarchical", 1), ("flat", None)])
def test_routing_locality_is_exported(routing, clusters_per_token):
    """With a cluster map the server counts every routing decision under the clustered placement:
    one cluster per token is local by construction; the model's own routing is not."""
    with ServerThread(MODEL, max_model_len=128, routing=routing, cluster_map=str(CLUSTER_MAP),
                      clusters_per_token=clusters_per_token) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "The sea was", "max_tokens": 8, **NO_EOS})
        assert r.status_code == 200
        m = scrape(srv.url)
    if routing == "hierarchical":
        assert m["moekv:routing_locality"] == 1.0 and m["moekv:routing_fan_out"] == 1.0
    else:
        assert 0.2 < m["moekv:routing_locality"] < 1.0 and 1.0 < m["moekv:routing_fan_out"] <= 2.0


def test_expert_offload_metrics_are_exported():
    """With expert offload the server exports the cache's hits and misses, the bytes copied and the
    prediction recall; they agree with the engine's own counters."""
    with ServerThread(MODEL, max_model_len=128, expert_offload=True, expert_cache_slots=4) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "The sea was", "max_tokens": 8, **NO_EOS})
        assert r.status_code == 200
        srv.wait_idle()
        m = scrape(srv.url)
        e = srv.engine.stats().expert_offload
    assert m["moekv:expert_cache_hits_total"] == e["hits"] and m["moekv:expert_cache_misses_total"] == e["misses"]
    assert m["moekv:expert_cache_misses_total"] > 0
    assert m["moekv:expert_host_to_device_bytes_total"] == e["bytes_prefetch"] + e["bytes_demand"] > 0
    assert 0.0 < m["moekv:expert_prediction_recall"] <= 1.0
    assert m["moekv:expert_host_to_device_bytes_per_token"] == pytest.approx(e["bytes_per_token"])
