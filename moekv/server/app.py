"""The FastAPI application: OpenAI-compatible routes, /tokenize, /detokenize, /health, /metrics.

Every error leaves as OpenAI's JSON body ({"error": {"message", "type", "param", "code"}}):
400 for bad parameters and prompts that do not fit, 404 for an unknown model or path, 503 when
the waiting queue is full, 500 only when the engine itself failed.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from moekv.engine.llm_engine import LLMEngine, PromptTooLongError
from moekv.server.async_engine import AsyncEngine
from moekv.server.chat import create_chat_completion, render_messages
from moekv.server.completions import create_completion
from moekv.server.guard import GuardMiddleware
from moekv.server.metrics import ServerMetrics
from moekv.server.options import ServerOptions
from moekv.server.protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body
from moekv.server.serving import ServerState

log = logging.getLogger("moekv.server")


def build_app(engine: LLMEngine, model_name: str | None = None, max_queue: int | None = 1024,
              options: ServerOptions | None = None) -> FastAPI:
    """An app serving `engine` under `model_name` (default: the --model path, as vLLM names it).
    The engine thread starts and stops with the app's lifespan. options: the API key and request
    limits (guard.py; default: ServerOptions(), an open server)."""
    if max_queue is not None and max_queue < 1:
        raise ValueError(f"max_queue={max_queue} must be an integer >= 1 (or None for no limit)")
    name = model_name or str(engine.config.model)
    metrics = ServerMetrics(engine, name)
    state = ServerState(engine, AsyncEngine(engine, metrics, max_queue), metrics, name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()
        try:
            yield
        finally:
            state.async_engine.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="moekv", lifespan=lifespan)
    app.state.moekv = state
    app.state.options = options = options or ServerOptions()
    app.add_middleware(GuardMiddleware, options=options)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, detail).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "moekv",
                "root": str(engine.config.model), "parent": None, "max_model_len": engine.max_model_len,
                "quantization": engine.runner.quantization}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await state.run_blocking(parse_body, await request.body(), TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt",
                           code="invalid_value")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await state.run_blocking(encode_prompt, req.prompt, add)
        else:
            ids = await state.run_blocking(render_messages, engine, req.messages, req.add_generation_prompt,
                                           bool(req.add_special_tokens))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    def encode_prompt(prompt: str, add_special_tokens: bool) -> list[int]:
        try:
            return engine.encode_text(prompt, add_special_tokens=add_special_tokens)
        except PromptTooLongError as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_value") from None

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await state.run_blocking(parse_body, await request.body(), DetokenizeRequest)
        state.check_model(req.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens",
                           code="invalid_value")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health() -> Response:
        if not state.async_engine.is_alive:
            raise APIError(503, f"the engine is not running ({state.async_engine.dead!r})", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    return app
