"""Shared set-up of the `h2o-stream ppl` tests (their tiny model directory is conftest's `ppl_model_dir`): a corpus,
the command run in-process (its exit status, stdout and stderr) or as a subprocess, waiting on a running one, and file
snapshots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from h2o_stream.cli import main

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity. "
) * 40


def write_corpus(path: Path, books: int = 3, text: str = TEXT) -> Path:
    """A .jsonl corpus of `books` books, each a shifted slice of `text`."""
    rows = [{"short_book_title": f"Book {i}", "text": text[i * 50 :]} for i in range(books)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def ppl(capsys, *args) -> tuple[int, str, str]:
    """`h2o-stream ppl ARGS` in-process: (exit status, stdout, stderr)."""
    return command(capsys, "ppl", *args)


def command(capsys, name: str, *args) -> tuple[int, str, str]:
    """`h2o-stream NAME ARGS` in-process: (exit status, stdout, stderr)."""
    try:
        main([name, *map(str, args)])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ppl_error(capsys, *args) -> str:
    """The one `Error:` line of a ppl call that must fail with exit status 2 and no traceback."""
    code, _, stderr = ppl(capsys, *args)
    assert code == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Traceback" not in stderr, stderr
    return last


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file in `directory` (names and bytes), to show that a refused call changed nothing."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def result(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def assert_same_runs(first: Path, second: Path, count: int, *, per_token: float = 0.0) -> None:
    """The run results in two --out directories: the same `count` runs with the same settings and tokens fed, and
    the same NLL sums and curves (or, with `per_token`, NLL sums within `per_token` times the predictions)."""
    names = sorted(p.stem for p in first.glob("*-*.json"))
    assert len(names) == count and names == sorted(p.stem for p in second.glob("*-*.json"))
    for name in names:
        a, b = result(first, name), result(second, name)
        assert a["settings"] == b["settings"] and a["tokens_fed"] == b["tokens_fed"], name
        if per_token:
            assert abs(a["nll_sum"] - b["nll_sum"]) <= per_token * a["predicted_tokens"], name
        else:
            assert a["nll_sum"] == b["nll_sum"] and a["curve"] == b["curve"], name


def ppl_command(*args) -> list[str]:
    """The command line that runs `h2o-stream ppl ARGS` in a subprocess."""
    return [sys.executable, "-m", "h2o_stream", "ppl", *map(str, args)]


def subprocess_env(**extra: str) -> dict[str, str]:
    """One thread (identical numbers in every process) and no progress bars."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **extra}


def unmeasured(env: dict[str, str]) -> dict[str, str]:
    """`env` without coverage.py's measurement of subprocesses (`pytest --cov`, as CI runs): a process under a
    file-size limit cannot write its coverage data at exit, and would print that failure's traceback."""
    return {name: value for name, value in env.items() if name != "COVERAGE_PROCESS_CONFIG"}


def run_to_end(command: list[str], **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=subprocess_env(**env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll `condition` until it holds; fail if `process` ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
