"""What completions and chat share: request -> validated engine sequences, queueing, waiting for
the results (aborting when the client leaves), streaming deltas, and the usage block.

`n` choices are n engine requests with derived seeds (seed + i), merged back into one response;
a request with several prompts (completions) gives prompts x n choices, index = prompt * n + i.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from moekv.engine.llm_engine import LLMEngine, PromptTooLongError
from moekv.engine.sequence import Sequence
from moekv.outputs import RequestOutput
from moekv.sampling_params import SamplingParams, SamplingParamsError
from moekv.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestHandle, ShuttingDownError
from moekv.server.metrics import ServerMetrics
from moekv.server.protocol import APIError
from moekv.structured_outputs import StructuredOutputsError, StructuredOutputsParams

# request fields that default to the checkpoint's generation_config.json (as vLLM does)
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    # parsing, tokenizing and chat-template rendering run here, off the event loop, so that one large
    # request does not hold up /health and every stream (the tokenizer releases the interpreter)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="moekv-tokenize"))

    async def run_blocking(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the executor; its exceptions (APIError included) come back here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(see /v1/models)", param="model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_param(req: Any) -> str | None:
    """The API field that asks for structured outputs (None: none does; 'text' is no constraint)."""
    given = [name for name in _GUIDED if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output; send one of them",
                       param=given[1], code="invalid_value")
    return given[0] if given else None


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The request's output constraint (compiled later, with the sequences), or a 400 naming the field."""
    param = structured_param(req)
    if param is None:
        return None
    try:
        if param != "response_format":
            return StructuredOutputsParams(**{_GUIDED[param]: getattr(req, param)})
        fmt = req.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type 'json_schema' needs json_schema: {\"name\": ..., \"schema\": "
                                "{...}}", param="response_format.json_schema", code="invalid_value")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    except StructuredOutputsError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None


def sampling_params(engine: LLMEngine, req: Any, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams of one request; a bad value is a 400 naming the API parameter (names maps the
    SamplingParams field to it where they differ) and the accepted range."""
    base = engine.default_sampling_params()
    kwargs = {f: getattr(req, f) if getattr(req, f) is not None else getattr(base, f) for f in _DEFAULTED}
    try:
        return SamplingParams(
            max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured_outputs(req), **kwargs)
    except SamplingParamsError as e:
        param = (names or {}).get(e.field, e.field)
        raise APIError(400, e.message_for(param), param=param, code="invalid_value") from None
    except ValueError as e:  # a value no single field is to blame for
        raise APIError(400, str(e), param=None, code="invalid_value") from None


def make_sequences(state: ServerState, request_id: str, prompts: list, params: SamplingParams, n: int,
                   max_tokens_param: str | None, prompt_param: str,
                   structured_param_name: str | None = None) -> list[Sequence]:
    """prompts x n validated Sequences (nothing queued yet). max_tokens_param: the API field that
    set params.max_tokens, checked against the room the prompt leaves (None: not given).
    structured_param_name: the API field whose constraint params carries (named when it cannot compile)."""
    engine = state.engine
    aeng = state.async_engine
    if aeng.max_queue is not None and len(prompts) * n > aeng.max_queue + aeng.max_num_seqs:
        raise APIError(400, f"this request needs {len(prompts) * n} sequences ({len(prompts)} prompts x n={n}) "
                            f"but the server takes at most max_num_seqs + max_queue = {aeng.max_num_seqs} + "
                            f"{aeng.max_queue} at once", param="n", code="invalid_value")
    seqs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            sp = params
            if n > 1 and params.seed is not None:  # distinct but reproducible choices
                sp = dataclasses.replace(params, seed=params.seed + i)
            try:
                seq = engine.make_sequence(prompt, sp, request_id=f"{request_id}-{p * n + i}")
            except PromptTooLongError as e:
                raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
            except StructuredOutputsError as e:  # the constraint did not compile
                param = structured_param_name
                raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
            except ValueError as e:
                raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None
            if max_tokens_param and seq.num_prompt_tokens + params.max_tokens > engine.max_model_len:
                room = engine.max_model_len - seq.num_prompt_tokens
                raise APIError(400, f"{max_tokens_param}={params.max_tokens} plus the prompt ({seq.num_prompt_tokens} "
                                    f"tokens) exceeds max_model_len={engine.max_model_len}; accepted: at most {room}",
                               param=max_tokens_param, code="context_length_exceeded")
            seq.output_kind = "delta"  # running outputs carry the step's part, not a copy of everything
            seqs.append(seq)
    return seqs


def submit(state: ServerState, seqs: list[Sequence]) -> RequestHandle:
    try:
        return state.async_engine.submit(seqs)
    except QueueFullError as e:
        raise APIError(503, str(e), code="queue_full") from None
    except EngineDeadError as e:
        raise APIError(500, str(e), code="engine_dead") from None
    except ShuttingDownError as e:
        raise APIError(503, str(e), code="shutting_down") from None


async def wait_for_disconnect(request) -> None:
    """Returns when the client has gone (the body is already read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(state: ServerState, request, handle: RequestHandle) -> dict[str, RequestOutput] | None:
    """Final output of every request id, or None if the client left first (then all are aborted)."""
    async def gather() -> dict[str, RequestOutput]:
        return {out.request_id: out async for out in handle.outputs() if out.finished}

    task = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return None
        finals = task.result()
    except EngineDeadError as e:
        raise APIError(500, str(e), code="engine_dead") from None
    finally:
        task.cancel()
        watcher.cancel()
        abort_unfinished(state, handle)
    for out in finals.values():
        if out.error is not None:
            raise APIError(500, f"the engine failed on this request: {out.error}", code="engine_error")
    return finals


def abort_unfinished(state: ServerState, handle: RequestHandle) -> None:
    if handle.unfinished:
        state.async_engine.abort(sorted(handle.unfinished))
        handle.unfinished.clear()  # no outputs come for aborted requests; abort once


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(message: str, status: int = 500, code: str = "engine_error") -> str:
    return sse(APIError(status, message, code=code).body())


def now() -> int:
    return int(time.time())


def token_text(engine: LLMEngine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


class _AbortOnClose(StreamingResponse):
    """A stream cancelled before its generator first ran never reaches the generator's `finally`;
    this one aborts what is unfinished however the response ends."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def stream_response(state: ServerState, handle: RequestHandle, render, final_usage) -> StreamingResponse:
    """Server-sent events of one streaming request: render(out) -> chunk dict or None for each
    engine output (whose delta_text holds back a tail that may begin a stop string, flushed at the
    end), then final_usage() -> chunk or None, then [DONE]. Leaving early (client gone, error)
    aborts whatever is unfinished, so its pages return to the pool."""
    return _AbortOnClose(_events(state, handle, render, final_usage), lambda: abort_unfinished(state, handle))


async def _events(state: ServerState, handle: RequestHandle, render, final_usage):
    streamed: dict[str, int] = {}  # characters of each choice's text sent so far
    try:
        async for out in handle.outputs():
            if out.error is not None:
                yield sse_error(f"the engine failed on this request: {out.error}")
                break
            if out.finished and out.outputs[0].finish_reason == "abort":
                # an abort (shutdown) carries no delta: send the text held back so far (a tail that
                # might have begun a stop string); a final output holds the whole text
                out = dataclasses.replace(out, delta_text=out.outputs[0].text[streamed.get(out.request_id, 0):])
            streamed[out.request_id] = streamed.get(out.request_id, 0) + len(out.delta_text)
            chunk = render(out)
            if chunk is not None:
                yield sse(chunk)
        else:
            last = final_usage()
            if last is not None:
                yield sse(last)
        yield sse("[DONE]")
    except EngineDeadError as e:
        yield sse_error(str(e), code="engine_dead")
        yield sse("[DONE]")
    finally:
        abort_unfinished(state, handle)


class StreamUsage:
    """Token counts of one streaming request: usage on every chunk when the client asked for
    `continuous_usage_stats`, and the closing usage chunk when it asked for `include_usage`."""

    def __init__(self, head: dict, seqs: list[Sequence], n: int, options) -> None:
        self.head, self.seqs, self.n, self.options = head, seqs, n, options
        self.tokens: dict[str, int] = {}  # generated so far, per choice (outputs carry deltas)
        self.done_tokens: dict[str, int] = {}

    def add(self, chunk: dict, out: RequestOutput) -> dict:
        rid = out.request_id
        self.tokens[rid] = self.tokens.get(rid, 0) + len(out.delta_token_ids)
        if out.finished:
            self.done_tokens[rid] = len(out.outputs[0].token_ids)  # a final output holds all of them
        if self.options and self.options.include_usage and self.options.continuous_usage_stats:
            chunk["usage"] = usage(len(out.prompt_token_ids), self.tokens[rid])
        return chunk

    def final(self) -> dict | None:
        if not (self.options and self.options.include_usage):
            return None
        return {**self.head, "choices": [],
                "usage": usage(prompt_tokens(self.seqs, self.n), sum(self.done_tokens.values()))}


def prompt_tokens(seqs: list[Sequence], n: int) -> int:
    """Prompt tokens of a request, each prompt counted once however many choices it has."""
    return sum(seq.num_prompt_tokens for seq in seqs[::n])
