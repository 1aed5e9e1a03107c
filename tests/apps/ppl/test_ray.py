"""`--ray ADDRESS`: a sweep's runs as tasks on a Ray cluster (here a local instance, `--ray local`) give the results
of running them one after another, gathered into the same --out and report."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys

import pytest

from h2o_stream.files import WRITE_DELAY_ENV
from support.ppl_helpers import assert_same_runs, ppl, ppl_command, run_to_end, subprocess_env, wait_for, write_corpus

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'h2o-stream[ray]')")


def test_runs_as_ray_tasks_equal_runs_one_after_another(ppl_model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        600,
        "--policy",
        "h2o,sink",
        "--cache-size",
        "16,24",
        "--threads",
        1,
    ]
    run_to_end(ppl_command(*args, "--out", tmp_path / "alone", "--workers", 1))
    done = run_to_end(ppl_command(*args, "--out", tmp_path / "ray", "--ray", "local"))
    assert "4 runs as 4 Ray tasks of 1 CPU(s) each" in done.stderr
    assert_same_runs(tmp_path / "alone", tmp_path / "ray", 4)
    assert len(json.loads((tmp_path / "ray" / "summary.json").read_text())) == 4
    again = run_to_end(ppl_command(*args, "--out", tmp_path / "ray", "--workers", 1, "--resume"))
    assert again.stderr.count("already done") == 4  # finished runs are kept, whatever runs the sweep next


@pytest.fixture
def no_cluster_here(monkeypatch):
    """No Ray cluster runs on this machine, whatever does: `auto` finds one by its processes and by /tmp/ray, and
    would find another user's, or the one a previous test's `--ray local` is still shutting down."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "_find_address_from_flag", lambda flag: set())  # no raylet process found
    services.find_gcs_addresses.cache_clear()  # nor one remembered from an earlier look
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir=None: None)
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)  # ray.init sets its own, process-wide, even when it cannot connect


def test_an_unreachable_cluster_is_one_clear_error(ppl_model_dir, tmp_path, capsys, no_cluster_here):
    code, _, err = ppl(
        capsys,
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "c.jsonl"),
        "--tokens",
        100,
        "--cache-size",
        16,
        "--out",
        tmp_path / "o",
        "--ray",
        "auto",
    )
    assert code == 2 and "cannot reach a Ray cluster at 'auto'" in err, err
    assert err.count("Error") == 1 and not list((tmp_path / "o").glob("*.json"))


def test_a_signal_stops_the_tasks_at_a_checkpoint_and_resume_continues_exactly(ppl_model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        3000,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        4,
        "--span",
        4,
        "--checkpoint-every",
        40,
        "--threads",
        1,
    ]
    run_to_end(ppl_command(*args, "--out", tmp_path / "whole"))
    out = tmp_path / "out"
    process = subprocess.Popen(
        ppl_command(*args, "--out", out, "--ray", "local"),
        env=subprocess_env(**{WRITE_DELAY_ENV: "0.05"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (out / "h2o-16.ckpt").exists(), "the task's first checkpoint", process, timeout=240)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert not (out / "h2o-16.json").exists(), "the run finished before the signal"
    printed = shlex.split(stderr.strip().splitlines()[-1])
    assert printed[-1] == "--resume" and "--ray" in printed
    # the checkpoint a Ray task left resumes anywhere: here without Ray (each Ray start costs seconds of CPU)
    printed = printed[: printed.index("--ray")] + printed[printed.index("--ray") + 2 :]
    run_to_end([sys.executable, "-m", "h2o_stream", *printed[1:]])
    whole, resumed = (json.loads((tmp_path / d / "h2o-16.json").read_text()) for d in ("whole", "out"))
    assert resumed["nll_sum"] == whole["nll_sum"] and resumed["curve"] == whole["curve"]


@pytest.mark.parametrize(
    "address, message",
    [
        ("127.0.0.1:1", "cannot reach a Ray cluster at '127.0.0.1:1'"),
        ("ray://127.0.0.1:1", "cannot reach a Ray cluster at 'ray://127.0.0.1:1'"),
        ("http://127.0.0.1:8265", "is not a Ray address"),
        ("127.0.0.1", "is not a Ray address"),
        ("127.0.0.1:99999", "is not a Ray address"),
    ],
)
def test_a_bad_address_is_refused_in_seconds(address, message):
    from h2o_stream.apps.perplexity.ray_runs import check_address
    from h2o_stream.errors import H2OStreamError

    with pytest.raises(H2OStreamError, match=message):
        check_address(address)


def test_a_listening_port_passes_the_check():
    import socket

    from h2o_stream.apps.perplexity.ray_runs import check_address

    with socket.create_server(("127.0.0.1", 0)) as server:
        check_address(f"127.0.0.1:{server.getsockname()[1]}")
