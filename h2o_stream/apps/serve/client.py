"""The chat REPL's session held by a running `h2o-stream serve` (`h2o-stream chat --server URL`): the same
`send` / `last_turn` / `reset` / `stats` as a ChatSession, over the OpenAI API with only the standard library.

It keeps the conversation's messages (the server needs the history each turn) and names the conversation with an
`X-Conversation-Id` of its own, so the server continues it in place. A reply stopped with Ctrl-C closes the stream:
the server drops that turn, and the reply so far is sent back with the next message as part of the history.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from h2o_stream.apps.chat.stats import TurnResult
from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.generation import Sampling


@dataclass
class _Described:
    text: str

    def describe(self) -> str:
        return self.text


def base_url(url: str, name: str = "the server URL") -> str:
    """The API's base URL for a server given as `url`, an http:// or https:// URL with a host (/v1 added when it
    does not end so); else H2OStreamError, whose message starts with `name` (a command passes its option's)."""
    example = "e.g. http://127.0.0.1:8000/v1"
    if not isinstance(url, str) or not url:
        raise H2OStreamError(f"{name} is empty: give a server's URL ({example})")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise H2OStreamError(f"{name} {url!r} holds a space or control character: a URL has none ({example})")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or "://" not in url:
        hint = f"; did you mean http://{url}?" if "://" not in url else f" ({example})"
        raise H2OStreamError(f"{name} {url!r} is not an http:// or https:// URL{hint}")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise H2OStreamError(f"{name} {url!r} has a port that is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise H2OStreamError(f"{name} {url!r} names no host ({example})")
    if parts.query or parts.fragment:
        raise H2OStreamError(f"{name} {url!r} is a base URL: it takes no ?query or #fragment ({example})")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class RemoteSession:
    """A conversation on the server at `url` (its base URL, e.g. http://127.0.0.1:8000/v1)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        system: str | None = None,
        sampling: Sampling | None = None,
        seed: int | None = None,
        timeout: float = 600,
    ):
        self.url = base_url(url)
        self.api_key, self.timeout, self.seed = api_key, timeout, seed
        self.sampling = sampling or Sampling()
        self.system = system if system and system.strip() else None
        self.model = model or self._get("/models")["data"][0]["id"]
        self.notice = None
        self.system_warning = None
        self.reset()

    # what the REPL reads of a session
    @property
    def policy(self) -> _Described:
        return _Described(self.info.get("policy", "the server's cache"))

    @property
    def budget(self) -> int | None:
        return self.info.get("cache_budget", 0)

    def reset(self) -> None:
        """Start a new conversation (the old one stays on the server)."""
        self.conversation = uuid.uuid4().hex[:20]
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns, self.generated_tokens = 0, 0
        self.info: dict = {}  # the server's account (its "h2o_stream" field) of the last turn
        self.last_turn: TurnResult | None = None

    def send(self, text: str, *, should_stop: Callable[[], bool] | None = None) -> Iterator[str]:
        """Send a user message and yield the reply as it streams; the TurnResult is then `last_turn`."""
        if not isinstance(text, str) or not text.strip():
            raise H2OStreamError("the message is empty")
        return self._turn(text, should_stop or (lambda: False))

    def _turn(self, text: str, should_stop: Callable[[], bool]) -> Generator[str, None, TurnResult]:
        s = self.sampling
        body = {
            "model": self.model,
            "messages": [*self.messages, {"role": "user", "content": text}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": s.max_new_tokens,
            **({"seed": self.seed} if self.seed is not None else {}),
        }
        reply, finish = "", None
        usage: dict = {}
        with self._open("/chat/completions", body) as response:
            for raw in response:
                if should_stop():
                    finish = "interrupted"
                    break
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise H2OStreamError(f"the server: {event['error'].get('message')}")
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        reply += piece
                        yield piece
                    finish = choice.get("finish_reason") or finish
                self.info = event.get("h2o_stream") or self.info
                usage = event.get("usage") or usage
        reasons: dict[str | None, str] = {"stop": "end", "length": "length"}
        reason = reasons.get(finish, "interrupted")
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        self.turns += 1
        generated = usage.get("completion_tokens", 0)
        self.generated_tokens += generated
        self.last_turn = TurnResult(reply, usage.get("prompt_tokens", 0), generated, reason, 0.0, 0.0)
        return self.last_turn

    def chat(self, text: str, **kwargs) -> TurnResult:
        for _ in self.send(text, **kwargs):
            pass
        assert self.last_turn is not None  # set when the reply's stream ends, which the loop above waited for
        return self.last_turn

    def stats(self) -> dict:
        """What /stats shows, from the server's account of the last turn."""
        info = self.info
        return {
            "turns": self.turns,
            "tokens_seen": info.get("tokens_seen", 0),
            "prompt_tokens": info.get("tokens_seen", 0) - self.generated_tokens,
            "generated_tokens": self.generated_tokens,
            "cache_slots": info.get("cache_slots", 0),
            "cache_budget": info.get("cache_budget"),
            "policy": info.get("policy", "?"),
            "evicted": 0,
            "cache_bytes": 0,
            "last_tokens_per_second": 0.0,
            "last_prompt_tokens_per_second": 0.0,
            "tokens_per_second": 0.0,
            "rss_bytes": 0,
        }

    def save(self, path, *, force: bool = False):
        raise H2OStreamError(
            "/save is not available with --server: the server keeps the conversation (in its --state-dir)"
        )

    load = save

    # -- HTTP ----------------------------------------------------------------------------------------------------------

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if getattr(self, "conversation", None):
            headers["X-Conversation-Id"] = self.conversation
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _get(self, path: str) -> dict:
        with self._open(path, None) as response:
            return json.loads(response.read())

    def _open(self, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers=self._headers(), method="GET" if body is None else "POST"
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            try:
                message = json.loads(error.read())["error"]["message"]
            except Exception:  # noqa: BLE001 - not the server's error object: say what HTTP said
                message = error.reason
            raise H2OStreamError(f"the server at {self.url} answered {error.code}: {message}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise H2OStreamError(f"cannot reach a server at {self.url}: {one_line(reason)}") from None
