"""Soak `moekv serve` on 127.0.0.1: a bounded run of mixed valid, malformed, cancelled and stalled
requests, then SIGTERM with stalled connections still open. Reports the 5xx count, KV pages still
held once idle, the server's RSS before and after, and how long SIGTERM took.

    python scripts/soak_server.py --duration 120 --json soak.json

Starts its own server (the bundled tiny model unless --model; extra server flags after `--`).
Not a unit test: it runs for minutes; --json writes its figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


MALFORMED = [  # (path, raw body)
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[" * 50_000),
    ("/v1/completions", json.dumps({"prompt": "\ud800 x"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}).encode()),
    ("/tokenize", json.dumps({"prompt": "\ud83d"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "8"}).encode()),
    ("/v1/completions", json.dumps({"prompt": [10**9]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/completions", json.dumps({"prompt": "word " * 200_000}).encode()),  # 1 MB: refused before tokenizing
    ("/v1/completions", b'{"prompt": "' + b"x" * (3 * 2**20) + b'"}'),  # over --max-request-bytes: 413
]


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.host, self.port = url.removeprefix("http://").split(":")
        self.rng = random.Random(seed)
        self.status: Counter = Counter()
        self.kinds: Counter = Counter()
        self.errors: list[str] = []

    def record(self, kind: str, status: int, text: str = "") -> None:
        self.kinds[kind] += 1
        self.status[status] += 1
        if status >= 500 and len(self.errors) < 10:
            self.errors.append(f"{kind}: {status} {text[:200]}")

    async def valid(self, c: httpx.AsyncClient) -> None:
        n = self.rng.randint(1, 24)
        if self.rng.random() < 0.5:
            body = {"prompt": f"Chapter {self.rng.randint(1, 99)}. The", "max_tokens": n, "ignore_eos": True,
                    "temperature": self.rng.choice([0.0, 0.8])}
            r = await c.post("/v1/completions", json=body)
        else:
            body = {"messages": [{"role": "user", "content": "Where are you going?"}], "max_tokens": n}
            r = await c.post("/v1/chat/completions", json=body)
        self.record("valid", r.status_code, r.text)

    async def stream(self, c: httpx.AsyncClient, cancel: bool) -> None:
        body = {"prompt": "It was a dark and stormy night", "max_tokens": 60 if cancel else 12, "stream": True,
                "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            lines = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    lines += 1
                    if '"server_error"' in line:
                        self.record("stream_error", 500, line)
                if cancel and lines == 2:
                    break  # leaving the block closes the connection mid-stream
            self.record("cancelled" if cancel else "stream", r.status_code)

    async def malformed(self, c: httpx.AsyncClient) -> None:
        path, raw = self.rng.choice(MALFORMED)
        try:
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
            self.record("malformed", r.status_code, r.text)
        except httpx.TransportError:  # the server may close a connection that sent too much
            self.record("malformed_closed_early", 0)

    async def stalled(self, hold: float) -> None:
        """Half a request, then silence: the server must answer 408 or close (never hang on us)."""
        reader, writer = await asyncio.open_connection(self.host, int(self.port))
        part = self.rng.choice([b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", b""])
        writer.write(part)
        await writer.drain()
        try:
            data = await asyncio.wait_for(reader.read(), timeout=hold)
            if data.startswith(b"HTTP/"):
                self.record("stalled", int(data.split()[1]))
            else:  # sent nothing: closed without an answer
                self.record("stalled_closed", 0)
        except asyncio.TimeoutError:
            self.record("stalled_still_open", 0)
        finally:
            writer.close()

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as c:
            while time.monotonic() < deadline:
                kind = self.rng.choices(["valid", "stream", "cancel", "malformed"], [4, 2, 2, 3])[0]
                try:
                    if kind == "valid":
                        await self.valid(c)
                    elif kind == "malformed":
                        await self.malformed(c)
                    else:
                        await self.stream(c, cancel=kind == "cancel")
                except httpx.TransportError as e:
                    self.record(f"{kind}_transport_error", 0, repr(e))

    async def stall_loop(self, deadline: float, read_timeout: float) -> None:
        while time.monotonic() < deadline:
            await asyncio.gather(*(self.stalled(hold=read_timeout + 10) for _ in range(5)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    ap.add_argument("--model", default=None)
    ap.add_argument("--read-timeout", type=float, default=5.0)
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("server_args", nargs="*", help="extra `moekv serve` flags (after --)")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moekv.cli", "serve", "--port", str(port), "--max-model-len", "256",
           "--max-num-seqs", "32", "--max-queue", "64", "--log-level", "warning", "--read-timeout",
           str(args.read_timeout), "--shutdown-timeout", str(args.shutdown_timeout), "--max-request-bytes",
           str(2 * 2**20), *(["--model", args.model] if args.model else []), *args.server_args]
    # the server's own log, next to the report (or in the temp folder), searched for tracebacks at the end
    log_path = (Path(args.json).with_suffix(".server.log") if args.json
                else Path(tempfile.gettempdir()) / "soak.server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; see {log_path}")
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.3)
        soak = Soak(url, args.seed)
        asyncio.run(warm_up(soak))  # allocations that happen once are not a leak
        rss_before = rss_mib(proc.pid)
        start = time.monotonic()
        end = start + args.duration

        samples = []  # RSS every 10 s: growth that levels off is warm-up, growth that does not is a leak

        async def sample_rss():
            while time.monotonic() < end:
                samples.append(round(rss_mib(proc.pid), 1))
                await asyncio.sleep(10)

        async def load():
            await asyncio.gather(*(soak.client_loop(end) for _ in range(args.clients)),
                                 soak.stall_loop(end, args.read_timeout), sample_rss())

        asyncio.run(load())
        elapsed = time.monotonic() - start
        time.sleep(1.0)  # aborts travel through the engine thread
        m = httpx.get(f"{url}/metrics").text
        pages = metric(m, "moekv:kv_cache_pages_used")
        running = metric(m, "moekv:num_requests_running")
        waiting = metric(m, "moekv:num_requests_waiting")
        rss_after = rss_mib(proc.pid)
        healthy = httpx.get(f"{url}/health").status_code == 200

        # SIGTERM with stalled clients and one long stream still open
        holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        holders[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        holders[1].sendall(b"GET /heal")
        stream = httpx.Client(base_url=url, timeout=60)
        stream_ctx = stream.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True,
                                                                     "ignore_eos": True})
        stream_ctx.__enter__()
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=args.shutdown_timeout + 60)
        sigterm_s = time.monotonic() - t0
        for h in holders:
            h.close()
        try:
            stream_ctx.__exit__(None, None, None)
        except httpx.HTTPError:
            pass
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    server_log = log_path.read_text()
    report = {
        "duration_s": round(elapsed, 1), "clients": args.clients, "requests": sum(soak.kinds.values()),
        "by_kind": dict(soak.kinds), "by_status": {str(k): v for k, v in sorted(soak.status.items())},
        "count_5xx": sum(v for k, v in soak.status.items() if k >= 500), "first_5xx": soak.errors,
        "pages_used_when_idle": pages, "running_when_idle": running, "waiting_when_idle": waiting,
        "healthy_after": healthy, "rss_mib_before": round(rss_before, 1), "rss_mib_after": round(rss_after, 1),
        "rss_mib_every_10s": samples,
        "sigterm_s": round(sigterm_s, 2), "shutdown_timeout_s": args.shutdown_timeout, "exit_status": proc.returncode,
        "tracebacks_in_log": server_log.count("Traceback"),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    ok = (report["count_5xx"] == 0 and pages == 0 and running == 0 and healthy
          and report["tracebacks_in_log"] == 0 and sigterm_s < args.shutdown_timeout + 10)
    return 0 if ok else 1


async def warm_up(soak: Soak) -> None:
    async with httpx.AsyncClient(base_url=soak.url, timeout=120) as c:
        for _ in range(3):
            await soak.valid(c)
            await soak.stream(c, cancel=False)
    soak.status.clear()
    soak.kinds.clear()


if __name__ == "__main__":
    sys.exit(main())
