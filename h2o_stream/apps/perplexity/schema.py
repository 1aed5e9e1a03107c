"""The one schema of a run's result file (`<run>.json` of `h2o-stream ppl`), checked on every read.

A result is read back by `--resume`, the summary, the plots and the leaderboard, often from a clone on another machine
or after a hand edit, so nothing in it is trusted: `read_result` reads only a regular file of sane size, parses it as
strict JSON (no NaN, no infinity, no nesting deep enough to exhaust the stack) and checks every field a reader uses
with pydantic. A file that fails is one H2OStreamError naming the file and the field. Fields no reader uses are kept
as they are (a newer h2o-stream may add some).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from h2o_stream.engine.policies import POLICIES, policy_class
from h2o_stream.errors import H2OStreamError

#: a result file larger than this is not one (a 4M-token run's file is ~0.5 MB)
MAX_BYTES = 64 * 2**20
#: nesting deeper than this is not a result (and would exhaust the parser's stack)
MAX_DEPTH = 32

Count = Annotated[int, Field(ge=0, strict=True)]
Positive = Annotated[int, Field(ge=1, strict=True)]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


class Settings(BaseModel):
    """What a run was made with (see `binding`): the fields a reader compares or shows; the policy's parts too."""

    model_config = ConfigDict(extra="allow")

    model: str
    model_weights: str
    dtype: str
    policy: str
    chunk_size: Positive
    rolling: bool
    reset_per_book: bool = False
    wide_chunks: bool = False
    skip_tokens: Count = 0
    books: str | None = Field(None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$", max_length=10_000)  # --books, as given
    book_tokens: Positive | None = None
    data: str
    data_sha256: str | None = None

    @field_validator("policy")
    @classmethod
    def _is_known(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"{name!r} is not a policy of this h2o-stream ({', '.join(POLICIES)})")
        return name

    @model_validator(mode="after")
    def _has_its_parts(self) -> Settings:
        # the budget split is read from the settings by the policy's declared parts (the cache size is their sum)
        for part in policy_class(self.policy).part_names():
            value = getattr(self, part, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{self.policy}'s budget part {part!r} must be a whole number of slots, got {value!r}")
        return self


class Result(BaseModel):
    """A finished (or extended) run's result: the numbers every report reads."""

    model_config = ConfigDict(extra="allow")

    settings: Settings
    tokens_fed: Count
    predicted_tokens: Positive
    nll_sum: float
    mean_nll: float = Field(ge=0)
    ppl: float = Field(ge=1)
    seconds: float = Field(ge=0)
    tokens_per_second: float = Field(ge=0)
    peak_rss_bytes: Count
    curve: list[tuple[Positive, Annotated[float, Field(ge=1)]]]
    stream_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_keys_seen: Count | None = None
    #: the run's name, when it is not policy-size (a run of a part sweep: 'h2o-256-heavy=16')
    run: str | None = Field(None, pattern=r"^[A-Za-z0-9_]+(-[A-Za-z0-9_=]+)*$", max_length=200)
    span: Positive | None = None

    @field_validator("nll_sum", "mean_nll", "ppl", "seconds", "tokens_per_second")
    @classmethod
    def _is_finite(cls, value: float) -> float:
        return _finite(value)

    @field_validator("curve")
    @classmethod
    def _curve_is_finite(cls, curve: list) -> list:
        for _, value in curve:
            _finite(value)
        return curve


def read_result(path: str | os.PathLike) -> dict:
    """The result in the file at `path`, checked (see the module docstring); H2OStreamError naming the file and the
    field otherwise. Returns the parsed JSON as it is, unknown fields included."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as error:
        raise H2OStreamError(f"{path}: cannot be read ({error.strerror or error})") from None
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the reader forever, a device would never end
        raise H2OStreamError(f"{path} is not a regular file: a result is a JSON file written by h2o-stream ppl")
    if info.st_size > MAX_BYTES:
        raise H2OStreamError(f"{path} is {info.st_size:,} bytes, more than any result of h2o-stream ppl")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise H2OStreamError(
            f"{path} is not a readable result of h2o-stream ppl ({_short(str(error))}); move it away "
            "or choose another --out"
        ) from None
    if _depth(data) > MAX_DEPTH:
        raise H2OStreamError(f"{path} is not a result of h2o-stream ppl (its JSON nests deeper than {MAX_DEPTH})")
    if not isinstance(data, dict):
        raise H2OStreamError(
            f"{path} is not a result of h2o-stream ppl (a JSON {type(data).__name__}, not an "
            "object); move it away or choose another --out"
        )
    try:
        Result.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the file)"
        got = "" if first["type"] == "missing" else f" (got {_short(repr(first.get('input')))})"  # repr: one line
        raise H2OStreamError(
            f"{path}: field {field!r}: {first['msg']}{got}; "
            "a damaged or hand-edited result is never read: restore it, or move it away and "
            "run again"
        ) from None
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in strict JSON")


def _depth(data, limit: int = MAX_DEPTH + 1) -> int:
    """How deep `data` nests, counted no further than `limit` (iteratively: no recursion on hostile input)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest >= limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((value, depth + 1) for value in item.values())
        elif isinstance(item, list):
            stack.extend((value, depth + 1) for value in item)
    return deepest


def _short(value, width: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
