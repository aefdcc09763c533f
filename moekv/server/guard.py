"""What stands between the network and the API: API keys, request size and read-time limits, a cap
on connections, and a shutdown that ends however slow its clients are.

- `GuardMiddleware` (ASGI) checks `Authorization: Bearer KEY` (constant-time compare; /health
  always open, /metrics open unless `metrics_require_key`), refuses a body over `max_request_bytes`
  with 413 (from Content-Length at once, or while reading a chunked body), and reads the whole body
  within `read_timeout` seconds of the request's headers, else 408 and the connection is closed.
  The app then gets the buffered body, so no route ever waits on a slow client, and a client that
  leaves mid-body ends the request quietly (no ClientDisconnect traceback).
- `GuardedH11Protocol` (uvicorn's h11 protocol) adds what ASGI cannot see: a deadline for the
  request headers (a connection that trickles or never sends them is closed; with a 408 when it
  sent part of them) and the connection cap answered with OpenAI's 503 body.
- `GuardedServer` (uvicorn.Server): on SIGTERM it stops accepting, lets running requests finish for
  at most `shutdown_timeout` seconds, then finishes those still running with finish_reason "abort"
  (a response with the text so far; for a stream its last chunk and [DONE]), and closes every
  connection still open, stalled ones included.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from moekv.server.options import OPEN_PATHS, ServerOptions
from moekv.server.protocol import APIError

log = logging.getLogger("moekv.server")

def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def send_error(send, err: APIError, close: bool = False, headers: list | None = None) -> None:
    body = json.dumps(err.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyError(Exception):
    def __init__(self, err: APIError | None, close: bool = True) -> None:
        self.err = err  # None: the client has gone
        self.close = close  # the rest of the body was not read: the connection cannot carry another request


# a body over the limit is read and dropped up to this many bytes more before the 413, so the client
# (still sending) reads the answer instead of a reset connection; beyond it the connection is closed
DISCARD_BYTES = 64 * 2**20


class GuardMiddleware:
    def __init__(self, app, options: ServerOptions) -> None:
        self.app = app
        self.options = options
        self._key = options.api_key.encode() if options.api_key else None

    def _needs_key(self, path: str) -> bool:
        if self._key is None or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.options.metrics_require_key

    def _key_error(self, scope) -> APIError | None:
        """None when the request may pass; else the 401 it gets: no key given (no Authorization
        header, another scheme than Bearer, or an empty token) or a wrong one."""
        if not self._needs_key(scope["path"]):
            return None
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return _no_key()
        # compare_digest takes the same time wherever the first difference is
        return None if hmac.compare_digest(token, self._key) else _wrong_key()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        unauthorized = self._key_error(scope)
        try:
            body = await self._read_body(scope, receive)
        except _BodyError as e:
            if e.err is not None:
                await send_error(send, unauthorized or e.err, close=e.close)
            return  # the client has gone: nobody to answer
        if unauthorized:  # answered after the body is read, so the connection stays usable
            await send_error(send, unauthorized, headers=[(b"www-authenticate", b"Bearer")])
            return

        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect when the client goes (the stream watchers wait for it)

        await self.app(scope, replay, send)

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.options.max_request_bytes
        length = _header(scope, b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > limit + DISCARD_BYTES:
            raise _BodyError(_too_large(declared, limit))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.read_timeout
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                if size > limit or (declared is not None and declared > limit):
                    raise _BodyError(_too_large(declared, limit)) from None  # too large whatever else
                wait = self.options.read_timeout
                raise _BodyError(APIError(408, f"the request body did not arrive within {wait:g} s (--read-timeout)",
                                          code="request_timeout")) from None
            if message["type"] == "http.disconnect":
                raise _BodyError(None)
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > limit:  # drop what came; keep reading (up to DISCARD_BYTES more) to answer cleanly
                chunks = []
                if not more:
                    raise _BodyError(_too_large(declared, limit), close=False)
                if size > limit + DISCARD_BYTES:
                    raise _BodyError(_too_large(declared, limit))
                continue
            chunks.append(chunk)
            if not more:
                return b"".join(chunks)


# OpenAI's 401s begin with these sentences (clients and people search for them); both carry the code
# invalid_api_key (OpenAI leaves it null when no key came), so a client tells a key's 401 by the code alone
def _no_key() -> APIError:
    return APIError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                         "('Authorization: Bearer KEY').", code="invalid_api_key")


def _wrong_key() -> APIError:
    return APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer KEY'.",
                    code="invalid_api_key")


def _too_large(length: int | None, limit: int) -> APIError:
    got = f"{length} bytes" if length is not None else "more than that"
    return APIError(413, f"the request body is too large: at most {limit} bytes are accepted (--max-request-bytes), "
                         f"got {got}", code="request_too_large")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers and an OpenAI-style 503 at the
    connection cap. The deadline runs from the connection's start, and from the end of each
    response for the next request on a kept-alive connection."""

    read_timeout = 30.0  # set per server by make_server (a subclass per ServerOptions)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of the next request's headers have arrived
        self._limit, self.limit_concurrency = self.limit_concurrency, None  # checked here, with our body
        inner = self.app

        async def app(scope, receive, send):
            if self._limit is not None and scope["type"] == "http" and (
                    len(self.connections) > self._limit or len(self.tasks) > self._limit):
                log.warning("refused a request: %d connections open (--limit-concurrency=%d)",
                            len(self.connections), self._limit)
                err = APIError(503, f"the server is at its connection limit (--limit-concurrency={self._limit}); "
                                    "retry later", code="too_many_connections")
                await send_error(send, err, close=True, headers=[(b"retry-after", b"1")])
                return
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._partial = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the body has its own deadline
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def on_response_complete(self) -> None:
        self._cancel_header_timer()
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._partial = False
        self._header_timer = self.loop.call_later(self.read_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being sent (pipelining); its end re-arms the timer
        if self._partial:  # part of a request came: say why it is being closed
            body = json.dumps(APIError(408, f"the request headers did not arrive within {self.read_timeout:g} s "
                                            "(--read-timeout)", code="request_timeout").body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
        self.transport.close()


# after the drain, the seconds given to answering the aborted requests (the engine's current step ends,
# then each response or stream's last chunk is written) before every connection still open is closed
FINISH_GRACE = 2.0


class GuardedServer(uvicorn.Server):
    """uvicorn.Server whose shutdown ends however slow its clients are: when the drain time is over,
    `on_drain_end` (the app's AsyncEngine.finish_all) finishes what still runs with finish_reason
    "abort", those answers are written for up to FINISH_GRACE seconds, then every connection still
    open is closed."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, on_drain_end=None) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_drain_end = on_drain_end  # () -> awaitable, resolved when the finishing answers are under way

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        tasks = []
        timer = loop.call_later(self.shutdown_timeout, lambda: tasks.append(loop.create_task(self._end_drain())))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            for task in tasks:
                task.cancel()

    async def _end_drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINISH_GRACE
        if self.on_drain_end is not None:
            log.warning("shutdown: the drain time (--shutdown-timeout=%g s) is over; finishing the running "
                        "requests with finish_reason 'abort'", self.shutdown_timeout)
            try:
                async with asyncio.timeout_at(deadline):
                    await self.on_drain_end()
            except TimeoutError:  # the engine is stuck in a step, or dead: close anyway
                pass
            # uvicorn closes each connection once its response is complete (no keep-alive in shutdown)
            while self._open_connections() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self._close_connections()

    def _open_connections(self) -> list:
        return [c for c in list(self.server_state.connections) if getattr(c, "transport", None) is not None
                and not c.transport.is_closing()]

    def _close_connections(self) -> None:
        open_ = self._open_connections()
        if open_:
            log.warning("shutdown: closing %d connection(s) still open after the drain (--shutdown-timeout=%g s)",
                        len(open_), self.shutdown_timeout)
        for conn in open_:
            conn.transport.abort()  # at once, even with unsent data (a client that stopped reading)


def make_server(app, options: ServerOptions, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> GuardedServer:
    """The uvicorn server of `moekv serve` (h11, with the guards above)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": options.read_timeout})
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol, ws="none", lifespan="on",
        timeout_keep_alive=options.timeout_keep_alive, limit_concurrency=options.limit_concurrency,
        # a backstop: tasks still running a little after the connections were closed are cancelled
        timeout_graceful_shutdown=options.shutdown_timeout + FINISH_GRACE + 5)
    state = getattr(getattr(app, "state", None), "moekv", None)  # the ServerState of build_app's app
    return GuardedServer(config, options.shutdown_timeout,
                         on_drain_end=state.async_engine.finish_all if state is not None else None)
