"""The OpenAI chat-completions wire format: the request a client sends (checked field by field), the errors it gets
back, and the response and stream-chunk objects it reads.

Every refusal is an `ApiError`: an HTTP status and OpenAI's error object (`{"error": {"message", "type", "param",
"code"}}`), so an OpenAI client raises its usual exception (`BadRequestError`, `NotFoundError`, ...). Fields the server
does not use (`user`, `response_format`, ...) are ignored, as other OpenAI-compatible servers do; fields whose meaning
it cannot honour (`n` > 1, `logprobs`, tools, presence and frequency penalties) are refused rather than ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from h2o_stream.generation.sampling import MAX_SEED

from .limits import Limits


class ApiError(Exception):
    """A request the server refuses (or could not complete): its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


Number = StrictFloat | StrictInt
R = TypeVar("R", bound="_Generation")
# bounds of the fields no other check bounds: a client's number never reaches the model unchecked
MAX_TOP_K = 2**31 - 1
MAX_REPETITION_PENALTY = 100
MAX_CACHE_SIZE = 2**20


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: carried by clients, unused here
    role: StrictStr
    content: StrictStr | list[_TextPart] | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _Generation(BaseModel):
    """The fields both kinds of completion take: the model, streaming, sampling and the reply's length."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_K)  # not OpenAI's; vLLM and llama.cpp take it
    repetition_penalty: Number | None = Field(default=None, ge=1, le=MAX_REPETITION_PENALTY)  # likewise
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None


class ChatRequest(_Generation):
    """The body of POST /v1/chat/completions, as far as the server reads it."""

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None  # the newer name of max_tokens
    logprobs: StrictBool | None = None
    tools: list | None = None
    # h2o-stream's own: the cache of a conversation this request starts (an existing one keeps its own)
    policy: StrictStr | None = None
    cache_size: StrictInt | None = Field(default=None, ge=1, le=MAX_CACHE_SIZE)


class TextRequest(_Generation):
    """The body of POST /v1/completions (legacy text completion), as far as the server reads it."""

    prompt: StrictStr | list[StrictStr] = Field(min_length=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @property
    def text(self) -> str:
        """The prompt as one text (a list holds exactly one: one completion per request)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse_body(body: bytes, limits: Limits, kind: type[R]) -> R:
    """The request of `kind` in `body`, checked; ApiError (400, 413) naming what is wrong."""
    if len(body) > limits.max_request_bytes:
        raise too_large(limits)
    payload = _json(body, limits)
    if isinstance(payload.get("messages"), list) and len(payload["messages"]) > limits.max_messages:
        raise ApiError(
            400,
            f"too many messages: {len(payload['messages'])}, at most {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    try:
        request = kind.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    _check_supported(request, limits)
    return request


def _json(body: bytes, limits: Limits) -> dict:
    """The body as a JSON object nested at most `limits.max_depth` deep, without NaN or infinities; ApiError 400."""
    too_deep = ApiError(400, f"the request body is nested more than {limits.max_depth} levels deep")
    try:
        payload = json.loads(body, parse_constant=_no_constant)
    except RecursionError:  # nested beyond Python's own limit
        raise too_deep from None
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if _depth(payload) > limits.max_depth:
        raise too_deep
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return payload


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(value) -> int:
    """How deeply `value` nests lists and objects (iteratively: a deep body cannot exhaust the stack here)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def unknown_model(name: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"the model {name!r} does not exist here; this server serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def too_large(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request is larger than {limits.max_request_bytes:,} bytes (h2o-stream serve --max-request-bytes)",
        code="request_too_large",
    )


def _check_supported(request: _Generation, limits: Limits) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, name, None)
        if value is not None and not 1 <= value <= limits.max_tokens:
            raise ApiError(
                400,
                f"{name} must be between 1 and {limits.max_tokens} (h2o-stream serve --max-tokens), got {value}",
                param=name,
            )
    if request.n not in (None, 1):
        raise ApiError(400, "n must be 1: one reply per request", param="n")
    unsupported = {
        "logprobs": "logprobs are not supported",
        "tools": "tools are not supported",
        "suffix": "suffix (text after the insertion) is not supported",
        "presence_penalty": "presence_penalty is not supported; use repetition_penalty (>= 1)",
        "frequency_penalty": "frequency_penalty is not supported; use repetition_penalty (>= 1)",
    }
    for name, why in unsupported.items():
        if getattr(request, name, None):
            raise ApiError(400, why, param=name)
    if getattr(request, "best_of", None) not in (None, 1):
        raise ApiError(400, "best_of must be 1: one reply per request", param="best_of")
    if isinstance(request, TextRequest) and isinstance(request.prompt, list) and len(request.prompt) != 1:
        raise ApiError(400, "prompt takes one text: one completion per request", param="prompt")
    stops = stop_texts(request)
    if len(stops) > limits.max_stops or not all(stops):
        raise ApiError(400, f"stop takes up to {limits.max_stops} non-empty texts", param="stop")


@dataclass(frozen=True)
class PromptLimit:
    """What one turn may feed before its reply: `tokens` at most, and, where the cache's positions grow with the
    conversation (a cache without a bound, or without rolling), no more than the model's `context` (None: no limit)
    in all."""

    tokens: int
    context: int | None = None

    def check(self, session, fed: int, reply: int) -> None:
        """ApiError 400 if a turn feeding `fed` tokens into `session`'s cache, then replying with up to `reply`
        tokens, passes a bound; it names what to change in the request."""
        held = session.cache.seen
        grows = session.budget is None or not session.cache.rolling
        if fed > self.tokens:
            raise ApiError(
                400,
                f"this turn would read {fed:,} tokens (the new message, and the exchanges of the history this "
                f"server does not hold), more than the {self.tokens:,} it reads per request: send a shorter "
                "message, or the history this server returned (then only the new message is read)",
                param="messages",
                code="prompt_too_long",
            )
        if grows and self.context is not None and held + fed + reply > self.context:
            raise ApiError(
                400,
                f"the conversation would hold {held + fed + reply:,} tokens ({held:,} held, {fed:,} to read, "
                f"max_tokens {reply:,}), beyond the model's context of {self.context:,}: lower max_tokens, send a "
                "shorter message or start a new conversation",
                param="max_tokens",
                code="context_length_exceeded",
            )


def stop_texts(request: _Generation) -> tuple[str, ...]:
    """The request's stop texts as a tuple."""
    if request.stop is None:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def reply_limit(request: _Generation) -> int | None:
    """max_completion_tokens, else max_tokens, else None (the server's default)."""
    newer = getattr(request, "max_completion_tokens", None)
    return newer if newer is not None else request.max_tokens


# -- what the client reads -------------------------------------------------------------------------------------------

#: TurnResult.stop_reason -> OpenAI's finish_reason
FINISH_REASONS = {"end": "stop", "length": "length"}


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(reused: int, fed: int, generated: int) -> dict:
    """OpenAI's usage object: prompt tokens are the whole history as the model has seen it, of which
    `cached_tokens` were already in the conversation's cache and not fed again."""
    prompt = reused + fed
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


def completion(cid: str, model: str, text: str, finish: str, usage_: dict, extra: dict) -> dict:
    """A whole (non-streamed) chat.completion."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        ],
        "usage": usage_,
        "h2o_stream": extra,
    }


def text_completion(cid: str, model: str, text: str, finish: str, usage_: dict) -> dict:
    """A whole (non-streamed) text_completion."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage_,
    }


def text_chunk(cid: str, model: str, created: int, text: str, finish: str | None = None) -> dict:
    """One piece of a streamed text_completion."""
    choices = [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}


def chunk(cid: str, model: str, created: int, delta: dict | None, finish: str | None = None) -> dict:
    """One chat.completion.chunk of a stream; `delta` None is the closing usage chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "h2o-stream"}]}
