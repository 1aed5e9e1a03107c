"""What the serve tests share: a server on 127.0.0.1 (in this process, or as `h2o-stream serve` in a subprocess),
the official `openai` client pointed at it, and reference chat sessions to compare replies with.

Everything runs on conftest's tiny random llama and BPE tokenizer with SmolLM2's chat template, greedy, so a reply
is a deterministic function of what the cache holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from eval.common import BadInput
from eval.serve.run import start_server
from h2o_stream import make_policy
from h2o_stream.apps.chat import ChatSession, chat_sampling
from h2o_stream.apps.serve import Limits, ServeSettings, Service
from h2o_stream.apps.serve.app import make_server

MODEL = "tiny"
CACHE = 32
GREEDY = {"temperature": 0, "max_tokens": 4}
REPO = Path(__file__).resolve().parents[2]


class Running:
    """A server under test: its base URL, service (in-process only) and a client factory."""

    def __init__(self, url: str, service: Service | None = None):
        self.url, self.service = url, service

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=60, **kwargs)

    @property
    def store(self):
        return self.service.store


@contextlib.contextmanager
def served(model, tokenizer, state_dir, **settings):
    """A Service on a free port of 127.0.0.1, in a thread of this process, for the length of the block."""
    settings.setdefault("cache_size", CACHE)
    limits = settings.pop("limits", Limits(max_tokens=4096))
    service = Service(
        model, tokenizer, ServeSettings(state_dir=Path(state_dir), served_model=MODEL, limits=limits, **settings)
    )
    service.start()  # as the command does: a state directory in use is refused here, before the server starts
    server, sock, url = make_server(service, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(url, service)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        service.stop()  # the lifespan stops it too; again is harmless


def serve_process(model_dir, state_dir, *extra, env=None) -> tuple[subprocess.Popen, str]:
    """`h2o-stream serve` in a subprocess on a free port; the process and its URL (read from its start line)."""
    command = [
        sys.executable,
        "-m",
        "h2o_stream",
        "serve",
        "--model",
        str(model_dir),
        "--model-name",
        MODEL,
        "--state-dir",
        str(state_dir),
        "--port",
        "0",
        "--cache-size",
        str(CACHE),
        "--threads",
        "1",
        "--log-level",
        "warning",
        *extra,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        return start_server(command, cwd=state_dir, env=environment)
    except BadInput as error:
        pytest.fail(str(error))


def raw(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """A request without the openai client (to send what it never would): its status and JSON body."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reply_of(response) -> str:
    return response.choices[0].message.content


def extra(response) -> dict:
    """The server's own account of a turn (`h2o_stream` in a response, or on a stream's last chunk)."""
    return response.model_extra["h2o_stream"]


def streamed(stream) -> tuple[str, dict, object]:
    """A consumed stream: the reply text, the server's account and the usage."""
    text, info, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.model_extra.get("h2o_stream"):
            info = chunk.model_extra["h2o_stream"]
        if chunk.usage is not None:
            usage = chunk.usage
    return text, info, usage


def reference(model, tokenizer, system=None) -> ChatSession:
    """A chat session as the server makes one, for the replies it should give."""
    return ChatSession(
        model,
        tokenizer,
        policy=make_policy("h2o", CACHE),
        system=system,
        sampling=chat_sampling(temperature=0, max_new_tokens=GREEDY["max_tokens"], seed=0),
    )


def conversation(turns: list[tuple[str, str]], message: str, system: str | None = None) -> list[dict]:
    """OpenAI messages: the finished exchanges, then the new user message."""
    messages = [{"role": "system", "content": system}] if system else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": message}]


def health(server: Running) -> dict:
    """GET /health (no key): the server's own account of what it holds."""
    import json
    import urllib.request

    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=60) as answer:
        return json.loads(answer.read())


def on_disk(state_dir) -> dict[str, int]:
    """Every file of the conversations directory and its size."""
    return {p.name: p.stat().st_size for p in (Path(state_dir) / "conversations").iterdir() if p.is_file()}
