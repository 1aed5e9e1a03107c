"""Sweeping a budget part (`--heavy 0,16,...`: one run per value, named by it) and choosing what sliding-window layers
keep (`--sliding-layers`), through `h2o-stream ppl` and `h2o-stream leaderboard` on tiny models."""

from __future__ import annotations

import json

import pytest

from h2o_stream.apps.perplexity.leaderboard import leaderboard
from h2o_stream.apps.perplexity.report import results_in, run_label
from h2o_stream.apps.perplexity.sweep import run_specs
from support.ppl_helpers import command, ppl, ppl_error, result, snapshot, write_corpus
from support.tiny_models import save_tiny_model_dir


def test_a_part_given_several_values_is_swept_one_named_run_each():
    specs = run_specs(["h2o", "sink"], [32, 64], {"heavy": [0, 8], "sinks": [2]})
    names = [name for name, _ in specs]
    assert names == ["h2o-32-heavy=0", "h2o-32-heavy=8", "h2o-64-heavy=0", "h2o-64-heavy=8", "sink-32", "sink-64"]
    policies = dict(specs)
    assert (policies["h2o-64-heavy=8"].heavy, policies["h2o-64-heavy=8"].recent) == (8, 56)
    assert (policies["h2o-32-heavy=0"].heavy, policies["h2o-32-heavy=0"].recent) == (0, 32)
    assert policies["sink-32"].sinks == 2  # a list of one value is that value, not a sweep


def test_two_swept_parts_make_every_combination_named_in_the_order_given():
    names = [name for name, _ in run_specs(["h2o_sinks"], [32], {"heavy": [4, 8], "sinks": [1, 2]})]
    assert names == [
        "h2o_sinks-32-heavy=4-sinks=1",
        "h2o_sinks-32-heavy=4-sinks=2",
        "h2o_sinks-32-heavy=8-sinks=1",
        "h2o_sinks-32-heavy=8-sinks=2",
    ]


def test_ppl_sweeps_a_part_and_the_reports_name_each_value(tmp_path, capsys, ppl_model_dir):
    data, out = write_corpus(tmp_path / "books.jsonl"), tmp_path / "out"
    code, stdout, stderr = ppl(
        capsys,
        "--model",
        ppl_model_dir,
        "--data",
        data,
        "--policy",
        "h2o,sink",
        "--heavy",
        "0,4",
        "--cache-size",
        16,
        "--tokens",
        300,
        "--out",
        out,
        "--workers",
        1,
    )
    assert code == 0, stderr
    assert sorted(p.name for p in out.glob("*.json")) == [
        "h2o-16-heavy=0.json",
        "h2o-16-heavy=4.json",
        "sink-16.json",
        "summary.json",
    ]
    swept = result(out, "h2o-16-heavy=4")
    assert swept["run"] == "h2o-16-heavy=4" and (swept["settings"]["heavy"], swept["settings"]["recent"]) == (4, 12)
    assert result(out, "h2o-16-heavy=0")["nll_sum"] != swept["nll_sum"]
    labels = sorted(run_label(r) for r in results_in(out))
    assert labels == ["h2o heavy=0", "h2o heavy=4", "sink"]


def test_a_bad_value_in_a_swept_part_is_one_error_before_any_work(tmp_path, capsys, ppl_model_dir):
    data, out = write_corpus(tmp_path / "books.jsonl"), tmp_path / "out"
    assert "--heavy must be a comma-separated list of whole numbers" in ppl_error(
        capsys, "--model", ppl_model_dir, "--data", data, "--policy", "h2o", "--heavy", "4,x", "--out", out
    )
    assert "heavy" in ppl_error(
        capsys,
        "--model",
        ppl_model_dir,
        "--data",
        data,
        "--policy",
        "h2o",
        "--heavy",
        "4,99",
        "--cache-size",
        16,
        "--out",
        out,
    )
    assert not out.exists() or not any(out.glob("*.json"))


def test_the_leaderboard_compares_against_the_baselines_own_split_never_a_swept_run(tmp_path, capsys, ppl_model_dir):
    data, out = write_corpus(tmp_path / "books.jsonl"), tmp_path / "board"
    code, stdout, stderr = command(
        capsys,
        "leaderboard",
        "--model",
        ppl_model_dir,
        "--data",
        data,
        "--policy",
        "h2o,sink",
        "--heavy",
        "2,6",
        "--cache-size",
        16,
        "--tokens",
        300,
        "--out",
        out,
        "--workers",
        1,
    )
    assert code == 0, stderr
    board = json.loads((out / "leaderboard.json").read_text())
    rows = {row["policy"]: row for row in board["sizes"]["16"]["rows"]}
    assert set(rows) == {"h2o heavy=2", "h2o heavy=6", "sink"}
    sink = rows["sink"]["ppl"]
    for name in ("h2o heavy=2", "h2o heavy=6"):
        assert rows[name]["vs_sink"] == pytest.approx(rows[name]["ppl"] / sink)
        assert rows[name]["vs_h2o"] is None  # no h2o run at its own split here: no baseline to divide by
    assert "| 16 | h2o heavy=2 |" in (out / "leaderboard.md").read_text()


def test_leaderboard_rows_keep_the_plain_policy_name_without_a_sweep():
    base = {
        "settings": {"policy": "h2o", "heavy": 8, "recent": 8, "chunk_size": 1},
        "ppl": 10.0,
        "predicted_tokens": 9,
        "tokens_per_second": 1.0,
        "stream_sha256": "0" * 64,
        "curve": [],
    }
    board = leaderboard([base, {**base, "run": "h2o-16-heavy=4", "ppl": 11.0}])
    rows = board["sizes"][16]["rows"]
    assert [row["policy"] for row in rows] == ["h2o", "h2o heavy=4"]
    assert rows[1]["vs_h2o"] == pytest.approx(1.1)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny Gemma 3 (two sliding layers with a window of 8 around a global one) with a character tokenizer."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3_text", init_std=0.2)


def test_sliding_layers_keep_their_window_or_run_the_policy_as_asked(tmp_path, capsys, gemma_dir):
    data = write_corpus(tmp_path / "books.jsonl")
    runs = {}
    for mode in ("window", "policy"):
        out = tmp_path / mode
        code, _, stderr = ppl(
            capsys,
            "--model",
            gemma_dir,
            "--data",
            data,
            "--policy",
            "h2o",
            "--cache-size",
            4,
            "--tokens",
            200,
            "--out",
            out,
            "--workers",
            1,
            "--sliding-layers",
            mode,
        )
        assert code == 0, stderr
        runs[mode] = result(out, "h2o-4")
    # the default is recorded by its absence (results from before the choice existed read the same)
    assert "sliding_layers" not in runs["window"]["settings"]
    assert runs["policy"]["settings"]["sliding_layers"] == "policy"
    # policy mode: the sliding layers hold the budget of 4, not their window of 7
    assert runs["policy"]["kv_entries"] < runs["window"]["kv_entries"]
    assert runs["policy"]["nll_sum"] != runs["window"]["nll_sum"]


def test_a_run_of_the_other_sliding_mode_is_refused_in_the_same_out(tmp_path, capsys, gemma_dir):
    data, out = write_corpus(tmp_path / "books.jsonl"), tmp_path / "out"
    args = [
        "--model",
        gemma_dir,
        "--data",
        data,
        "--policy",
        "h2o",
        "--cache-size",
        4,
        "--tokens",
        200,
        "--out",
        out,
        "--workers",
        1,
    ]
    assert ppl(capsys, *args)[0] == 0
    before = snapshot(out)
    error = ppl_error(capsys, *args, "--sliding-layers", "policy", "--resume")
    assert "sliding_layers" in error
    assert snapshot(out) == before
    assert "'window', 'policy'" in ppl_error(capsys, *args, "--sliding-layers", "every")
