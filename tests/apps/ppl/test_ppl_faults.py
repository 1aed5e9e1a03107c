"""Fault injection on `h2o-stream ppl` in subprocesses: SIGKILL at random points (one of them halfway through a
checkpoint write), then Ctrl-C (SIGINT) and SIGTERM, each followed by --resume; the result is bit-identical to one
uninterrupted run."""

from __future__ import annotations

import json
import random
import shlex
import signal
import subprocess
import sys
import time

from h2o_stream.apps.perplexity.run import CHECKPOINT_KIND, CHECKPOINT_VERSION
from h2o_stream.files import WRITE_DELAY_ENV, read_verified
from support.ppl_helpers import ppl_command, run_to_end, subprocess_env, wait_for, write_corpus


def mtime(path) -> int:
    return path.stat().st_mtime_ns if path.exists() else 0


def test_killed_and_interrupted_runs_resume_bit_identically(ppl_model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        4000,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--checkpoint-every",
        64,
        "--threads",
        1,
    ]
    run_to_end(ppl_command(*args, "--out", tmp_path / "whole"))
    out = tmp_path / "out"
    checkpoint = out / "h2o-16.ckpt"
    first = ppl_command(*args, "--out", out)
    resume = [*first, "--resume"]

    # 1. SIGKILL halfway through a checkpoint write (the writer pauses there: a test hook), once a good one exists
    process = subprocess.Popen(
        first, env=subprocess_env(**{WRITE_DELAY_ENV: "1"}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    partials = lambda: list(out.glob("h2o-16.ckpt.*.tmp.ckpt"))  # noqa: E731
    wait_for(lambda: checkpoint.exists() and partials(), "a second checkpoint write", process)
    process.kill()
    process.wait()
    assert partials(), "the kill did not land inside the write"
    good = read_verified(checkpoint, CHECKPOINT_KIND, CHECKPOINT_VERSION)  # the last good checkpoint is intact
    assert good["position"] == 256  # the first checkpoint: chunks of 8 go in forwards of 256 (checkpoints between)

    # 2. SIGKILL at random points after the resumed run has made progress (writes paused 50 ms: it lasts longer)
    rng = random.Random(7)
    for _ in range(2):
        before = mtime(checkpoint)
        process = subprocess.Popen(
            resume,
            env=subprocess_env(**{WRITE_DELAY_ENV: "0.05"}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda before=before: mtime(checkpoint) != before, "progress", process)
        time.sleep(rng.uniform(0, 0.3))
        process.kill()
        assert process.wait() == -signal.SIGKILL, "the run finished before it could be killed"

    # 3. Ctrl-C, then SIGTERM: the chunk is finished, a checkpoint written, and the command to resume printed
    command = resume
    for signum in (signal.SIGINT, signal.SIGTERM):
        before = mtime(checkpoint)
        process = subprocess.Popen(
            command,
            env=subprocess_env(**{WRITE_DELAY_ENV: "0.05"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda before=before: mtime(checkpoint) != before, "progress", process)
        time.sleep(rng.uniform(0, 0.2))
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 128 + signum, stderr
        lines = stderr.strip().splitlines()
        position = read_verified(checkpoint, CHECKPOINT_KIND, CHECKPOINT_VERSION)["position"]
        assert lines[-2] == (
            f"interrupted by {signal.Signals(signum).name}: h2o-16 checkpointed at token {position:,}. Continue with:"
        ), stderr
        printed = shlex.split(lines[-1])
        assert printed[0] == "h2o-stream" and printed[1:] == [str(a) for a in resume[3:]], printed
        command = [sys.executable, "-m", "h2o_stream", *printed[1:]]
    assert not (out / "h2o-16.json").exists(), "a run finished before it was interrupted"

    run_to_end(command)
    whole = json.loads((tmp_path / "whole" / "h2o-16.json").read_text())
    resumed = json.loads((out / "h2o-16.json").read_text())
    assert resumed["nll_sum"] == whole["nll_sum"] and resumed["predicted_tokens"] == whole["predicted_tokens"]
    assert resumed["curve"] == whole["curve"] and resumed["stream_sha256"] == whole["stream_sha256"]
    assert not list(out.glob("*.tmp*")), "a partial file survived the resume"
