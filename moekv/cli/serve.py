"""`moekv serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine."""
from __future__ import annotations

import argparse

from moekv.cli.engine_args import add_engine_args, engine_config_from
from moekv.server.options import API_KEY_ENV, ServerOptions


def cmd_serve(args: argparse.Namespace) -> int:
    from moekv.engine.llm_engine import LLMEngine
    from moekv.server.app import build_app
    from moekv.server.guard import make_server

    if args.max_queue < 1:
        raise ValueError(f"--max-queue={args.max_queue} must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} is out of range; accepted: 0..65535")
    options = ServerOptions.with_env_key(
        args.api_key, metrics_require_key=args.metrics_require_key, max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout, timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency or None, shutdown_timeout=args.shutdown_timeout)
    if options.metrics_require_key and options.api_key is None:
        raise ValueError("--metrics-require-key needs an API key (--api-key or MOEKV_API_KEY)")
    engine = LLMEngine(engine_config_from(args))
    if engine.runner.graphs is not None:  # captured now, so that no request waits for a capture
        import time

        start = time.perf_counter()
        n = engine.runner.capture_decode_graphs()
        print(f"moekv serve: captured {n} decode-step CUDA graphs in {time.perf_counter() - start:.1f} s", flush=True)
    app = build_app(engine, model_name=args.served_model_name, max_queue=args.max_queue, options=options)
    name = app.state.moekv.model_name
    print(f"moekv serve: {name!r} (max_model_len {engine.max_model_len}, KV {engine.runner.kv_format.name}, "
          f"{engine.block_manager.num_blocks} pages of {engine.config.cache.block_size} tokens) on "
          f"http://{args.host}:{args.port}" + (" (API key required)" if options.api_key else ""),
          flush=True)
    try:
        make_server(app, options, host=args.host, port=args.port, log_level=args.log_level).run()
    finally:
        engine.shutdown()  # the worker ranks of --tensor-parallel-size > 1
    return 0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the `moekv` sub-command parsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                            "/metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="sequences that may wait for a place in the batch (a request with n choices counts n); "
                        "beyond it the server answers 503")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model path)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level")
    d = ServerOptions()
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}, "
                        "else none)")
    p.add_argument("--metrics-require-key", action="store_true", help="put /metrics behind the API key too")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body accepted; beyond it the server answers 413")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="seconds a client has to send a request's headers, and then its body (else 408 and the "
                        "connection is closed)")
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="open connections served at once; beyond it requests get 503 (0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM/SIGINT: seconds running requests may take to finish before every connection "
                        "is closed")
    p.set_defaults(func=cmd_serve)
    return p
