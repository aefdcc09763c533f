"""`moekv bench serve`: its statistics on known numbers, and a real run against a loopback server."""
from __future__ import annotations

import json
import math
import re

import pytest

from moekv.cli import main
from moekv.config import default_model_path
from moekv.server.bench import RequestResult, summarize
from tests.server_harness import ServerThread, scrape


@pytest.fixture(scope="module")
def server():
    with ServerThread(default_model_path(), max_queue=64, max_model_len=128,
                                          max_num_seqs=8) as srv:
        yield srv


def test_summary_statistics():
    results = [RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
               RequestResult(ok=True, prompt_len=10, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
               RequestResult(ok=False, error="HTTP 503: full")]
    r = summarize(results, duration=2.0)
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 20, 8)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 4.0 and r["total_token_throughput"] == 14.0
    assert math.isclose(r["mean_ttft_ms"], 200.0) and math.isclose(r["median_ttft_ms"], 200.0)
    assert math.isclose(r["mean_tpot_ms"], 150.0)  # (0.5 - 0.1) / 4 and (0.7 - 0.3) / 2
    assert math.isclose(r["mean_itl_ms"], 1000 * 0.8 / 6) and math.isclose(r["p99_itl_ms"], 200.0)
    assert math.isclose(r["mean_e2el_ms"], 600.0) and r["p99_e2el_ms"] > r["median_e2el_ms"]
    assert r["errors"] == ["HTTP 503: full"]
    assert summarize([], 1.0)["mean_ttft_ms"] is None


def test_bench_serve_against_a_server(server, capsys):
    prompt_tokens_before = scrape(server.url)["moekv:prompt_tokens_total"]
    rc = main(["bench", "serve", "--url", server.url, "--num-prompts", "12", "--input-len", "16", "--output-len", "6",
               "--max-concurrency", "4", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (12, 0, 192, 72)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"mean_{key}_ms"] and r[f"median_{key}_ms"] <= r[f"p99_{key}_ms"]
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"] and r["model"] == "tiny"
    assert "12/12" in err and "Serving Benchmark Result" in err  # progress bar and report go to stderr
    # the server saw prompts of exactly --input-len tokens
    assert scrape(server.url)["moekv:prompt_tokens_total"] - prompt_tokens_before == 192


def test_bench_serve_poisson_rate(server, capsys):
    rc = main(["bench", "serve", "--url", server.url, "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
               "--request-rate", "50", "--seed", "3", "--no-progress"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert re.search(r"Successful requests:\s+6\n", out) and re.search(r"Request rate \(req/s\):\s+50.0", out)


@pytest.mark.parametrize("args,message", [
    (["--num-prompts", "0"], "--num-prompts=0 must be >= 1"),
    (["--request-rate", "0"], "--request-rate=0.0 must be > 0"),
    (["--input-len", "100", "--output-len", "100"], "exceeds the server's max_model_len=128"),
    (["--url", "http://127.0.0.1:9"], "cannot benchmark http://127.0.0.1:9"),
])
def test_bench_serve_bad_arguments(server, capsys, args, message):
    base = ["bench", "serve", "--url", server.url, "--no-progress"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_sends_the_api_key(capsys, monkeypatch):
    """Against a server started with an API key: refused without one (a clear error, exit 2), served
    with --api-key or with MOEKV_API_KEY in the environment."""
    from moekv.server.options import ServerOptions

    monkeypatch.delenv("MOEKV_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    options = ServerOptions(api_key="bench-key", shutdown_timeout=5)
    with ServerThread(default_model_path(), max_model_len=64, max_num_seqs=4,
                                          options=options) as srv:
        base = ["bench", "serve", "--url", srv.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                "--no-progress", "--json"]
        assert main(base) == 2
        assert "401" in capsys.readouterr().err
        assert main(base + ["--api-key", "bench-key"]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 2
        monkeypatch.setenv("MOEKV_API_KEY", "bench-key")
        assert main(base) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 2
