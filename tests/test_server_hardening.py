"""`moekv serve` facing slow, large, malformed, unauthenticated and departing clients (issue 26):
read and shutdown timeouts, size limits, API keys, invalid Unicode, nesting depth, admission, and
tokenization off the event loop. Raw sockets where a well-behaved client cannot misbehave enough."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from moekv.config import default_model_path
from moekv.server.options import ServerOptions
from tests.server_harness import NO_EOS, ServerThread, assert_pool_empty

MODEL = default_model_path()


@pytest.fixture(scope="module")
def server():
    """Short read timeout, small body limit: the limits are reached in milliseconds."""
    options = ServerOptions(read_timeout=0.5, max_request_bytes=20_000, shutdown_timeout=5)
    with ServerThread(MODEL, max_model_len=128, options=options) as srv:
        yield srv


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket timeout fails a hang)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def response_of(raw: bytes) -> tuple[int, dict | None]:
    if not raw:
        return 0, None
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None


def assert_healthy(srv: ServerThread) -> None:
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert_pool_empty(srv)


POST_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n")


# -- 1. read timeouts: half-sent headers and bodies, idle connections --------------------------
def test_stalled_body_gets_408_and_the_connection_closes(server):
    with connect(server.url) as sock:
        sock.sendall(POST_HEAD + b"{")  # 1 byte of a 100-byte body, then nothing
        status, body = response_of(read_all(sock))
    assert status == 408 and body["error"]["code"] == "request_timeout" and "--read-timeout" in body["error"]["message"]
    assert_healthy(server)


def test_half_sent_headers_get_408_and_idle_connections_close(server):
    with connect(server.url) as half, connect(server.url) as idle:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        status, body = response_of(read_all(half))
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert read_all(idle) == b""  # never sent a byte: closed without an answer
    assert_healthy(server)


def test_keep_alive_connection_gets_a_fresh_header_deadline(server):
    with connect(server.url) as sock:
        for _ in range(2):  # two requests on one connection, each well within the deadline
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /heal")  # then a trickle: closed with a 408
        status, _ = response_of(read_all(sock))
    assert status == 408


# -- 1. SIGTERM with stalled clients ends within the drain time ------------------------------
@pytest.mark.slow
def test_sigterm_closes_stalled_clients_within_the_shutdown_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moekv.cli", "serve", "--port", str(port), "--max-model-len", "128",
                             "--log-level", "warning", "--shutdown-timeout", "1", "--read-timeout", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    socks = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.2)
        socks = [connect(url) for _ in range(3)]
        socks[0].sendall(POST_HEAD + b"{")  # a stalled body
        socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # stalled headers
        time.sleep(0.3)  # socks[2] stays idle; let the server see all three
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # before: waited for the stalled clients forever
        for sock in socks:
            sock.settimeout(10)
            read_all(sock)  # closed by the server (a hang would time out)
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    # uvicorn re-raises the signal it caught once shut down, so the exit status is SIGTERM's
    assert proc.returncode in (0, -signal.SIGTERM), proc.stderr.read()
    assert "KV fp32" in out and "KV auto" not in out  # the banner names the format in use


def test_shutdown_finishes_running_requests_with_abort(monkeypatch):
    """At the end of the drain, requests still running are finished with finish_reason "abort" and
    the text so far (a stream: its last chunk, then [DONE]), their pages return, and a request that
    comes after it gets a 503 (the in-process server: should_exit is what SIGTERM sets)."""
    srv = ServerThread(MODEL, max_model_len=128, options=ServerOptions(shutdown_timeout=0.5))
    real_step = srv.engine.step

    def slow_step():  # 100 tokens take 5 s: the requests outlast the drain
        time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(srv.engine, "step", slow_step)
    body = {"model": "tiny", "max_tokens": 100, "temperature": 0.0, **NO_EOS}
    results, lines, started = {}, [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30,
                          json={**body, "messages": [{"role": "user", "content": "Tell me"}], "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) >= 3:
                    started.set()

    def plain():
        results["plain"] = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": "Once upon"}, timeout=30)

    with srv:
        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(30)  # both are generating
        srv.server.should_exit = True
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - t0
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive()
    assert took < 0.5 + 3, took  # ended with the drain, not with the requests (5 s) or the backstop
    r = results["plain"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert 0 < r.json()["usage"]["completion_tokens"] < 100
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    bm = srv.engine.block_manager  # every page is back
    assert srv.engine.num_running == srv.engine.num_waiting == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_requests_after_the_finish_get_a_503(server):
    """Between the finish of the running requests and the close, a request that was still being
    read or tokenized is refused, not started."""
    aeng = server.state.async_engine
    try:
        async def finish():
            return await aeng.finish_all()

        assert asyncio.run_coroutine_threadsafe(finish(), aeng._loop).result(timeout=30) == 0  # nothing ran
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    finally:
        aeng._closed = False  # the module's server serves the other tests
    assert_healthy(server)


# -- 2. request size limit, huge prompts, tokenization off the event loop -----------------------
def test_body_over_the_limit_is_a_413(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 30_000})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "20000 bytes" in err["message"] and err["type"]

    def chunks():  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a client still sending a large body reads the 413 (the body is read and dropped), not a reset
    with httpx.Client(base_url=server.url) as client:
        for _ in range(3):
            r = client.post("/v1/completions", content=b"x" * 3_000_000, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "3000000 bytes" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # the same connection carries on
    # beyond what is worth reading, the connection is closed after the answer
    with connect(server.url) as sock:
        sock.sendall(POST_HEAD.replace(b"Content-Length: 100", b"Content-Length: 999999999999"))
        status, body = response_of(read_all(sock))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert_healthy(server)


@pytest.fixture(scope="module")
def big_server():
    with ServerThread(MODEL, max_model_len=128, options=ServerOptions(shutdown_timeout=5)) as srv:  # 16 MiB bodies
        yield srv


def test_huge_prompt_is_refused_before_tokenizing(big_server, monkeypatch):
    tok = big_server.engine.tokenizer
    seen = []
    real = tok.encode

    def spy(text, add_special_tokens=True):
        seen.append(len(text))
        return real(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", spy)
    huge = "word " * 2_000_000  # 10 MB
    for path, body, param in [("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
                              ("/tokenize", {"prompt": huge}, "prompt")]:
        r = httpx.post(f"{big_server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param and "characters" in err["message"]
    assert all(n < 10_000 for n in seen)  # nothing near 10 MB reached the tokenizer
    # the bound is a true lower bound: a prompt just under it is tokenized, not refused by it
    bound = tok.max_chars_per_token * big_server.engine.max_model_len
    r = httpx.post(f"{big_server.url}/tokenize", json={"prompt": "x" * int(bound)})
    assert r.status_code == 200 and r.json()["count"] <= bound
    assert_healthy(big_server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "BLOCK here", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "BLOCK here"}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "BLOCK here"}),
])
def test_tokenizing_does_not_hold_up_other_requests(big_server, monkeypatch, path, body):
    """Tokenization that takes long (here: until released) runs in a worker thread, so /health answers."""
    tok = big_server.engine.tokenizer
    real, started, release = tok.encode, threading.Event(), threading.Event()

    def slow(text, add_special_tokens=True):
        if "BLOCK" in text:
            started.set()
            assert release.wait(30)
        return real(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", slow)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{big_server.url}{path}", json=body,
                                                                         timeout=60)))
    thread.start()
    try:
        assert started.wait(30)
        health = httpx.get(f"{big_server.url}/health", timeout=10)  # on the event loop: it would time out
        assert health.status_code == 200
    finally:
        release.set()
        thread.join(timeout=60)
    assert result["r"].status_code == 200, result["r"].text


# -- 3. invalid Unicode, 4. nesting depth ---------------------------------------------------------
SURROGATE = [  # (path, body, param)
    ("/v1/completions", {"prompt": "\ud800 x"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["a\ud83d"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "\ud800": 1}, "\\ud800"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE)
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not valid Unicode" in err["message"]
    assert_healthy(server)


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting_is_a_400(big_server):
    for raw in [b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000, json.dumps({"prompt": nested(40)}).encode(),
                json.dumps({"prompt": "x", "user": {"a": nested(100)}}).encode()]:
        r = httpx.post(f"{big_server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "invalid_json"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2}
    assert httpx.post(f"{big_server.url}/v1/chat/completions", json=parts).status_code == 200  # the deepest valid
    assert_healthy(big_server)


# -- 5. admission counts only what waits beyond the free batch slots ---------------------------
def test_a_burst_that_fits_the_free_slots_is_never_refused():
    with ServerThread(MODEL, max_queue=4, max_model_len=128, max_num_seqs=8) as srv:
        async def burst(k):
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                body = {"prompt": "The sea", "max_tokens": 20, **NO_EOS}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(k)))

        assert [r.status_code for r in asyncio.run(burst(8))] == [200] * 8  # before: 4 of them got 503
        # a single request may take every slot plus the whole queue
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 12}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 12
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 13})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert_healthy(srv)


# -- 6. a client that leaves mid-body leaves no traceback ---------------------------------------
class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_client_leaving_mid_body_logs_nothing(server):
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "moekv", "moekv.server")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        for _ in range(3):
            with connect(server.url) as sock:
                sock.sendall(POST_HEAD + b'{"prompt": "x"')
                time.sleep(0.05)
        time.sleep(0.3)
        assert_healthy(server)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    errors = [r for r in handler.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# -- 8. API keys ------------------------------------------------------------------------------------
@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_api_key_with_the_official_client(metrics_require_key):
    options = ServerOptions(api_key="s3cret-key", metrics_require_key=metrics_require_key, shutdown_timeout=5)
    with ServerThread(MODEL, max_model_len=128, options=options) as srv:
        right = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret-key", max_retries=0)
        assert right.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason
        assert right.models.list().data[0].id == "tiny"
        none = {"Authorization": openai.Omit()}  # the client sends no Authorization header at all
        wrong, missing = "Incorrect API key provided", "You didn't provide an API key"  # OpenAI's wording
        for key, headers, says in (("wrong-key", None, wrong), ("s3cret-kez", None, wrong), ("unused", none, missing)):
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as exc:
                client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_headers=headers)
            assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
            assert exc.value.body["message"].startswith(says) and exc.value.body["type"] == "invalid_request_error"
        # no key: no header, another scheme, or an empty token; a wrong key: a Bearer token that differs
        for auth, says in ((None, missing), ("Basic czNjcmV0LWtleQ==", missing), ("Bearer", missing),
                           ("s3cret-key", missing), ("Bearer s3cret", wrong)):
            headers = {} if auth is None else {"Authorization": auth}
            r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (auth, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", (auth, err)
            assert err["message"].startswith(says) and "Authorization: Bearer" in err["message"], (auth, err)
        assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "x"},
                          headers={"Authorization": "bearer  s3cret-key"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200  # always open
        metrics = httpx.get(f"{srv.url}/metrics").status_code
        assert metrics == (401 if metrics_require_key else 200)
        authed = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer s3cret-key"})
        assert authed.status_code == 200 and "moekv:num_requests_running" in authed.text
        assert_healthy(srv)


@pytest.mark.slow
def test_api_key_from_the_environment_and_bad_options(monkeypatch):
    monkeypatch.setenv("MOEKV_API_KEY", "from-env")
    assert ServerOptions.with_env_key().api_key == "from-env"
    assert ServerOptions.with_env_key("flag").api_key == "flag"
    monkeypatch.delenv("MOEKV_API_KEY")
    assert ServerOptions.with_env_key().api_key is None
    for kwargs, match in [({"api_key": " "}, "api_key must be a non-empty"), ({"max_request_bytes": 0}, ">= 1"),
                          ({"read_timeout": 0}, "read_timeout=0"), ({"shutdown_timeout": float("nan")}, "> 0")]:
        with pytest.raises(ValueError, match=match):
            ServerOptions(**kwargs)
    env = {k: v for k, v in os.environ.items() if k != "MOEKV_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "moekv.cli", "serve", "--metrics-require-key"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--metrics-require-key needs an API key" in r.stderr


# -- the connection cap ------------------------------------------------------------------------------
def test_connections_beyond_the_limit_get_an_openai_503():
    with ServerThread(MODEL, max_model_len=128, options=ServerOptions(limit_concurrency=2, shutdown_timeout=5)) as srv:
        with connect(srv.url) as a, connect(srv.url) as b:
            a.sendall(b"GET /hea")  # two connections held open
            b.sendall(b"GET /hea")
            time.sleep(0.2)
            r = httpx.get(f"{srv.url}/v1/models")
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        time.sleep(0.2)
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200
