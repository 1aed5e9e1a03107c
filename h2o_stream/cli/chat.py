"""`h2o-stream chat`: an endless chat REPL whose memory never grows, a thin shell over `ChatSession`.

Interactive (a terminal on stdin): line editing and history (readline), replies stream as they are generated,
Ctrl-C stops a reply (the session keeps it), Ctrl-D exits. Piped stdin: every line is one turn or command, run one
after another; replies go to stdout, notes to stderr, and the exit status is 1 if any command failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

from h2o_stream.apps.chat.defaults import CHAT_SAMPLING, DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE
from h2o_stream.apps.chat.stats import cache_settings, format_stats, loaded_summary, size_text
from h2o_stream.errors import H2OStreamError, one_line

from .options import cache_options, model_options

if TYPE_CHECKING:  # imported in the command's body: --help loads no torch
    from h2o_stream.apps.chat import ChatSession

PROMPT = ">>> "
HISTORY_LINES = 1000
WAKE_SECONDS = 0.05  # see _waking_for_signals

HELP = """Commands:
  /help          this help
  /stats         tokens seen, cache occupancy, evictions, speed, memory
  /reset         forget the conversation (system prompt and settings stay)
  /save PATH     save the session (cache, scores, counters, settings) to a file
  /load PATH     resume a saved session (same model), replacing this one
  /exit          leave (also /quit, or Ctrl-D)
Anything else is a message to the model; start it with // to send a message that begins with /.
Ctrl-C stops a reply in progress (what was said so far stays in the session); pressed while a long message is
still being read, it cancels that message."""


@click.command("chat")
@model_options
@cache_options("h2o", DEFAULT_CACHE_SIZE)
@click.option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens of a user message per forward pass.")
@click.option("--temperature", type=click.FloatRange(min=0), default=CHAT_SAMPLING["temperature"],
              show_default=True, help="Sampling temperature; 0 = greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=CHAT_SAMPLING["top_p"],
              show_default=True, help="Nucleus sampling: sample from the smallest set of tokens with this much "
                                      "probability.")
@click.option("--top-k", type=click.IntRange(min=0), default=CHAT_SAMPLING["top_k"], show_default=True,
              help="Sample from the k most likely tokens only; 0 = no limit.")
@click.option("--repetition-penalty", type=click.FloatRange(min=1), default=CHAT_SAMPLING["repetition_penalty"],
              show_default=True, help="Penalty on tokens already in the reply (transformers' repetition_penalty); "
                                      "1 = off.")
@click.option("--no-repeat-ngram-size", type=click.IntRange(min=0), default=CHAT_SAMPLING["no_repeat_ngram_size"],
              show_default=True, help="No run of this many tokens appears twice in a reply; 0 = off.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=CHAT_SAMPLING["max_new_tokens"],
              show_default=True, help="Longest reply, in tokens.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed (default: random).")
@click.option("--system", default=None, help="System prompt, given to the model once at the start.")
@click.option("--load", "load_path", type=click.Path(dir_okay=False), default=None,
              help="Resume the session saved in this file (as /load does).")
@click.option("--server", default=None, metavar="URL",
              help="Chat through a running h2o-stream serve at URL (e.g. http://127.0.0.1:8000/v1) instead of a "
                   "model loaded here; the server's cache settings apply.")
@click.option("--api-key", default=None, envvar="H2O_STREAM_API_KEY", help="The server's API key (with --server).")
def chat(model_spec, dtype, device, threads, policy, cache_size, parts, no_rolling, chunk_size, temperature, top_p,
         top_k, repetition_penalty, no_repeat_ngram_size, max_new_tokens, seed, system, load_path, server, api_key):
    """Endless chat with a local model in fixed memory.

    The KV cache stays at --cache-size entries per layer and KV head however long the conversation runs; each turn
    feeds only its own tokens. Type /help in the chat for commands (/stats, /save, /load, ...). With stdin piped,
    every line is one turn or command."""
    from h2o_stream.apps.chat import ChatSession, Sampling
    from h2o_stream.engine.policies import make_policy, policy_class
    from h2o_stream.loading.models import load_model

    for stream in (sys.stdout, sys.stderr):  # a terminal or pipe that cannot show a character gets a '?'
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):
                pass
    size = None if policy == "full" else cache_size
    # built (and so checked) before the model loads, unless it needs the model's tokenizer (sepllm)
    eviction = None if policy_class(policy).needs_tokenizer else make_policy(policy, size, **parts)
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                        no_repeat_ngram_size=no_repeat_ngram_size, max_new_tokens=max_new_tokens, seed=seed)
    interactive = sys.stdin.isatty()
    if server:
        _remote(server, api_key, system, sampling, seed, load_path, interactive)
        return
    _note(f"loading {model_spec or 'the default model'} ...")
    loaded = load_model(model_spec, dtype=dtype, device=device, threads=threads)
    if eviction is None:
        eviction = make_policy(policy, size, tokenizer=loaded.tokenizer, **parts)
    session = ChatSession(loaded.model, loaded.tokenizer, policy=eviction, rolling=not no_rolling, system=system,
                          sampling=sampling, chunk_size=chunk_size, model_name=loaded.name)
    if session.notice:
        _note(f"note: {session.notice}")
    if session.budget is None:
        _note("note: the full policy never evicts: memory grows with the conversation")
    if session.system_warning:
        _note(f"warning: {session.system_warning}")
    if load_path:
        before = cache_settings(session)
        session.load(load_path)
        _note(loaded_summary(session, load_path))
        _note_replaced(before, session)
    _note(f"{loaded.name} | {session.policy.describe()} | "
          + ("/help for commands, Ctrl-D to exit" if interactive else "reading turns from stdin"))
    failures = Repl(session, interactive=interactive).run()
    if failures and not interactive:
        sys.exit(1)


def _remote(server, api_key, system, sampling, seed, load_path, interactive) -> None:
    """The REPL as a client of a running server (`--server`)."""
    from h2o_stream.apps.serve.client import RemoteSession

    if load_path:
        raise H2OStreamError("--load does not go with --server: the server keeps its conversations")
    session = RemoteSession(server, api_key=api_key, system=system, sampling=sampling, seed=seed)
    _note(f"{session.model} at {session.url} | " + ("/help for commands, Ctrl-D to exit" if interactive
                                                    else "reading turns from stdin"))
    failures = Repl(session, interactive=interactive).run()
    if failures and not interactive:
        sys.exit(1)


class OutputLost(H2OStreamError):
    """Stdout cannot take the chat's output (a full disk, a closed pipe): the chat ends with one error line."""


class Repl:
    """Reads lines, runs commands, streams replies. `run()` returns how many commands failed.

    Ctrl-C (SIGINT; handled only when the REPL runs in the main thread): at the prompt, a fresh prompt; while a reply
    is generated, it stops the reply (the session keeps it); while a message is read, it cancels the message;
    anywhere else (a command such as /save, the moment between a reply and the next prompt) it is ignored, so a
    Ctrl-C never ends the session by accident. With stdin piped, a Ctrl-C while waiting for the next line ends the
    chat, as before.
    """

    def __init__(self, session: ChatSession, *, interactive: bool, out=None):
        self.session = session
        self.interactive = interactive
        self.out = out or sys.stdout
        self.failures = 0
        self._history_file = None
        self._waiting = False  # reading the next line: a Ctrl-C ends the read
        self._stop = threading.Event()  # a Ctrl-C anywhere else: the reply under way (if any) stops

    # -- input --------------------------------------------------------------------------------------------------------

    def lines(self):
        if not self.interactive:
            yield from self._piped_lines()
            return
        self._setup_readline()
        try:
            while True:
                try:
                    line = self._read(lambda: input(PROMPT))
                except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, the session goes on
                    self.write("\n")
                    _note("(Ctrl-C stops a reply; /exit or Ctrl-D to leave)")
                    continue
                except EOFError:  # Ctrl-D
                    self.write("\n")
                    return
                except UnicodeDecodeError as error:  # a terminal in another encoding, pasted bytes
                    self.failures += 1
                    _note(f"Error: that line is not UTF-8 text ({_bad_byte(error)}); nothing was sent")
                    continue
                yield line
        finally:
            self._save_history()

    def _piped_lines(self):
        """Lines of piped stdin, read as UTF-8; a line that is not text (invalid UTF-8, a NUL byte) means stdin is
        not a chat transcript: one error, and the chat stops there."""
        stream = getattr(sys.stdin, "buffer", sys.stdin)
        number = 0
        while raw := self._read(stream.readline):
            number += 1
            try:
                line = raw if isinstance(raw, str) else raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise H2OStreamError(f"stdin line {number} is not UTF-8 text ({_bad_byte(error)}): chat reads one "
                                     "message per line of text") from None
            if "\0" in line:
                raise H2OStreamError(f"stdin line {number} is not text (it holds a NUL byte): chat reads one message "
                                     "per line of text")
            yield line.rstrip("\r\n")

    def _read(self, read):
        """`read()`, during which a Ctrl-C ends the read with KeyboardInterrupt."""
        with _waking_for_signals(self.interactive):  # set up and taken down while a Ctrl-C cannot raise
            try:
                self._waiting = True
                return read()
            finally:
                self._waiting = False

    def _on_interrupt(self, signum, frame) -> None:
        if self._waiting:
            self._waiting = False  # one KeyboardInterrupt per read: a second Ctrl-C cannot land in the first's handling
            raise KeyboardInterrupt
        self._stop.set()

    @contextlib.contextmanager
    def _interrupts(self):
        """Ctrl-C handled as the class docstring says, for as long as the REPL runs."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _setup_readline(self) -> None:
        try:
            import readline
        except ImportError:  # e.g. Windows without pyreadline: plain input() still works
            return
        path = os.environ.get("H2O_STREAM_CHAT_HISTORY")
        if path is None:
            from h2o_stream.loading.models import cache_dir

            path = str(cache_dir() / "chat_history")
        if not path:  # H2O_STREAM_CHAT_HISTORY="" turns the history file off
            return
        self._history_file = Path(path).expanduser()
        try:
            readline.read_history_file(self._history_file)
        except OSError:
            pass
        readline.set_history_length(HISTORY_LINES)

    def _save_history(self) -> None:
        if self._history_file is None:
            return
        try:
            import readline

            self._history_file.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(self._history_file)
        except (ImportError, OSError):
            pass

    # -- the loop -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        with self._interrupts():
            for line in self.lines():
                text = line.strip()
                if not text:
                    continue  # an empty line is no message
                if text.startswith("/") and not text.startswith("//"):
                    if not self.command(text):
                        break
                    continue
                self.turn(text[1:] if text.startswith("//") else line)
        return self.failures

    def command(self, text: str) -> bool:
        """Run a /command; False means leave. A command that fails says why and leaves the session as it was."""
        name, _, argument = text.partition(" ")
        name, argument = name.lower(), argument.strip()
        try:
            if name in ("/exit", "/quit"):
                return False
            if name == "/help":
                self.say(HELP)
            elif name == "/stats":
                self.say(format_stats(self.session.stats()))
            elif name == "/reset":
                turns = self.session.turns
                self.session.reset()
                self.say(f"session reset: {turns} turn(s) forgotten, cache empty")
            elif name in ("/save", "/load"):
                if not argument:
                    raise H2OStreamError(f"{name} needs a file name: {name} PATH")
                if name == "/save":
                    path = self.session.save(argument)
                    self.say(f"saved the session (turn {self.session.turns}, {size_text(path.stat().st_size)}) "
                             f"to {path}")
                else:
                    before = cache_settings(self.session)
                    self.session.load(argument)
                    self.say(loaded_summary(self.session, argument))
                    _note_replaced(before, self.session)
            else:
                raise H2OStreamError(f"unknown command {name}; type /help for the list "
                                     "(start a message with // to send a message that begins with /)")
        except OutputLost:
            raise
        except H2OStreamError as error:
            self.failures += 1
            _note(f"Error: {error}")
        except Exception as error:  # anything unforeseen (e.g. from torch or the disk): the session goes on
            self.failures += 1
            _note(f"Error: {name} failed: {type(error).__name__}: {one_line(error)} (the session is as it was)")
        return True

    def turn(self, text: str) -> None:
        self._stop.clear()
        try:
            for delta in self.session.send(text, should_stop=self._stop.is_set):
                self.write(delta)
        except OutputLost:
            raise
        except Exception as error:  # H2OStreamError, or anything from the model: the session is restored
            self.failures += 1
            self.write("\n")
            what = str(error) if isinstance(error, H2OStreamError) else f"{type(error).__name__}: {error}"
            _note(f"Error: {what} (the session is as it was before this message)")
            return
        result = self.session.last_turn
        self.write("\n")
        if result.stop_reason == "interrupted":
            _note(f"[stopped after {result.generated_tokens} tokens; the reply so far stays in the session]")
        elif result.stop_reason == "cancelled":
            _note("[cancelled while reading the message; the session is as it was before it]")
        elif result.stop_reason == "length":
            _note(f"[reply cut at --max-new-tokens {self.session.sampling.max_new_tokens}]")
        if self.interactive:
            self.write("\n")

    def say(self, text: str) -> None:
        self.write(text + "\n")

    def write(self, text: str) -> None:
        """`text` to stdout, now. If stdout cannot take it (a full disk, a closed pipe) the chat ends: OutputLost."""
        try:
            self.out.write(text)
            self.out.flush()
        except OSError as error:
            _discard(self.out)
            raise OutputLost(f"cannot write to stdout ({error.strerror or one_line(error)}); the chat stops here") \
                from None


@contextlib.contextmanager
def _waking_for_signals(active: bool):
    """While input() waits, wake it every WAKE_SECONDS, so that a Ctrl-C is acted on at once.

    CPython runs a Python signal handler only when the main thread runs Python code, and readline's input() sleeps
    in select(), which a signal ends only if it arrives during that sleep. A Ctrl-C that lands just before it (the
    process was descheduled right after drawing the prompt, as happens under load) or that another thread (torch's)
    takes would wait for the next key press: no fresh prompt. A no-op SIGALRM ends the sleep; readline then runs the
    pending handlers and waits again."""
    if not active or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, WAKE_SECONDS, WAKE_SECONDS)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)  # runs a tick still pending first, with the no-op handler


def _discard(stream) -> None:
    """Point a failed stream's file descriptor at the null device, so that the interpreter's flush at exit does not
    fail again and print a traceback."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError, AttributeError):  # no file descriptor (e.g. click's test runner)
        pass


def _bad_byte(error: UnicodeDecodeError) -> str:
    return f"byte 0x{error.object[error.start]:02x} at offset {error.start}"


def _note_replaced(before: str, session: ChatSession) -> None:
    """Say so when a loaded session brings another cache than the chat had (the file's settings win)."""
    after = cache_settings(session)
    if after != before:
        _note(f"note: the loaded session keeps its own cache, {after}, instead of this chat's {before} "
              "(--policy/--cache-size do not apply to a loaded session)")


def _note(text: str) -> None:
    click.echo(text, err=True)
