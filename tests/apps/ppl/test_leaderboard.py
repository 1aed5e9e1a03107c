"""`h2o-stream leaderboard`: every policy × cache size on one stream, resumable from its result files alone."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_stream.apps.perplexity.leaderboard import windowed
from h2o_stream.files import WRITE_DELAY_ENV
from support.ppl_helpers import command, ppl, run_to_end, subprocess_env, wait_for, write_corpus

POLICIES = "h2o,sink,tova,sepllm"


def leaderboard(capsys, *args) -> tuple[int, str, str]:
    return command(capsys, "leaderboard", *args)


@pytest.fixture
def board_args(tmp_path, ppl_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    return [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--policy",
        POLICIES,
        "--cache-size",
        "16,32",
        "--tokens",
        300,
        "--out",
        tmp_path / "board",
    ]


def test_leaderboard_ranks_every_policy_at_every_size_against_sink_and_h2o(capsys, tmp_path, board_args):
    code, stdout, stderr = leaderboard(capsys, *board_args)
    assert code == 0, stderr
    out = tmp_path / "board"
    board = json.loads((out / "leaderboard.json").read_text())
    assert sorted(board["sizes"]) == ["16", "32"]
    for size, entry in board["sizes"].items():
        rows = entry["rows"]
        assert sorted(r["policy"] for r in rows) == sorted(POLICIES.split(","))
        assert [r["ppl"] for r in rows] == sorted(r["ppl"] for r in rows) and entry["winner"] == rows[0]["policy"]
        by_policy = {r["policy"]: r for r in rows}
        for row in rows:
            run = json.loads((out / "runs" / f"{row['policy']}-{size}.json").read_text())
            assert row["ppl"] == run["ppl"] and row["tokens"] == run["predicted_tokens"] == 299
            assert row["vs_sink"] == pytest.approx(run["ppl"] / by_policy["sink"]["ppl"])
            assert row["vs_h2o"] == pytest.approx(run["ppl"] / by_policy["h2o"]["ppl"])
            assert row["max_keys_seen"] == int(size) + 1  # fair chunks, as exact mode
            default = {"sink": 256, "tova": 1}.get(row["policy"], int(size) // 16)  # tova, with no window: exact
            assert run["settings"]["chunk_size"] == default
    table = (out / "leaderboard.md").read_text()
    assert table == stdout and sum(line.startswith("|") for line in table.splitlines()) == 2 + 8
    corpus = board_args[board_args.index("--data") + 1]
    heading = table.split("\n| ")[0]
    assert f"## Leaderboard: {board_args[1]} on corpus.jsonl (local jsonl)" in heading
    assert f"sha256 {hashlib.sha256(Path(corpus).read_bytes()).hexdigest()[:12]}…" in heading
    assert "300 stream tokens per run, of which 299 predicted" in heading and "| predicted tokens |" in table
    assert f"Runs: 8, finished {datetime.datetime.now(datetime.timezone.utc).date()}" in heading
    assert (out / "ppl_vs_cache.png").stat().st_size > 0 and (out / "windowed_ppl.png").stat().st_size > 0


def test_the_same_command_keeps_finished_runs_even_without_their_checkpoints(capsys, tmp_path, board_args):
    """A fresh clone holds the result files but not the (git-ignored) checkpoints: nothing finished runs again."""
    assert leaderboard(capsys, *board_args)[0] == 0
    runs = tmp_path / "board" / "runs"
    results = {p.name: p.read_bytes() for p in runs.glob("*-*.json")}
    for checkpoint in runs.glob("*.ckpt"):
        checkpoint.unlink()
    (runs / "tova-32.json").unlink()  # one run unfinished on this machine
    code, _, stderr = leaderboard(capsys, *board_args)
    assert code == 0, stderr
    assert stderr.count("already done") == 7 and "== tova-32: tova" in stderr
    assert "runs on" not in stderr  # --workers auto: the one run left gets this process and all its cores
    again = {p.name: p.read_bytes() for p in runs.glob("*-*.json")}
    assert {k: v for k, v in again.items() if k != "tova-32.json"} == {
        k: v for k, v in results.items() if k != "tova-32.json"
    }
    assert json.loads(again["tova-32.json"])["nll_sum"] == json.loads(results["tova-32.json"])["nll_sum"]


def test_an_interrupted_leaderboard_prints_the_command_that_continues_it(tmp_path, ppl_model_dir):
    """The leaderboard always resumes, so the command it prints is the one given (it has no --resume option)."""
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "corpus.jsonl"),
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--tokens",
        3000,
        "--checkpoint-every",
        40,
        "--threads",
        1,
        "--out",
        tmp_path / "b",
    ]
    given = [sys.executable, "-m", "h2o_stream", "leaderboard", *map(str, args)]
    process = subprocess.Popen(
        given,
        env=subprocess_env(**{WRITE_DELAY_ENV: "0.05"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (tmp_path / "b" / "runs" / "h2o-16.ckpt").exists(), "the first checkpoint", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    printed = shlex.split(stderr.strip().splitlines()[-1])
    assert printed[1:] == given[3:] and "--resume" not in printed
    run_to_end([sys.executable, "-m", "h2o_stream", *printed[1:]])
    assert json.loads((tmp_path / "b" / "runs" / "h2o-16.json").read_text())["tokens_fed"] == 3000


def test_report_only_redraws_without_running_and_needs_runs(capsys, tmp_path, board_args):
    code, _, stderr = leaderboard(capsys, "--out", tmp_path / "empty", "--report-only")
    assert code == 2 and "holds no finished runs" in stderr
    assert leaderboard(capsys, *board_args)[0] == 0
    (tmp_path / "board" / "leaderboard.md").unlink()
    code, stdout, _ = leaderboard(capsys, "--out", tmp_path / "board", "--report-only")
    assert code == 0 and (tmp_path / "board" / "leaderboard.md").read_text() == stdout


def test_plots_of_one_cache_size_draw_bars_from_zero_and_keep_user_text_plain(
    capsys, tmp_path, ppl_model_dir, monkeypatch
):
    """A corpus named like a formula ('$\\frac$' would stop mathtext) is drawn as it is written; with one cache size
    the policies are bars on an axis from 0; the windows say how long they are; titles stay inside the image."""
    import h2o_stream.apps.perplexity.leaderboard as board_module
    import h2o_stream.apps.perplexity.report as report_module

    figures = {}

    def keep(save):
        def saving(fig, path):
            fig.canvas.draw()
            figures[Path(path).name] = fig
            return save(fig, path)

        return saving

    monkeypatch.setattr(board_module, "save_figure", keep(board_module.save_figure))
    monkeypatch.setattr(report_module, "save_figure", keep(report_module.save_figure))
    corpus = write_corpus(tmp_path / "books $\\frac$ of 1900.jsonl")
    out = tmp_path / "board"
    code, _, stderr = leaderboard(
        capsys,
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--policy",
        "h2o,sink",
        "--cache-size",
        16,
        "--tokens",
        2500,
        "--out",
        out,
    )  # 3 points a run: 2 windows
    assert code == 0, stderr
    assert {"ppl_vs_cache.png", "windowed_ppl.png", "ppl.png"} <= set(figures)
    for name, fig in figures.items():
        title = fig.get_suptitle()
        assert "books $\\frac$ of 1900.jsonl" in title.replace("\n", " "), name
        box, page = fig._suptitle.get_window_extent(), fig.bbox
        assert box.x0 >= 0 and box.x1 <= page.x1 and box.y1 <= page.y1, f"{name}: title clipped"
        assert (out / "runs" / name).is_file() or (out / name).is_file()
    bars = figures["ppl_vs_cache.png"].axes[0]
    assert len(bars.patches) == 2 and bars.get_ylim()[0] == 0
    assert sorted(tick.get_text() for tick in bars.get_xticklabels()) == ["h2o", "sink"]
    # curve points fall at forward ends (every 1,000 predicted tokens, rounded up to a forward of 256 tokens)
    assert figures["windowed_ppl.png"].axes[0].get_title() == "cache 16, windows of about 1,023 tokens"


def test_ppl_resume_keeps_a_finished_run_whose_checkpoint_is_gone(capsys, tmp_path, ppl_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--tokens",
        200,
        "--out",
        tmp_path / "out",
    ]
    assert ppl(capsys, *args)[0] == 0
    (tmp_path / "out" / "h2o-16.ckpt").unlink()
    before = (tmp_path / "out" / "h2o-16.json").read_bytes()
    code, _, stderr = ppl(capsys, *args, "--resume")
    assert code == 0 and "already done" in stderr
    assert (tmp_path / "out" / "h2o-16.json").read_bytes() == before
    code, _, stderr = ppl(capsys, *args[:-4], "--tokens", 300, "--out", tmp_path / "out", "--resume")
    assert code == 0 and "already done" not in stderr  # a longer run is no longer done: it runs (from the start)
    assert json.loads((tmp_path / "out" / "h2o-16.json").read_text())["tokens_fed"] == 300


def test_windowed_ppl_is_the_ppl_of_each_window_of_the_running_curve():
    nll = [1.0] * 100 + [3.0] * 100  # per-token NLL: the first half easier
    curve = [(n, math.exp(sum(nll[:n]) / n)) for n in range(10, 201, 10)]
    points = windowed(curve, windows=2)
    assert [n for n, _ in points] == [100, 200]
    assert points[0][1] == pytest.approx(math.e) and points[1][1] == pytest.approx(math.e**3)


def _curve(per_token_nll: list[float], every: int = 1000) -> list[tuple[int, float]]:
    """A running-PPL curve with a point every `every` predicted tokens, from per-window mean NLLs."""
    points, total = [], 0.0
    for i, nll in enumerate(per_token_nll, start=1):
        total += nll * every
        points.append((i * every, math.exp(total / (i * every))))
    return points


def test_a_ratio_interval_is_tight_for_a_steady_gap_wide_for_a_noisy_one_and_absent_on_a_short_stream():
    from h2o_stream.apps.perplexity.leaderboard import ratio_interval

    base_nll = [3.0 + 0.3 * ((i * 7) % 5) for i in range(100)]  # 100k tokens, windows of 1k that vary
    base = {"curve": _curve(base_nll)}
    same = ratio_interval({"curve": _curve(base_nll)}, base)
    assert same == pytest.approx([1.0, 1.0])
    steady = ratio_interval({"curve": _curve([n + 0.1 for n in base_nll])}, base)  # exp(0.1) worse everywhere
    assert steady == pytest.approx([math.exp(0.1)] * 2, rel=1e-9)
    noisy = ratio_interval(
        {"curve": _curve([n + (0.5 if i % 20 < 10 else -0.3) for i, n in enumerate(base_nll)])}, base
    )
    assert noisy[0] < math.exp(0.1) < noisy[1] and noisy[1] - noisy[0] > 0.05
    assert ratio_interval({"curve": _curve(base_nll[:40])}, {"curve": _curve(base_nll[:40])}) is None  # 4 windows
    assert ratio_interval({"curve": _curve(base_nll)}, base) == same  # seeded: the same runs, the same interval
