"""A request's messages as a conversation: the system prompt, the finished exchanges, the new user message, and the
digests by which the server recognises what it already holds.

A conversation's state is known at exchange boundaries only (after a reply and its closing tokens), so a history is
identified by a chain of digests, one per boundary: `prefix[0]` covers the system prompt and the cache settings
(a conversation under another system prompt or cache is another conversation), `prefix[i]` the first i exchanges. A
reply is compared without surrounding whitespace, since clients strip it; a user message exactly, as it was fed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .protocol import ApiError

SYSTEM_ROLES = ("system", "developer")  # "developer" is the newer OpenAI name of a system message


@dataclass
class History:
    """What the messages of one request say."""

    system: str | None
    exchanges: list[tuple[str, str]]  # (user, assistant), finished
    message: str  # the new user message
    prefix: list[str] = field(default_factory=list)  # digests at each exchange boundary, len(exchanges) + 1

    def digest_after(self, reply: str) -> str:
        """The digest of this history once `message` got `reply`: the conversation's next boundary."""
        return _chain(self.prefix[-1], self.message, reply)


def parse_history(messages: list, cache_key: dict) -> History:
    """The History of a request's (validated) messages; ApiError 400 naming the message at fault. The messages are
    user and assistant in turn, ending with a user message, with system messages anywhere: those before the first
    user message are the system prompt; a later one is folded into a user message, as a template without system
    turns mid-conversation needs: after the text of the user message it follows when that message has no reply yet,
    else before the text of the next user message. So a history folds the same way on every later turn."""
    system_parts: list[str] = []
    turns: list[tuple[str, str]] = []
    waiting: list[str] = []  # system texts for the next user message
    for index, message in enumerate(messages):
        role, text = message.role, _text(message.content, index)
        where = f"messages[{index}]"
        if role in SYSTEM_ROLES:
            if not turns:
                system_parts.append(text)
            elif text.strip() and len(turns) % 2 == 1:  # the last user message has no reply yet
                turns[-1] = ("user", f"{turns[-1][1]}\n\n{text}")
            elif text.strip():
                waiting.append(text)
            continue
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if role != expected:
            raise ApiError(
                400,
                f"{where} has role {role!r} where a {expected} message belongs: the messages must be user and "
                "assistant in turn, ending with a user message (system messages may come anywhere)",
                param=where,
            )
        if role == "user":
            if not text.strip():
                raise ApiError(400, f"{where} is empty", param=where)
            text, waiting = "\n\n".join([*waiting, text]), []
        turns.append((role, text))
    if not turns or turns[-1][0] != "user":
        raise ApiError(400, "the last message must be a user message", param="messages")
    system = "\n\n".join(system_parts) if any(p.strip() for p in system_parts) else None
    exchanges = [(turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2)]
    history = History(system, exchanges, turns[-1][1])
    history.prefix = prefix_digests(system, exchanges, cache_key)
    return history


def prefix_digests(system: str | None, exchanges: list[tuple[str, str]], cache_key: dict) -> list[str]:
    """The digest chain of a history: one per exchange boundary, the first for the system prompt and cache."""
    key = json.dumps({"system": system, "cache": cache_key}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()
    chain = [digest]
    for user, reply in exchanges:
        chain.append(_chain(chain[-1], user, reply))
    return chain


def _chain(previous: str, user: str, reply: str) -> str:
    parts = [
        previous,
        hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest(),
        hashlib.sha256(reply.strip().encode("utf-8", "surrogatepass")).hexdigest(),
    ]
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()


def _text(content, index: int) -> str:
    """A message's content as text: a string, or a list of text parts joined; None is an empty message."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"messages[{index}] holds a {part.type!r} part: only text is supported",
                param=f"messages[{index}].content",
            )
        pieces.append(part.text)
    return "".join(pieces)
