"""Request bodies of the OpenAI-compatible API (pydantic) and the OpenAI error body.

Models are strict (no "5" for 5) and forbid unknown fields, so a misspelt or unsupported
parameter is a 400 that names it instead of being silently ignored. Value ranges that
SamplingParams already checks are left to it, so there is one source of truth for them.
"""
from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moekv.models.tokenizer import CHAT_ROLES

MAX_N = 128  # choices per request, as OpenAI allows
MAX_JSON_DEPTH = 32  # nested arrays/objects in a request body (the deepest valid request has 5)


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "overloaded_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    """text with anything UTF-8 cannot carry (lone surrogates from the request) written as escapes."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JSONSchemaFormat(_Strict):
    """response_format.json_schema: OpenAI's named schema (strict or not, the output always follows it)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by completions and chat; None means "the model's generation_config default"."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what torch.Generator takes
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # vLLM's extra sampling fields (sent by clients as extra_body)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, or one of vLLM's guided_* extra fields
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own is for abuse tracking


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


ChatRole = Literal[CHAT_ROLES]  # (tokenizer.CHAT_ROLES says which and why; LLM.chat refuses the others too)


class ChatMessage(_Strict):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> model, or APIError(400) naming the first bad field and what it should be."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # the parser's own depth limit (about a thousand levels)
        raise _too_deep() from None
    check_json(data)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, data) from None


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep",
                    code="invalid_json")


def check_json(data: Any) -> None:
    """APIError(400) for a body nested deeper than MAX_JSON_DEPTH or holding a string (or key) that is
    not valid Unicode: JSON's \\ud800 escapes decode to lone surrogates, which nothing downstream
    can encode. Iterative, so no depth of input can exhaust the stack."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_str(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{_printable(key)}" if path else _printable(key)
                _check_str(key, where)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, where))
        else:
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, f"{path}.{i}" if path else str(i)))


def _check_str(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = path.split(".")[0] or None
        raise APIError(400, f"{path or 'the body'}: not valid Unicode (a lone surrogate U+{ord(text[e.start]):04X} at "
                            f"character {e.start}); send UTF-8 text", param=param, code="invalid_value") from None


def validation_error(e: ValidationError, data: Any = None) -> APIError:
    err = e.errors(include_url=False)[0]
    # a union adds its branch to the location (prompt.list[int].0): report the field as a whole
    is_branch = [isinstance(p, str) and ("[" in p or p in ("str", "int", "bool")) for p in err["loc"]]
    cut = is_branch.index(True) if any(is_branch) else len(err["loc"])
    param = _param(err["loc"][:cut])
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown or unsupported parameter {param!r}", param=param, code="unknown_field")
    if err["type"] == "missing":
        return APIError(400, f"missing required parameter {param!r}", param=param, code="missing_field")
    value = err.get("input") if cut == len(err["loc"]) else _lookup(data, err["loc"][:cut])
    got = json.dumps(value, default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    field = str(err["loc"][cut - 1]) if cut else ""
    if cut < len(err["loc"]) and field in _UNION_FORMS:
        msg = f"accepted: {_UNION_FORMS[field]}"
    elif err["type"] == "literal_error":  # one of fixed values (a message's role)
        msg = f"accepted: {err['ctx']['expected']}"
    else:
        msg = err["msg"]
    return APIError(400, f"{param}: {msg} (got {got})", param=param, code="invalid_value")


def _param(loc: tuple) -> str | None:
    """A field's location as OpenAI writes it: messages[0].role."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _lookup(value: Any, loc: tuple) -> Any:
    """The value a union field was given (pydantic reports only the innermost failing input)."""
    for key in loc:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value
