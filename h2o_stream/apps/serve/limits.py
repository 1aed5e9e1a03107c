"""What one request may ask of the server, and how much it holds at once, as the operator sets it (`h2o-stream serve
--max-...`, `--in-memory`). Its own module, without torch or pydantic, so the command line takes its defaults from
here and its help stays fast."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IN_MEMORY = 8  # idle conversations kept in memory between their turns
DEFAULT_MAX_BATCH = 16  # turns under way at once, each a row of the batched forwards


@dataclass
class Limits:
    """What one request may ask for. A history is sent whole with every turn, so the body limit is generous."""

    max_request_bytes: int = 8 * 2**20
    max_messages: int = 10_000
    max_tokens: int = 4096
    max_prompt_tokens: int = 32_768  # read by one turn: a new message, and the exchanges the server does not hold
    max_stops: int = 4
    max_depth: int = 32  # of the body's JSON: OpenAI's requests nest a few levels; far deeper is an attack
