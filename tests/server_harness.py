"""Run `moekv serve`'s app on a loopback port in a background thread (uvicorn), for tests."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from moekv import EngineConfig
from moekv.engine.llm_engine import LLMEngine
from moekv.server.app import build_app
from moekv.server.guard import make_server
from moekv.server.options import ServerOptions

NO_EOS = {"ignore_eos": True}  # vLLM's extra field: token counts become exact


def assert_pool_empty(srv: "ServerThread") -> None:
    """No request is left in the engine and every page is back in the pool."""
    srv.wait_idle()
    engine = srv.engine
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])


class ServerThread:
    """with ServerThread(engine_kwargs, max_queue=...) as srv: srv.url, srv.engine, srv.state"""

    def __init__(self, model, max_queue: int | None = 1024, model_name: str = "tiny", engine: LLMEngine | None = None,
                 options: ServerOptions | None = None, **engine_kwargs) -> None:
        """engine: serve this engine (model and engine_kwargs unused); else a float32 one of model.
        options: the server's limits and API key (default: `moekv serve`'s defaults, a 5 s drain)."""
        self.engine = engine or LLMEngine(EngineConfig(model=model, dtype="float32", **engine_kwargs))
        self.options = options or ServerOptions(shutdown_timeout=5)
        self.app = build_app(self.engine, model_name=model_name, max_queue=max_queue, options=self.options)
        self.state = self.app.state.moekv
        self.model_name = model_name

    def __enter__(self) -> "ServerThread":
        # client, server and engine share the CI's 2 cores: keep torch from oversubscribing them
        self.torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(self.app, self.options, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        torch.set_num_threads(self.torch_threads)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request (aborts travel through the engine thread)."""
        engine, deadline = self.engine, time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not engine.has_unfinished_requests() and self.state.async_engine.num_queued() == 0:
                return
            time.sleep(0.02)


def scrape(url: str) -> dict[str, float]:
    """/metrics -> {'name{label=value,...}': value}, the model_name label left out."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values
