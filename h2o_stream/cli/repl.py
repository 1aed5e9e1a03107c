"""The chat's read-eval-print loop on a terminal or a pipe: `Repl` (input, commands, streamed replies, Ctrl-C) and its
terminal helpers (waking readline for signals, a lost stdout). `h2o-stream chat` (chat.py) builds the session and runs
it here; anything with ChatSession's interface (a local session, a server's RemoteSession) can be driven.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from h2o_stream.apps.chat.stats import cache_settings, clip, format_stats, loaded_summary, size_text
from h2o_stream.errors import H2OStreamError, one_line, option_name

if TYPE_CHECKING:
    from h2o_stream.apps.chat import ChatSession

PROMPT = ">>> "
HISTORY_LINES = 1000
WAKE_SECONDS = 0.05  # see _waking_for_signals

HELP = """Commands:
  /help          this help
  /stats         tokens seen, cache occupancy, evictions, speed, memory
  /reset         forget the conversation (system prompt and settings stay)
  /save PATH     save the session (cache, scores, counters, settings) to a file; it replaces an older session
                 file, never another file: /save PATH --force replaces that too
  /load PATH     resume a saved session (same model), replacing this one
  /exit          leave (also /quit, or Ctrl-D)
Anything else is a message to the model; start it with // to send a message that begins with /.
Ctrl-C stops a reply in progress (what was said so far stays in the session); pressed while a long message is
still being read, it cancels that message."""


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

    def __init__(self, session: ChatSession, *, interactive: bool, out=None, command_line: CommandLine | None = None):
        self.session = session
        self.command_line = command_line or CommandLine()
        self.interactive = interactive
        self.out = out or sys.stdout
        self.failures = 0
        self._history_file: Path | None = None
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
                    note("(Ctrl-C stops a reply; /exit or Ctrl-D to leave)")
                    continue
                except EOFError:  # Ctrl-D
                    self.write("\n")
                    return
                except UnicodeDecodeError as error:  # a terminal in another encoding, pasted bytes
                    self.failures += 1
                    note(f"Error: that line is not UTF-8 text ({_bad_byte(error)}); nothing was sent")
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
                raise H2OStreamError(
                    f"stdin line {number} is not UTF-8 text ({_bad_byte(error)}): chat reads one "
                    "message per line of text"
                ) from None
            if "\0" in line:
                raise H2OStreamError(
                    f"stdin line {number} is not text (it holds a NUL byte): chat reads one message per line of text"
                )
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
        with contextlib.suppress(OSError):  # no history yet, or an unreadable one: start without it
            readline.read_history_file(self._history_file)
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
                    self.save(argument)
                else:
                    summary, notes = resume(self.session, argument, self.command_line)
                    self.say(summary)
                    for line in notes:
                        note(line)
            else:
                raise H2OStreamError(
                    f"unknown command {name}; type /help for the list "
                    "(start a message with // to send a message that begins with /)"
                )
        except OutputLost:
            raise
        except H2OStreamError as error:
            self.failures += 1
            note(f"Error: {error}")
        except Exception as error:  # noqa: BLE001 - anything unforeseen (e.g. from torch or the disk): the session goes on
            self.failures += 1
            note(f"Error: {name} failed: {type(error).__name__}: {one_line(error)} (the session is as it was)")
        return True

    def save(self, argument: str) -> None:
        """/save PATH, or /save PATH --force (also /save --force PATH): --force replaces a file that is not a chat
        session."""
        words = argument.split()
        force = "--force" in (words[0], words[-1])
        if force:
            argument = argument.strip().removeprefix("--force").removesuffix("--force").strip()
            if not argument:
                raise H2OStreamError("/save needs a file name: /save PATH --force")
        from h2o_stream.apps.chat.session_file import NotReplaced

        try:
            path = self.session.save(argument, force=True) if force else self.session.save(argument)
        except NotReplaced as error:
            raise H2OStreamError(
                f"{error.path} {error.what}, not a chat session: /save does not replace it "
                f"(/save {argument} --force does; or choose another file)"
            ) from None
        self.say(f"saved the session (turn {self.session.turns}, {size_text(path.stat().st_size)}) to {path}")

    def turn(self, text: str) -> None:
        self._stop.clear()
        try:
            for delta in self.session.send(text, should_stop=self._stop.is_set):
                self.write(delta)
        except OutputLost:
            raise
        except Exception as error:  # noqa: BLE001 - H2OStreamError, or anything from the model: the session is restored
            self.failures += 1
            self.write("\n")
            what = str(error) if isinstance(error, H2OStreamError) else f"{type(error).__name__}: {error}"
            note(f"Error: {what} (the session is as it was before this message)")
            return
        result = self.session.last_turn
        self.write("\n")
        if result.stop_reason == "interrupted":
            note(f"[stopped after {result.generated_tokens} tokens; the reply so far stays in the session]")
        elif result.stop_reason == "cancelled":
            note("[cancelled while reading the message; the session is as it was before it]")
        elif result.stop_reason == "length":
            note(f"[reply cut at --max-new-tokens {self.session.sampling.max_new_tokens}]")
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
            raise OutputLost(
                f"cannot write to stdout ({error.strerror or one_line(error)}); the chat stops here"
            ) from None


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


@dataclass
class CommandLine:
    """What the chat's command line set explicitly, which wins over a loaded session's own settings (--load, /load).

    `settings`: the sampling settings and chunk size given, by `Sampling` field name, with their values: they apply to
    a loaded session. `cache`: the cache options given (--policy, --cache-size, a budget part, --no-rolling) and
    `system`, whether --system was given, with `system_prompt` its prompt: these cannot change in a saved session (its
    cache holds the system prompt), so a loaded session keeps its own, with a note naming them."""

    settings: dict = field(default_factory=dict)
    cache: list[str] = field(default_factory=list)
    system: bool = False
    system_prompt: str | None = None


def resume(
    session: ChatSession, path: str, command_line: CommandLine, *, starting: bool = False
) -> tuple[str, list[str]]:
    """Load the session at `path` into `session`, then apply what `command_line` set; what to tell the user: the
    loaded session's summary, and notes on what the command line changed and what it could not. `starting`: the
    chat's own session is new (--load), so its cache is worth a note only when cache options were given."""
    before = cache_settings(session)
    session.load(path)
    saved = {
        key: session.chunk_size if key == "chunk_size" else getattr(session.sampling, key)
        for key in command_line.settings
    }
    changed = {key: value for key, value in command_line.settings.items() if saved[key] != value}
    session.change_settings(**changed)  # checked when the command line was read: cannot fail here
    notes = []
    after = cache_settings(session)
    if after != before and (command_line.cache or not starting):
        given = ", ".join(command_line.cache)
        notes.append(
            f"note: the loaded session keeps its own cache, {after}, instead of this chat's {before} "
            + (
                f"({given} {'does' if len(command_line.cache) == 1 else 'do'} not apply: a saved session's cache "
                "cannot change)"
                if command_line.cache
                else "(--policy/--cache-size do not apply to a loaded session)"
            )
        )
    if command_line.system and session.system != command_line.system_prompt:
        notes.append(
            "note: the loaded session keeps its own system prompt "
            f"({'none' if session.system is None else repr(clip(session.system, 40))}); --system does not apply: "
            "the session's cache holds the prompt it started with"
        )
    if changed:
        notes.append(
            "note: "
            + ", ".join(f"{option_name(key)} {value}" for key, value in changed.items())
            + " from the command line "
            + ("applies" if len(changed) == 1 else "apply")
            + " instead of the loaded session's "
            + ", ".join(f"{option_name(key).removeprefix('--')} {saved[key]}" for key in changed)
        )
    return loaded_summary(session, path), notes


def note(text: str) -> None:
    """A line for the user on stderr: stdout holds the replies alone."""
    click.echo(text, err=True)
