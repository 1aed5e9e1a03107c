"""What the eval suites' tests share: the committed results, the key shape of a JSON result, a written result checked
to record no absolute path, and a suite run in the test's process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eval.__main__ import main

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "eval" / "results"
#: the folders of `h2o-stream ppl` / `leaderboard` run files, whose provenance the library itself writes
RUN_FILES = (
    "leaderboard",
    "leaderboard_gemma3",
    "long_4m",
    "long_fair",
    "long_fair_gemma3",
    "quality/runs",
    "split/smollm2",
    "split/gemma3-270m",
)


def shape(value, free: frozenset = frozenset()):
    """The key structure of a JSON value: dicts by their keys (recursively), lists and scalars by kind. A dict under a
    key in `free` is keyed by what was measured (contenders, thread counts): there only the shapes of its values
    count."""
    if isinstance(value, dict):
        return {
            key: (_free(item, free) if key in free and isinstance(item, dict) else shape(item, free))
            for key, item in value.items()
        }
    return "list" if isinstance(value, list) else "scalar"


def _free(value: dict, free: frozenset):
    return {"*": sorted({json.dumps(shape(item, free), sort_keys=True) for item in value.values()})}


ABSOLUTE = re.compile(r"(?:^|[\s='\"])(?:/[\w.+-]+){2,}")  # an absolute path in a string


def strings(value):
    """Every string in a JSON value."""
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings(item)]
    return [value] if isinstance(value, str) else []


def written_json(path: Path) -> dict:
    """A result a suite wrote, checked to record no absolute path."""
    result = json.loads(path.read_text())
    assert not [s for s in strings(result) if ABSOLUTE.search(s)], path
    return result


def committed(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def suite(*argv: str) -> None:
    """`python -m eval ARGV` in this process; fails the test on a non-zero exit."""
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    assert done.value.code in (0, None), f"python -m eval {' '.join(argv)} exited {done.value.code}"
