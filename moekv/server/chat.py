"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then generated
like a completion (n choices, logprobs with top_logprobs, streaming)."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moekv.engine.llm_engine import LLMEngine, PromptTooLongError
from moekv.outputs import RequestOutput
from moekv.server.protocol import APIError, ChatCompletionRequest, ChatMessage, parse_body
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


def render_messages(engine: LLMEngine, messages: list[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of the conversation as the model's chat template lays it out."""
    plain = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
              "\n".join(part.text for part in m.content or [])} for m in messages]
    try:
        text = engine.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    # the template writes any BOS itself, so by default the tokenizer adds none
    try:
        return engine.encode_text(text, add_special_tokens=add_special_tokens, name="messages")
    except PromptTooLongError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


def chat_logprobs(engine: LLMEngine, token_ids: list[int], entries: list, top_n: int) -> dict[str, Any]:
    def item(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(engine, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = await state.run_blocking(parse_body, await request.body(), ChatCompletionRequest)
    state.check_model(req.model)
    engine = state.engine
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    top_n = req.top_logprobs or 0
    mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(engine, req, max_tokens=max_tokens, logprobs=top_n if req.logprobs else None,
                             names={"logprobs": "top_logprobs", "max_tokens": mt_param})
    prompt = {"prompt_token_ids": await state.run_blocking(render_messages, engine, req.messages,
                                                           req.add_generation_prompt)}
    request_id = new_id("chatcmpl")
    seqs = await state.run_blocking(make_sequences, state, request_id, [prompt], params, req.n,
                                    mt_param if max_tokens is not None else None, "messages",
                                    structured_param(req))
    index = {seq.request_id: i for i, seq in enumerate(seqs)}
    handle = submit(state, seqs)
    head = {"id": request_id, "created": now(), "model": state.model_name}

    def logprobs_of(ids: list[int], entries: list | None):
        return chat_logprobs(engine, ids, entries or [], top_n) if req.logprobs else None

    if not req.stream:
        finals = await collect(state, request, handle)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = []
        for seq in seqs:
            comp = finals[seq.request_id].outputs[0]
            choices.append({"index": index[seq.request_id], "message": {"role": "assistant", "content": comp.text},
                            "logprobs": logprobs_of(comp.token_ids, comp.logprobs),
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        completion = sum(len(finals[s.request_id].outputs[0].token_ids) for s in seqs)
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": usage(prompt_tokens(seqs, req.n), completion)})

    started: set[str] = set()
    head = {**head, "object": "chat.completion.chunk"}
    counts = StreamUsage(head, seqs, req.n, req.stream_options)

    def render(out: RequestOutput) -> dict | None:
        comp, rid, delta = out.outputs[0], out.request_id, out.delta_text
        first = rid not in started
        started.add(rid)
        if not (delta or out.delta_token_ids or out.finished or first):
            return None
        n_new = len(out.delta_token_ids)
        entries = (comp.logprobs or [])[len(comp.logprobs or []) - n_new:] if n_new else []
        choice = {"index": index[rid],
                  "delta": {"role": "assistant", "content": delta} if first else {"content": delta},
                  "logprobs": logprobs_of(out.delta_token_ids, entries),
                  "finish_reason": comp.finish_reason if out.finished else None}
        return counts.add({**head, "choices": [choice]}, out)

    return stream_response(state, handle, render, counts.final)
