"""`--workers N`: a sweep's runs in local worker processes give the results of running them one after another, and a
signal to the command checkpoints every worker's run so that --resume continues them exactly."""

from __future__ import annotations

import io
import json
import queue
import re
import shlex
import signal
import subprocess
import sys

import pytest

from h2o_stream.apps.perplexity.progress import Bars, SentBars
from h2o_stream.files import WRITE_DELAY_ENV
from support.ppl_helpers import assert_same_runs, ppl_command, run_to_end, subprocess_env, wait_for, write_corpus

RUNS = ["h2o-16", "sink-16", "tova-16", "h2o-24"]


def test_runs_in_workers_equal_runs_one_after_another(ppl_model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        600,
        "--policy",
        "h2o,sink,tova",
        "--cache-size",
        "16,24",
        "--threads",
        1,
    ]
    run_to_end(ppl_command(*args, "--out", tmp_path / "alone", "--workers", 1))
    done = run_to_end(ppl_command(*args, "--out", tmp_path / "workers", "--workers", 3))
    assert "runs on 3 workers, 1 thread(s) each" in done.stderr
    assert_same_runs(tmp_path / "alone", tmp_path / "workers", 6)
    summary = json.loads((tmp_path / "workers" / "summary.json").read_text())
    assert len(summary) == 6  # the report covers every worker's runs


def test_a_signal_checkpoints_every_worker_and_resume_continues_exactly(ppl_model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        3000,
        "--policy",
        "h2o,sink",
        "--cache-size",
        "16,24",
        "--chunk-size",
        4,
        "--checkpoint-every",
        40,
        "--threads",
        1,
    ]
    run_to_end(ppl_command(*args, "--out", tmp_path / "whole"))
    out = tmp_path / "out"
    command = ppl_command(*args, "--out", out, "--workers", 2)
    # Each of a run's ~75 checkpoints takes 0.25 s, so a run lasts ~19 s: long enough for the second worker to load
    # and start its run before the first worker's run ends, even on a loaded machine (with 0.05 s, a worker that
    # took over 4 s to start once found its partner's first run done and the signal caught only one run).
    process = subprocess.Popen(
        command,
        env=subprocess_env(**{WRITE_DELAY_ENV: "0.25"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    runs = [out / f"{name}.ckpt" for name in ("h2o-16", "h2o-24", "sink-16", "sink-24")]
    wait_for(lambda: sum(path.exists() for path in runs) >= 2, "both workers' first checkpoints", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert lines[-2] == "interrupted by SIGINT: stopped between runs. Continue with:", stderr
    assert sum("checkpointed at token" in line for line in lines) == 2, stderr  # each worker stopped in a run
    assert not list(out.glob("*-*.json")), "a run finished before the signal"
    printed = shlex.split(lines[-1])
    assert printed[-1] == "--resume"
    run_to_end([sys.executable, "-m", "h2o_stream", *printed[1:]])
    for name in ("h2o-16", "sink-16", "h2o-24", "sink-24"):
        whole, resumed = (json.loads((tmp_path / d / f"{name}.json").read_text()) for d in ("whole", "out"))
        assert resumed["nll_sum"] == whole["nll_sum"] and resumed["curve"] == whole["curve"]


def test_auto_workers_is_one_single_thread_worker_per_core_as_memory_allows():
    from h2o_stream.apps.perplexity.workers import auto_workers, threads_per_worker
    from support.tiny_models import tiny_model

    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    plenty = 1 << 40
    assert auto_workers(6, model, cores=4, available=plenty) == 4
    assert auto_workers(3, model, cores=4, available=plenty) == 3  # never more workers than runs
    assert auto_workers(1, model, cores=4, available=plenty) == 1
    assert auto_workers(6, model, cores=4, available=2 * (2 * weights + (512 << 20))) == 2  # memory for two copies
    assert auto_workers(6, model, cores=4, available=0) == 1
    assert threads_per_worker(4, None) >= 1 and threads_per_worker(2, 3) == 3


def test_workers_option_takes_a_count_or_auto(ppl_model_dir, capsys):
    from support.ppl_helpers import ppl_error

    assert "'0' is not a positive integer or 'auto'" in ppl_error(capsys, "--workers", 0, "--model", ppl_model_dir)
    assert "'many' is not a positive integer or 'auto'" in ppl_error(capsys, "--workers", "many")


def test_on_a_terminal_each_run_has_a_named_bar_and_the_model_loads_in_view_once(ppl_model_dir, tmp_path):
    """Two workers' runs, drawn by the parent: each bar names its run; transformers' "Loading weights" shows once (the
    parent's), not per worker; a line says what loads before the quiet seconds of importing torch."""
    pexpect = pytest.importorskip("pexpect")
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    env = {key: value for key, value in subprocess_env(**{WRITE_DELAY_ENV: "0.1"}).items() if key != "TQDM_DISABLE"}
    command = ppl_command(
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        1000,
        "--policy",
        "h2o,sink",
        "--cache-size",
        16,
        "--chunk-size",
        4,
        "--checkpoint-every",
        40,
        "--threads",
        1,
        "--workers",
        2,
        "--out",
        tmp_path / "out",
    )
    child = pexpect.spawn(
        command[0],
        command[1:],
        env=env,
        cwd=str(tmp_path),
        dimensions=(24, 150),
        timeout=300,
        encoding="utf-8",
        codec_errors="replace",
    )
    child.expect(pexpect.EOF)
    child.close()
    shown = child.before
    assert child.exitstatus == 0, shown[-3000:]
    assert shown.index("loading torch, transformers and") < shown.index("runs on 2 workers")
    assert shown.count("Loading weights: 100%") == 1, shown
    for name in ("h2o-16", "sink-16"):
        assert re.search(rf"\r{name}: +\d+%\|", shown), shown[-3000:]
    assert (tmp_path / "out" / "h2o-16.json").is_file()


class Terminal(io.StringIO):
    """What a bar draws on, as if it were a terminal 100 columns wide."""

    def isatty(self) -> bool:
        return True


def test_bars_of_runs_in_progress_sit_on_lines_of_their_own():
    screen = Terminal()
    bars = Bars(leave=False, file=screen)
    bars.update("h2o-256", 256, 3000)
    bars.update("sink-256", 512, 3000, "ppl=41.07")
    bars.update("h2o-256", 768, 3000, "ppl=50.10")
    drawn = screen.getvalue()
    assert "h2o-256:" in drawn and "sink-256:" in drawn and "ppl=41.07" in drawn
    assert "\x1b[A" in drawn  # the second run's bar is drawn a line below, and the cursor goes back up
    assert len({bar.pos for bar in bars.bars.values()}) == 2
    bars.note(lambda text: screen.write(text + "\n"), "[worker 0] h2o-256 done")
    assert "[worker 0] h2o-256 done\n" in screen.getvalue()
    bars.close()
    assert bars.bars == {}


def test_a_worker_sends_a_runs_progress_at_most_twice_a_second_and_always_its_end():
    sent = queue.Queue()
    bars = SentBars(sent, 1)
    for position in range(0, 3000, 100):
        bars.update("h2o-256", position, 3000)
    bars.update("h2o-256", 3000, 3000, "ppl=40.00")
    bars.finish("h2o-256")
    events = [sent.get_nowait() for _ in range(sent.qsize())]
    assert events[0] == (1, "progress", ("h2o-256", 0, 3000, None))
    assert events[-2:] == [(1, "progress", ("h2o-256", 3000, 3000, "ppl=40.00")), (1, "finished", "h2o-256")]
    assert len(events) == 3  # the updates in between came within half a second of the first
