"""Progress where stderr is not a terminal (a log file, a pipe): every H2O_STREAM_PROGRESS_EVERY seconds a plain line
per job (tokens done / total, tok/s, a run's running perplexity, time left) from ppl, the leaderboard, calibrate,
summarize and a sweep's workers; a terminal keeps its bar; a bad setting is one error before the model loads."""

from __future__ import annotations

import io
import re
import subprocess

import pytest
from click.testing import CliRunner

from h2o_stream.apps.progress import PROGRESS_EVERY_VARIABLE, Bars, progress_every
from h2o_stream.cli.summarize import summarize as summarize_command
from support.ppl_helpers import command, ppl, ppl_command, subprocess_env, write_corpus
from support.summarize_helpers import words

#: a progress line: name, tokens done / total, percent, rate, what the job adds (optional), time left
LINE = re.compile(
    r"^(?P<name>[\w.-]+): (?P<done>\d+)/(?P<total>\d+) tokens \((?P<percent>\d+)%\), (?P<rate>[\d.]+) tok/s, "
    r"(?:(?P<postfix>[^,]+), )?(?P<left>\d+:\d\d:\d\d) left$",
    re.MULTILINE,
)


def progress_lines(stderr: str) -> dict[str, list[re.Match]]:
    """The progress lines in `stderr`, by job name."""
    lines: dict[str, list[re.Match]] = {}
    for match in LINE.finditer(stderr):
        lines.setdefault(match["name"], []).append(match)
    return lines


def assert_progressing(lines: list[re.Match], total: int) -> None:
    """Several lines of one job, its tokens rising to at most `total`, every field parseable."""
    assert len(lines) >= 2, [line[0] for line in lines]
    done = [int(line["done"]) for line in lines]
    assert done == sorted(done) and done[0] < done[-1] <= total, done
    for line in lines:
        assert int(line["total"]) == total and float(line["rate"]) >= 0
        assert int(line["percent"]) == 100 * int(line["done"]) // total


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


@pytest.fixture
def often(monkeypatch):
    """A line at nearly every step of the tiny jobs."""
    monkeypatch.setenv(PROGRESS_EVERY_VARIABLE, "0.0001")


def test_ppl_prints_progress_lines_with_rising_tokens_and_running_ppl(ppl_model_dir, corpus, tmp_path, capsys, often):
    code, _, stderr = ppl(capsys, "--model", ppl_model_dir, "--data", corpus, "--policy", "h2o", "--cache-size", 16,
                          "--tokens", 300, "--chunk-size", 8, "--out", tmp_path / "out")  # fmt: skip
    assert code == 0, stderr
    lines = progress_lines(stderr)
    assert list(lines) == ["h2o-16"]
    assert_progressing(lines["h2o-16"], 300)
    assert all(float(line["postfix"].removeprefix("ppl=")) > 1 for line in lines["h2o-16"])
    assert int(lines["h2o-16"][-1]["done"]) == 300  # the run's last line says where it ended


def test_the_leaderboard_prints_progress_lines_for_every_run(ppl_model_dir, corpus, tmp_path, capsys, often):
    code, _, stderr = command(capsys, "leaderboard", "--model", ppl_model_dir, "--data", corpus, "--policy", "h2o,sink",
                              "--cache-size", 16, "--tokens", 600, "--out", tmp_path / "board")  # fmt: skip
    assert code == 0, stderr
    lines = progress_lines(stderr)
    assert_progressing(lines["h2o-16"], 600)
    assert int(lines["sink-16"][-1]["done"]) == 600  # sink's run is one forward: its line at the end


def test_calibrate_prints_progress_lines_of_the_windows_read(ppl_model_dir, corpus, tmp_path, capsys, often):
    code, _, stderr = command(capsys, "calibrate", "--model", ppl_model_dir, "--data", corpus, "--cache-size", 16,
                              "--windows", 3, "--length", 48, "--out", tmp_path / "heads.json")  # fmt: skip
    assert code == 0, stderr
    lines = progress_lines(stderr)
    assert_progressing(lines["calibrating"], 3 * 48)


def test_summarize_prints_progress_lines_of_the_document_read(model_dir, tmp_path, often):
    source = tmp_path / "doc.txt"
    source.write_text(words(600), encoding="utf-8")
    args = [source, "--model", model_dir, "--threads", 1, "--cache-size", 48, "--chunk-size", 16,
            "--max-new-tokens", 4]  # fmt: skip
    done = CliRunner().invoke(summarize_command, [str(a) for a in args], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    lines = progress_lines(done.stderr)["reading"]
    assert_progressing(lines, int(lines[0]["total"]))
    assert not re.search(r"\rreading", done.stderr)  # no bar drawn into the log


def test_workers_progress_reaches_the_log_of_the_parent(ppl_model_dir, corpus, tmp_path):
    done = subprocess.run(
        ppl_command("--model", ppl_model_dir, "--data", corpus, "--policy", "h2o,sink", "--cache-size", 16,
                    "--tokens", 300, "--chunk-size", 8, "--workers", 2, "--out", tmp_path / "out"),
        env={**subprocess_env(**{PROGRESS_EVERY_VARIABLE: "0.0001"}), "TQDM_DISABLE": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = progress_lines(done.stderr)
    for name in ("h2o-16", "sink-16"):
        assert int(lines[name][-1]["done"]) == 300, done.stderr
        assert [int(line["done"]) for line in lines[name]] == sorted(int(line["done"]) for line in lines[name])


def test_lines_come_at_most_every_interval_and_a_job_that_printed_one_ends_with_its_last(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr("h2o_stream.apps.progress.time.monotonic", lambda: float(next(clock)))
    log = io.StringIO()
    bars = Bars(file=log, every=3)
    for position in range(0, 1001, 100):  # one update a second
        bars.update("sink-64", position, 1000, f"ppl={50 - position / 100:.2f}")
    bars.finish("sink-64")
    lines = progress_lines(log.getvalue())["sink-64"]
    assert [int(line["done"]) for line in lines] == [300, 600, 900, 1000]
    assert float(lines[0]["rate"]) == 100.0 and lines[0]["left"] == "0:00:07" and lines[0]["postfix"] == "ppl=47.00"
    quiet = io.StringIO()
    bars = Bars(file=quiet, every=3)
    bars.update("h2o-64", 0, 1000)
    bars.update("h2o-64", 1000, 1000)
    bars.finish("h2o-64")  # a job shorter than the interval prints nothing
    assert quiet.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_live_bar_not_lines(monkeypatch):
    monkeypatch.setenv(PROGRESS_EVERY_VARIABLE, "0.0001")
    screen = Terminal()
    bars = Bars(file=screen)
    for position in range(0, 1001, 250):
        bars.update("h2o-64", position, 1000, "ppl=12.00")
    bars.finish("h2o-64")
    assert re.search(r"\rh2o-64: +\d+%\|", screen.getvalue())
    assert progress_lines(screen.getvalue()) == {}


@pytest.mark.parametrize("value, every", [("", 60.0), ("2.5", 2.5), ("off", None), ("OFF", None)])
def test_the_interval_is_a_minute_unless_set(monkeypatch, value, every):
    monkeypatch.setenv(PROGRESS_EVERY_VARIABLE, value)
    assert progress_every() == every


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_interval_is_one_error_before_the_model_loads(corpus, tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv(PROGRESS_EVERY_VARIABLE, value)
    code, _, stderr = ppl(capsys, "--model", tmp_path / "no-such-model", "--data", corpus, "--tokens", 100,
                          "--out", tmp_path / "out")  # fmt: skip
    assert code == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith(f"Error: {PROGRESS_EVERY_VARIABLE} must be a positive number")
    code, _, stderr = command(capsys, "calibrate", "--model", tmp_path / "no-such-model", "--data", corpus,
                              "--out", tmp_path / "heads.json")  # fmt: skip
    assert code == 2 and PROGRESS_EVERY_VARIABLE in stderr.strip().splitlines()[-1], stderr


def test_ppl_in_a_terminal_draws_its_bar_and_prints_no_lines(ppl_model_dir, corpus, tmp_path):
    import pexpect

    env = {**subprocess_env(**{PROGRESS_EVERY_VARIABLE: "0.0001"}), "TQDM_DISABLE": "0"}
    args = ppl_command("--model", ppl_model_dir, "--data", corpus, "--policy", "h2o", "--cache-size", 16,
                       "--tokens", 300, "--chunk-size", 8, "--out", tmp_path / "out")  # fmt: skip
    child = pexpect.spawn(args[0], args[1:], env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    shown = child.read()
    child.close()
    assert child.exitstatus == 0, shown
    assert re.search(r"\rh2o-16: +\d+%\|", shown), shown[-2000:]
    assert progress_lines(shown.replace("\r\n", "\n")) == {}
