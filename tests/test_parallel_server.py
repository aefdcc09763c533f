"""`moekv serve --tensor-parallel-size 2 --enable-expert-parallel` on the CPU answers a streamed request
with the one-process engine's text, and /metrics counts the bytes its ranks sent each other."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from moekv import LLM, SamplingParams
from tests.server_harness import scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_with_two_ranks_streams(mixtral_ckpt):
    prompt = "The quick brown fox"
    llm = LLM(model=str(mixtral_ckpt), dtype="float32", max_model_len=128)
    expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moekv.cli", "serve", "--model", str(mixtral_ckpt), "--dtype", "float32",
         "--max-model-len", "128", "--num-kv-blocks", "32", "--tensor-parallel-size", "2",
         "--enable-expert-parallel", "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        text, chunks = "", 0
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    chunks += 1
        assert chunks > 1 and text == expected
        metrics = scrape(url)
        assert metrics["moekv:ep_bytes_sent_total"] > 0
        assert metrics["moekv:ep_bytes_sent_total"] == metrics["moekv:ep_bytes_received_total"]
    finally:
        server.terminate()
        server.wait(timeout=60)
