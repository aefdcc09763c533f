"""POST /v1/completions: text or token-id prompts (one or a batch), n choices, logprobs, and echo
with the prompt's logprobs (what lm-evaluation-harness uses to score log-likelihoods)."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moekv.engine.llm_engine import LLMEngine
from moekv.outputs import RequestOutput
from moekv.server.protocol import APIError, CompletionRequest, parse_body
from moekv.server.serving import (
    ServerState,
    StreamUsage,
    collect,
    make_sequences,
    new_id,
    now,
    prompt_tokens,
    sampling_params,
    stream_response,
    structured_param,
    submit,
    token_text,
    usage,
)


def _prompts(prompt: str | list) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list; give a string, token ids, or a list of either",
                       param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def completion_logprobs(engine: LLMEngine, token_ids: list[int], entries: list, offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; entries[i] is {token id: logprob} for token_ids[i], or None
    (the first prompt token has nothing before it)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = token_text(engine, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(None if entry is None else entry.get(tid))
        top.append(None if entry is None else {token_text(engine, t): lp for t, lp in entry.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _prompt_text(engine: LLMEngine, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else engine.tokenizer.decode(out.prompt_token_ids)


async def create_completion(state: ServerState, request: Request) -> Response:
    req = await state.run_blocking(parse_body, await request.body(), CompletionRequest)
    state.check_model(req.model)
    engine = state.engine
    echo_logprobs = req.logprobs if req.echo else None
    params = sampling_params(engine, req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=echo_logprobs)
    request_id = new_id("cmpl")
    seqs = await state.run_blocking(make_sequences, state, request_id, _prompts(req.prompt), params, req.n,
                                    "max_tokens" if req.max_tokens is not None else None, "prompt",
                                    structured_param(req))
    index = {seq.request_id: i for i, seq in enumerate(seqs)}
    handle = submit(state, seqs)
    head = {"id": request_id, "object": "text_completion", "created": now(), "model": state.model_name}

    def logprobs_of(out: RequestOutput, ids: list[int], entries: list, offset: int, with_prompt: bool):
        if req.logprobs is None:
            return None
        if with_prompt:
            ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
        return completion_logprobs(engine, ids, entries, offset)

    if not req.stream:
        finals = await collect(state, request, handle)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = []
        for seq in seqs:
            out = finals[seq.request_id]
            comp = out.outputs[0]
            choices.append({
                "index": index[seq.request_id],
                "text": (_prompt_text(engine, out) if req.echo else "") + comp.text,
                "logprobs": logprobs_of(out, comp.token_ids, comp.logprobs or [], 0, req.echo),
                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        completion = sum(len(finals[s.request_id].outputs[0].token_ids) for s in seqs)
        return JSONResponse({**head, "choices": choices, "usage": usage(prompt_tokens(seqs, req.n), completion)})

    started: set[str] = set()
    offsets = {rid: 0 for rid in index}
    counts = StreamUsage(head, seqs, req.n, req.stream_options)

    def render(out: RequestOutput) -> dict | None:
        comp, rid, delta = out.outputs[0], out.request_id, out.delta_text
        first = rid not in started
        started.add(rid)
        if not (delta or out.delta_token_ids or out.finished or (first and req.echo)):
            return None
        n_new = len(out.delta_token_ids)
        new_entries = (comp.logprobs or [])[len(comp.logprobs or []) - n_new:] if n_new else []
        lp = logprobs_of(out, out.delta_token_ids, new_entries, offsets[rid], first and req.echo)
        if first and req.echo:
            delta = _prompt_text(engine, out) + delta
        offsets[rid] += len(delta)
        choice = {"index": index[rid], "text": delta, "logprobs": lp,
                  "finish_reason": comp.finish_reason if out.finished else None,
                  "stop_reason": comp.stop_reason if out.finished else None}
        return counts.add({**head, "choices": [choice]}, out)

    return stream_response(state, handle, render, counts.final)
