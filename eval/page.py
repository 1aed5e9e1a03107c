"""What docs/results.md and README.md's blocks share (`python -m eval render`): the result files, read once each and
named from the repository's root, and fixed-precision formatting, so that rendering twice gives the same bytes; each
table says where its numbers come from (`source`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from eval.common import BadInput, scrub_command


class RenderError(BadInput):
    """A bad input to the renderer (a README's blocks, a result file): one clear line, exit status 2."""


@contextlib.contextmanager
def unexpected(what: str):
    """A result file without a field its table needs: one clear line, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as error:
        raise RenderError(
            f"{what}: a result under eval/results lacks what it needs ({type(error).__name__}: {error})"
        ) from error


class Results:
    """The result files under `directory` (parsed once each), and how to name and link them from `root`."""

    def __init__(self, directory: Path, root: Path):
        self.directory, self.root, self._cache = directory, root, {}

    def get(self, name: str) -> dict | None:
        if name not in self._cache:
            path = self.directory / name
            try:
                self._cache[name] = json.loads(path.read_text()) if path.is_file() else None
            except ValueError as error:
                raise RenderError(f"{path}: not valid JSON ({error})") from error
        return self._cache[name]

    def names(self, pattern: str) -> list[str]:
        return sorted(p.relative_to(self.directory).as_posix() for p in self.directory.glob(pattern))

    def shown(self, name: str) -> str:
        """The file's name as a page shows it: relative to the root."""
        return Path(os.path.relpath(self.directory / name, self.root)).as_posix()

    def link(self, name: str, page: Path) -> str:
        return Path(os.path.relpath(self.directory / name, (self.root / page).parent)).as_posix()

    def figure(self, name: str, page: Path, alt: str) -> list[str]:
        return [f"![{alt}]({self.link(name, page)})", ""] if (self.directory / name).is_file() else []


# --- formatting ----------------------------------------------------------------------------------------------------


def num(x, places: int = 2) -> str:
    return "–" if x is None else f"{x:,.{places}f}"


def pct(x, places: int = 1) -> str:
    return "–" if x is None else f"{100 * x:+.{places}f}%"


def table(header: list[str], rows: list[list], right: set[int] = frozenset()) -> list[str]:
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return [
        f"| {' | '.join(header)} |",
        f"|{'|'.join(align)}|",
        *(f"| {' | '.join(str(c) for c in row)} |" for row in rows),
        "",
    ]


def versions(result: dict) -> str:
    """The machine, threads and versions a result records, in one phrase."""
    env = result.get("environment") or result.get("versions") or {}
    parts = [f"{k} {env[k]}" for k in ("torch", "transformers", "python") if env.get(k)]
    parts += [env[k] for k in ("machine",) if env.get(k)]
    parts += [f"{env['threads']} thread(s)"] if env.get("threads") else []
    return ", ".join(parts)


def corpus(result: dict) -> str:
    """The corpus a result records (name, what it is, the start of its sha256), or ''."""
    data = result.get("data") or (result.get("settings") or {}).get("data")
    if isinstance(data, dict):
        return f"{data['name']} ({data['description']}, sha256 {str(data.get('sha256'))[:12]}…)"
    return data if isinstance(data, str) else ""


def source(res: Results, name: str, command: str | None = None, extra: str = "") -> str:
    """Where a table's numbers come from: the file, the command recorded in it (or `command`), the versions and
    machine, the corpus."""
    result = res.get(name) or {}
    recorded = result.get("command") or (result.get("environment") or {}).get("command")
    command = command or (scrub_command(recorded) if recorded else None)
    text = f"Source: `{res.shown(name)}`" + (f", made by `{command}`" if command else "")
    text += f" ({versions(result)})" if versions(result) else ""
    text += f"; corpus {corpus(result)}" if corpus(result) else ""
    return text + extra + "."


def run_provenance(runs: list[dict]) -> list[str]:
    """The distinct commands and versions recorded in `h2o-stream ppl` run files."""
    commands = sorted({scrub_command(r["command"]) for r in runs if r.get("command")})
    found = sorted({versions(r) for r in runs if versions(r)})
    return (
        [f"Commands recorded in its run files ({len(runs)}):", "", *(f"- `{c}`" for c in commands), ""]
        if commands
        else []
    ) + ([f"Run versions: {'; '.join(found)}.", ""] if found else [])
