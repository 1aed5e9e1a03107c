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

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError


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


@dataclass
class Limits:
    """What one request may ask for. A history is sent whole with every turn, so the body limit is generous."""

    max_request_bytes: int = 8 * 2**20
    max_messages: int = 10_000
    max_tokens: int = 4096
    max_stops: int = 4


Number = StrictFloat | StrictInt


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


class ChatRequest(BaseModel):
    """The body of POST /v1/chat/completions, as far as the server reads it."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    messages: list[_Message] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # the newer name of max_tokens
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)  # not OpenAI's; vLLM and llama.cpp take it too
    repetition_penalty: Number | None = Field(default=None, ge=1)  # likewise
    seed: StrictInt | None = Field(default=None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logprobs: StrictBool | None = None
    tools: list | None = None
    # h2o-stream's own: the cache of a conversation this request starts (an existing one keeps its own)
    policy: StrictStr | None = None
    cache_size: StrictInt | None = Field(default=None, ge=1)


def parse_body(body: bytes, limits: Limits) -> ChatRequest:
    """The request in `body`, checked; ApiError (400, 413) naming what is wrong."""
    if len(body) > limits.max_request_bytes:
        raise too_large(limits)
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if isinstance(payload.get("messages"), list) and len(payload["messages"]) > limits.max_messages:
        raise ApiError(
            400,
            f"too many messages: {len(payload['messages'])}, at most {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    try:
        request = ChatRequest.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    _check_supported(request, limits)
    return request


def too_large(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request is larger than {limits.max_request_bytes:,} bytes (h2o-stream serve --max-request-bytes)",
        code="request_too_large",
    )


def _check_supported(request: ChatRequest, limits: Limits) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, name)
        if value is not None and not 1 <= value <= limits.max_tokens:
            raise ApiError(
                400,
                f"{name} must be between 1 and {limits.max_tokens} (h2o-stream serve --max-tokens), got {value}",
                param=name,
            )
    if request.n not in (None, 1):
        raise ApiError(400, "n must be 1: one reply per request", param="n")
    if request.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    if request.tools:
        raise ApiError(400, "tools are not supported", param="tools")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise ApiError(400, f"{name} is not supported; use repetition_penalty (>= 1)", param=name)
    stops = stop_texts(request)
    if len(stops) > limits.max_stops or not all(stops):
        raise ApiError(400, f"stop takes up to {limits.max_stops} non-empty texts", param="stop")


def stop_texts(request: ChatRequest) -> tuple[str, ...]:
    """The request's stop texts as a tuple."""
    if request.stop is None:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def reply_limit(request: ChatRequest) -> int | None:
    """max_completion_tokens, else max_tokens, else None (the server's default)."""
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


# -- what the client reads -------------------------------------------------------------------------------------------

#: TurnResult.stop_reason -> OpenAI's finish_reason
FINISH_REASONS = {"end": "stop", "length": "length"}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


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


def chunk(cid: str, model: str, created: int, delta: dict | None, finish: str | None = None) -> dict:
    """One chat.completion.chunk of a stream; `delta` None is the closing usage chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "h2o-stream"}]}
