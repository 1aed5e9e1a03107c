"""`h2o-stream chat`: an endless chat REPL whose memory never grows, a thin shell over `ChatSession`.

Interactive (a terminal on stdin): line editing and history (readline), replies stream as they are generated,
Ctrl-C stops a reply (the session keeps it), Ctrl-D exits. Piped stdin: every line is one turn or command, run one
after another; replies go to stdout, notes to stderr, and the exit status is 1 if any command failed. This module
builds the session (local, or a server's with --server); the loop that runs it is `Repl` in repl.py.
"""

from __future__ import annotations

import contextlib
import sys

import click

from h2o_stream.apps.chat.defaults import CHAT_SAMPLING, DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE
from h2o_stream.errors import H2OStreamError

from .options import SEEDS, cache_options, given_options, model_options
from .repl import CommandLine, Repl, note, resume

#: the options that act with --server (the server's model and cache serve the chat; it takes no n-gram ban); any
#: other given with it would change nothing and is refused. --load has its own message.
WITH_SERVER = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
    "seed",
    "system",
    "load_path",
    "server",
    "api_key",
)
#: the settings a loaded session takes from the command line, when given there (Sampling's fields and chunk_size)
RESUMED_SETTINGS = (*CHAT_SAMPLING, "seed", "chunk_size")
#: the options of a session's cache, which a saved session keeps (the cache_options and the budget parts)
_NOT_CACHE = (*RESUMED_SETTINGS, "model_spec", "dtype", "device", "threads", "system", "load_path", "server", "api_key")


@click.command("chat")
@model_options
@cache_options("h2o", DEFAULT_CACHE_SIZE)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_SIZE,
    show_default=True,
    help="Tokens of a user message per forward pass.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=CHAT_SAMPLING["temperature"],
    show_default=True,
    help="Sampling temperature; 0 = greedy.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=CHAT_SAMPLING["top_p"],
    show_default=True,
    help="Nucleus sampling: sample from the smallest set of tokens with this much probability.",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=CHAT_SAMPLING["top_k"],
    show_default=True,
    help="Sample from the k most likely tokens only; 0 = no limit.",
)
@click.option(
    "--repetition-penalty",
    type=click.FloatRange(min=1),
    default=CHAT_SAMPLING["repetition_penalty"],
    show_default=True,
    help="Penalty on tokens already in the reply (transformers' repetition_penalty); 1 = off.",
)
@click.option(
    "--no-repeat-ngram-size",
    type=click.IntRange(min=0),
    default=CHAT_SAMPLING["no_repeat_ngram_size"],
    show_default=True,
    help="No run of this many tokens appears twice in a reply; 0 = off.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=CHAT_SAMPLING["max_new_tokens"],
    show_default=True,
    help="Longest reply, in tokens.",
)
@click.option("--seed", type=SEEDS, default=None, help="Sampling seed, 0 to 2**64-1 (default: random).")
@click.option("--system", default=None, help="System prompt, given to the model once at the start.")
@click.option(
    "--load",
    "load_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Resume the session saved in this file (as /load does).",
)
@click.option(
    "--server",
    default=None,
    metavar="URL",
    help="Chat through a running h2o-stream serve at URL (e.g. http://127.0.0.1:8000/v1) instead of a "
    "model loaded here; the server's cache settings apply.",
)
@click.option("--api-key", default=None, envvar="H2O_STREAM_API_KEY", help="The server's API key (with --server).")
def chat(
    model_spec,
    dtype,
    device,
    threads,
    policy,
    cache_size,
    parts,
    no_rolling,
    chunk_size,
    temperature,
    top_p,
    top_k,
    repetition_penalty,
    no_repeat_ngram_size,
    max_new_tokens,
    seed,
    system,
    load_path,
    server,
    api_key,
):
    """Endless chat with a local model in fixed memory.

    The KV cache stays at --cache-size entries per layer and KV head however long the conversation runs; each turn
    feeds only its own tokens. Type /help in the chat for commands (/stats, /save, /load, ...). With stdin piped,
    every line is one turn or command."""
    given = given_options()
    if server is not None:
        from h2o_stream.apps.serve.client import base_url

        base_url(server, "--server")  # before anything else: a --server that is no URL is the first error
        ignored = [flag for name, flag in given.items() if name not in WITH_SERVER]
        if ignored:
            raise H2OStreamError(
                f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with --server: the "
                f"server's own model and cache serve the chat; leave {'it' if len(ignored) == 1 else 'them'} out"
            )
    elif "api_key" in given:
        raise H2OStreamError("--api-key is the key of a server, for --server; without --server there is none")

    from h2o_stream.apps.chat import ChatSession, Sampling
    from h2o_stream.engine.policies import make_policy, policy_class
    from h2o_stream.generation.sampling import check_sampling
    from h2o_stream.loading.models import load_model

    for stream in (sys.stdout, sys.stderr):  # a terminal or pipe that cannot show a character gets a '?'
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="replace")
    size = None if policy == "full" else cache_size
    # built (and so checked) before the model loads, unless it needs the model's tokenizer (sepllm)
    eviction = None if policy_class(policy).needs_tokenizer else make_policy(policy, size, **parts)
    settings = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "repetition_penalty": repetition_penalty,
        "no_repeat_ngram_size": no_repeat_ngram_size,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    check_sampling(options=True, **settings)  # click's ranges let NaN through
    sampling = Sampling(**settings)
    interactive = sys.stdin.isatty()
    if server is not None:
        _remote(server, api_key, system, sampling, seed, load_path, interactive)
        return
    note(f"loading {model_spec or 'the default model'} ...")
    loaded = load_model(model_spec, dtype=dtype, device=device, threads=threads)
    if eviction is None:
        eviction = make_policy(policy, size, tokenizer=loaded.tokenizer, **parts)
    session = ChatSession(
        loaded.model,
        loaded.tokenizer,
        policy=eviction,
        rolling=not no_rolling,
        system=system,
        sampling=sampling,
        chunk_size=chunk_size,
        model_name=loaded.name,
    )
    if session.notice:
        note(f"note: {session.notice}")
    if session.budget is None:
        note("note: the full policy never evicts: memory grows with the conversation")
    if session.system_warning:
        note(f"warning: {session.system_warning}")
    command_line = CommandLine(
        settings={name: {**settings, "chunk_size": chunk_size}[name] for name in given if name in RESUMED_SETTINGS},
        cache=[flag for name, flag in given.items() if name not in _NOT_CACHE],
        system="system" in given,
        system_prompt=session.system,
    )
    if load_path:
        summary, notes = resume(session, load_path, command_line, starting=True)
        for line in [summary, *notes]:
            note(line)
    note(
        f"{loaded.name} | {session.policy.describe()} | "
        + ("/help for commands, Ctrl-D to exit" if interactive else "reading turns from stdin")
    )
    failures = Repl(session, interactive=interactive, command_line=command_line).run()
    if failures and not interactive:
        sys.exit(1)


def _remote(server, api_key, system, sampling, seed, load_path, interactive) -> None:
    """The REPL as a client of a running server (`--server`)."""
    from h2o_stream.apps.serve.client import RemoteSession

    if load_path:
        raise H2OStreamError("--load does not go with --server: the server keeps its conversations")
    session = RemoteSession(server, api_key=api_key, system=system, sampling=sampling, seed=seed)
    note(
        f"{session.model} at {session.url} | "
        + ("/help for commands, Ctrl-D to exit" if interactive else "reading turns from stdin")
    )
    failures = Repl(session, interactive=interactive).run()
    if failures and not interactive:
        sys.exit(1)
