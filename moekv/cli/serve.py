"""`moekv serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine."""
from __future__ import annotations

import argparse

from moekv.cli.engine_args import add_engine_args, engine_config_from


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from moekv.engine.llm_engine import LLMEngine
    from moekv.server.app import build_app

    if args.max_queue < 1:
        raise ValueError(f"--max-queue={args.max_queue} must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} is out of range; accepted: 0..65535")
    engine = LLMEngine(engine_config_from(args))
    if engine.runner.graphs is not None:  # captured now, so that no request waits for a capture
        import time

        start = time.perf_counter()
        n = engine.runner.graphs.capture_all()
        print(f"moekv serve: captured {n} decode-step CUDA graphs in {time.perf_counter() - start:.1f} s", flush=True)
    app = build_app(engine, model_name=args.served_model_name, max_queue=args.max_queue)
    name = app.state.moekv.model_name
    print(f"moekv serve: {name!r} (max_model_len {engine.max_model_len}, KV {args.kv_cache_dtype}, "
          f"{engine.block_manager.num_blocks} pages of {engine.config.block_size} tokens) on "
          f"http://{args.host}:{args.port}",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()  # the worker ranks of --tensor-parallel-size > 1
    return 0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the `moekv` sub-command parsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                            "/metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=1024,
                   help="sequences that may wait for a place in the batch (a request with n choices counts n); "
                        "beyond it the server answers 503")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model path)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return p
