"""The HTTP side: a FastAPI app with OpenAI's routes in front of a `Service`.

    GET    /v1/models                 the one model served
    GET    /v1/models/{id}            that model (404 for any other)
    POST   /v1/chat/completions       a turn; with "stream": true as server-sent events in OpenAI's chunk format
    POST   /v1/completions            legacy text completion: a prompt continued, kept nowhere (streamed too)
    DELETE /v1/conversations/{id}     removes a conversation of the caller's key (404 if it has none so named)
    GET    /health                    no key needed: the model, the conversations held, the state directory's size

Every response to a turn carries `X-Conversation-Id` (send it back to name the conversation) and, besides OpenAI's
fields, an `h2o_stream` object (in a stream: on the last chunk) saying how the history was matched and what the cache
holds. Every error is OpenAI's error object with a 4xx or 5xx status; nothing a request does stops the server. A
client that goes away mid-turn cancels it: its conversation stays at its last completed turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from h2o_stream.errors import H2OStreamError

from .protocol import (
    ApiError,
    ChatRequest,
    TextRequest,
    chunk,
    completion,
    completion_id,
    models_list,
    parse_body,
    sse,
    text_chunk,
    text_completion,
    too_large,
    unknown_model,
)
from .service import Service

CONVERSATION_HEADER = "X-Conversation-Id"
POLL_SECONDS = 0.5  # how often a waiting request checks whether its client is still there
_DRAIN_FACTOR = 8  # a body over the limit is read (and dropped) up to this many times the limit, then cut off


def create_app(service: Service) -> FastAPI:
    """The app; its lifespan starts and stops `service`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="h2o-stream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    settings = service.settings

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=_auth_header(error))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        message = "no such route" if error.status_code == 404 else str(error.detail)
        return JSONResponse(
            ApiError(error.status_code, f"{message}: {request.method} {request.url.path}").body(),
            status_code=error.status_code,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        return JSONResponse(ApiError(400, f"bad request: {error.errors()[0].get('msg')}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return JSONResponse(
            ApiError(500, f"internal error: {type(error).__name__}", kind="server_error").body(), status_code=500
        )

    def authorize(request: Request) -> str:
        """The owner of the request's conversations (its key's); ApiError 401 without a key the server takes."""
        return service.keys.owner(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        assert service.worker is not None  # the lifespan starts the service before the app takes any request
        # counts the worker thread keeps, read here without it: each is one int or len(), read whole
        return {
            "status": "ok",
            "model": settings.served_model,
            "conversations": len(service.store.records),
            "in_memory": len(service.worker.conversations.sessions),
            "state_bytes": service.store.bytes,
        }

    @app.delete("/v1/conversations/{name}")
    async def delete_conversation(name: str, request: Request):
        owner = authorize(request)
        assert service.worker is not None
        # through the worker thread, which owns the registry: it runs the delete between two steps of the turns
        # under way, so a turn never finds its conversation gone, and a busy one is refused (409)
        await asyncio.wrap_future(service.worker.call(lambda conversations: conversations.delete(owner, name)))
        return {"id": name, "object": "conversation.deleted", "deleted": True}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return models_list(settings.served_model, started)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        if model_id != settings.served_model:
            raise unknown_model(model_id, settings.served_model)
        return models_list(settings.served_model, started)["data"][0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        owner = authorize(request)
        chat = parse_body(await _read_body(request, settings.limits), settings.limits, ChatRequest)
        turn = service.turn_request(chat, request.headers.get(CONVERSATION_HEADER), owner)
        return await _respond(request, _submit(service, turn), chat, CHAT)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        authorize(request)
        body = parse_body(await _read_body(request, settings.limits), settings.limits, TextRequest)
        return await _respond(request, _submit(service, service.text_request(body)), body, TEXT)

    return app


def _submit(service: Service, request):
    assert service.worker is not None  # the lifespan starts the service before the app takes any request
    return service.worker.submit(request, asyncio.get_running_loop())


@dataclass(frozen=True)
class Shape:
    """How a kind of completion is written: its id prefix, a streamed piece, the stream's closing chunk and the
    whole response (`info` is the worker's "done" event)."""

    prefix: str
    piece: Callable[[str, str, int, str, bool], dict]  # (id, model, created, text, first piece)
    last: Callable[[str, str, int, dict], dict]
    whole: Callable[[str, str, str, dict], dict]


def _chat_last(cid: str, model: str, created: int, info: dict) -> dict:
    return {**chunk(cid, model, created, {}, info["finish_reason"]), "h2o_stream": info["extra"]}


CHAT = Shape(
    "chatcmpl",
    lambda cid, model, created, text, first: chunk(
        cid, model, created, {"role": "assistant", "content": text} if first else {"content": text}
    ),
    _chat_last,
    lambda cid, model, text, info: completion(cid, model, text, info["finish_reason"], info["usage"], info["extra"]),
)
TEXT = Shape(
    "cmpl",
    lambda cid, model, created, text, first: text_chunk(cid, model, created, text),
    lambda cid, model, created, info: text_chunk(cid, model, created, "", info["finish_reason"]),
    lambda cid, model, text, info: text_completion(cid, model, text, info["finish_reason"], info["usage"]),
)


async def _respond(request: Request, job, body, shape: Shape):
    """The job's reply as `shape` writes it: streamed (server-sent events) or whole."""
    try:
        kind, value = await _next_event(job, request)
        if kind == "error":
            raise value
        headers = {CONVERSATION_HEADER: value["conversation"]} if "conversation" in value else {}
        cid = completion_id(shape.prefix)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(job, cid, body.model, include_usage, shape), headers=headers, media_type="text/event-stream"
            )
        pieces = []
        while True:
            kind, value = await _next_event(job, request)
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                raise value
            else:
                return JSONResponse(shape.whole(cid, body.model, "".join(pieces), value), headers=headers)
    except (ApiError, asyncio.CancelledError, _Gone):
        job.cancel()
        raise


class _Gone(Exception):
    """The client closed the connection."""


async def _next_event(job, request: Request):
    """The job's next event; _Gone if the client disconnects while it waits."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise _Gone from None


async def _stream(job, cid: str, model: str, include_usage: bool, shape: Shape):
    """The reply as server-sent events. If the client goes away, Starlette cancels this generator: the job is
    cancelled with it."""
    created = int(time.time())
    started = False
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "text" or (kind == "done" and not started):
                yield sse(shape.piece(cid, model, created, value if kind == "text" else "", not started))
                started = True
            if kind == "done":
                yield sse(shape.last(cid, model, created, value))
                if include_usage:
                    yield sse({**chunk(cid, model, created, None), "usage": value["usage"]})
                yield sse("[DONE]")
                return
            if kind == "error":
                yield sse(value.body())
                return
    finally:
        if not job.finished:
            job.cancel()


async def _read_body(request: Request, limits) -> bytes:
    """The body, if it is within the limit; else 413 (after reading and dropping a moderate excess, so the client
    gets the answer rather than a reset connection)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_request_bytes * _DRAIN_FACTOR:
        raise too_large(limits)
    body, size = bytearray(), 0
    async for piece in request.stream():
        size += len(piece)
        if size <= limits.max_request_bytes:
            body += piece
        elif size > limits.max_request_bytes * _DRAIN_FACTOR:
            break
    if size > limits.max_request_bytes:
        raise too_large(limits)
    return bytes(body)


def _auth_header(error: ApiError) -> dict:
    return {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}


def listen(host: str, port: int):
    """A socket bound to host:port now (port 0 picks a free one): a busy port or a bad host is one H2OStreamError,
    which a command can meet before it loads its model."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise H2OStreamError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def make_server(service: Service, host: str, port: int, *, log_level: str = "info", sock=None):
    """A uvicorn server for `service` and the socket it will serve on (`sock`, bound by `listen`; by default bound
    now), and the base URL clients use. `server.run(sockets=[sock])` serves until SIGINT or SIGTERM (or
    `server.should_exit`)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # first the turns under way end with an error event, so their streams close and the graceful shutdown,
            # which waits for open connections, is not spent waiting for replies
            if service.worker is not None:
                service.worker.halt()
            super().handle_exit(sig, frame)

    sock = listen(host, port) if sock is None else sock
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(create_app(service), log_level=log_level, timeout_graceful_shutdown=5)
    return Server(config), sock, f"http://{shown}:{sock.getsockname()[1]}/v1"


def run(service: Service, host: str, port: int, *, log_level: str = "info", on_ready=None, sock=None) -> None:
    """Serve `service` on host:port (on `sock` when `listen` bound it already) until SIGINT or SIGTERM; `on_ready(url)`
    is called once the socket is bound."""
    server, sock, url = make_server(service, host, port, log_level=log_level, sock=sock)
    if on_ready is not None:
        on_ready(url)
    server.run(sockets=[sock])
