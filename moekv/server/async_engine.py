"""AsyncEngine: the LLMEngine stepping in its own thread, fed by the server's event loop.

A step is CPU/GPU work that holds the interpreter for milliseconds; run on the event loop it
would stall every connection. So one thread owns the engine: between steps it takes new
requests and aborts from an inbox, and after each step it hands each output to the asyncio
queue of the HTTP request it belongs to. Requests therefore join and leave the running batch
at any step (continuous batching). Only the engine thread calls into the LLMEngine, except
`make_sequence`, which only validates and tokenizes.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from moekv.engine.llm_engine import LLMEngine
from moekv.engine.sequence import Sequence
from moekv.outputs import RequestOutput
from moekv.server.metrics import ServerMetrics

log = logging.getLogger("moekv.server")


class QueueFullError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass


class ShuttingDownError(RuntimeError):
    pass


@dataclass(eq=False)
class RequestHandle:
    """The engine requests behind one HTTP request (prompts x n choices) and their outputs."""

    request_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    async def outputs(self):
        """Yield RequestOutputs (of any of the request ids) until every one has finished."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Lock()  # guards the inbox and the published waiting count
        self._inbox: list[tuple] = []
        self._num_inbox_adds = 0
        self._num_waiting = 0  # engine.num_waiting as of the last drain or step
        self._num_running = 0  # ... and engine.num_running
        self.max_num_seqs = engine.config.scheduler.max_num_seqs  # batch slots: requests up to it never wait
        self._wakeup = threading.Event()
        self._stopping = False
        self._closed = False  # finish_all ran: no request is taken any more
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self.dead: BaseException | None = None

    # -- lifecycle (event loop) --------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="moekv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # -- requests (event loop) ---------------------------------------------------------------
    def num_queued(self) -> int:
        """Requests accepted but not yet running: the engine's waiting queue plus the inbox."""
        with self._lock:
            return self._num_waiting + self._num_inbox_adds

    def _num_beyond_slots(self, extra: int = 0) -> int:
        """Of the requests not yet running (plus `extra` more), those the free batch slots cannot take
        at the next step: the ones that will wait. Caller holds the lock."""
        free = max(0, self.max_num_seqs - self._num_running)
        return max(0, self._num_waiting + self._num_inbox_adds + extra - free)

    def submit(self, seqs: list[Sequence]) -> RequestHandle:
        """Queue validated sequences; raises QueueFullError (all or none are queued) when more than
        max_queue would wait for a batch slot (a burst the free slots can take is never refused),
        ShuttingDownError after finish_all."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self.dead!r})")
        handle = RequestHandle([s.request_id for s in seqs])
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the server is shutting down; retry on another replica or later")
            if self.max_queue is not None and self._num_beyond_slots(len(seqs)) > self.max_queue:
                waiting = self._num_beyond_slots()
                raise QueueFullError(f"the waiting queue is full ({waiting} of max_queue={self.max_queue} "
                                     f"waiting for a batch slot; this request needs {len(seqs)}); retry later")
            self._inbox.append(("add", seqs, handle))
            self._num_inbox_adds += len(seqs)
        self._wakeup.set()
        return handle

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (finished ones are skipped by the engine); their pages return to the pool."""
        with self._lock:
            self._inbox.append(("abort", request_ids, None))
        self._wakeup.set()

    def finish_all(self) -> asyncio.Future:
        """Shutdown: abort every request, delivering each one's final output (finish_reason "abort",
        the text so far) to its client, and take no more. The returned future resolves once those
        outputs are on their way to the clients (after the engine's current step)."""
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            self._closed = True
            self._inbox.append(("finish_all", None, done))
        self._wakeup.set()
        return done

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                self.metrics.on_outputs(outputs)
                # publish gauges before delivering, so a client that saw a token sees them current
                self._publish()
                self._deliver(outputs)
        except BaseException as e:  # a bug outside a model step: fail everyone, report unhealthy
            log.exception("the engine loop stopped")
            self.dead = e
            err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            self._post([(h, err) for h in set(self._handles.values())])
            self._handles.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox, self._num_inbox_adds = self._inbox, [], 0
            for kind, payload, handle in items:
                if kind == "add":
                    for seq in payload:
                        self.engine.add_sequence(seq)
                        self._handles[seq.request_id] = handle
                elif kind == "abort":
                    for rid in payload:
                        self._abort(rid)
                        self._handles.pop(rid, None)
                else:  # finish_all: unlike a client's abort, each client still gets its final output
                    finals = []
                    for rid, owner in list(self._handles.items()):
                        out = self._abort(rid)
                        if out is not None:
                            finals.append((owner, out))
                    self._handles.clear()
                    self._post(finals)
                    self._resolve(handle, len(finals))
            self._num_waiting = self.engine.num_waiting
            self._num_running = self.engine.num_running
        if items:
            self._publish()

    def _publish(self) -> None:
        with self._lock:
            self._num_waiting = self.engine.num_waiting
            self._num_running = self.engine.num_running
        self.metrics.on_step(self.engine)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:  # aborted while this step ran
                continue
            if out.finished:
                del self._handles[out.request_id]
            batch.append((handle, out))
        self._post(batch)

    def _abort(self, request_id: str):
        """Abort one request in the engine (engine thread only); its final output, counted by the
        metrics, or None when the engine no longer had it."""
        out = self.engine.abort_request(request_id)
        if out is not None:
            self.metrics.on_finished(out)
        return out

    def _resolve(self, future: asyncio.Future, value) -> None:
        """Resolve an event-loop future from this thread, after everything posted before it."""
        def set_result() -> None:
            if not future.done():
                future.set_result(value)

        try:
            self._loop.call_soon_threadsafe(set_result)
        except RuntimeError:  # the event loop has closed
            pass

    def _post(self, batch: list) -> None:
        if not batch or self._loop is None:
            return

        def put_all() -> None:
            for handle, item in batch:
                handle.queue.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass
