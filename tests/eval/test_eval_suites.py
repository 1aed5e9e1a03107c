"""The eval suites (`python -m eval ...`) other than speed (test_eval_speed.py): quality and long regenerate their
committed numbers from the committed runs; needle, soak, serve and attention keep their schemas; no result records
an absolute path; a bad input is one error line; every registered suite is a command, listed with its summary."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import click
import pytest

from eval.__main__ import SUITES, cli, main
from eval.common import CORPUS, corpus_record, scrub_command
from support.eval_results import ABSOLUTE, REPO, RESULTS, RUN_FILES, committed, shape, strings, suite, written_json


@pytest.mark.parametrize(
    "name, runs", [("gap.json", "runs"), ("gap_h2o_60k.json", "runs/h2o-60k"), ("gap_tova_60k.json", "runs/tova-60k")]
)
def test_quality_gap_regenerates_the_committed_gaps_from_the_runs(tmp_path, name, runs):
    out = tmp_path / name
    folder = RESULTS / "quality" / runs
    suite(
        "quality",
        "gap",
        "--exact-dir",
        str(folder / "exact"),
        "--chunked-dir",
        str(folder / "chunked"),
        "--out",
        str(out),
    )
    written, kept = written_json(out), committed(f"quality/{name}")
    assert written["gap"] == kept["gap"]
    assert shape(written) == shape(kept)


@pytest.mark.parametrize("folder, window", [("long_4m", 200_000), ("long_fair", 100_000)])
def test_long_report_regenerates_the_committed_report(tmp_path, folder, window):
    copy = tmp_path / folder
    shutil.copytree(RESULTS / folder, copy, ignore=shutil.ignore_patterns("*.png", "*.ckpt", "report.json"))
    suite("long", "report", str(copy), "--window", str(window))
    written, kept = written_json(copy / "report.json"), committed(f"{folder}/report.json")
    assert {k: v for k, v in written.items() if k != "command"} == {k: v for k, v in kept.items() if k != "command"}
    assert (copy / "figure5.png").is_file()


@pytest.mark.parametrize("folder", ["long_4m", "long_fair"])
def test_a_reported_long_run_folder_takes_more_runs(folder):
    from h2o_stream.apps.perplexity.report import results_in, run_name

    runs = sorted(p.name for p in (RESULTS / folder).glob("*.json") if p.name != "report.json")
    assert (RESULTS / folder / "report.json").is_file()
    assert sorted(f"{run_name(r)}.json" for r in results_in(RESULTS / folder)) == runs


def test_the_run_commands_are_printed_with_dry_run(capsys):
    suite("long", "4m", "--data", "books.jsonl", "--dry-run")
    suite("quality", "runs", "--data", "books.jsonl", "--only", "tova-60k/exact", "--dry-run")
    suite("leaderboard", "--data", "books.jsonl", "--dry-run")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "h2o-stream ppl --data books.jsonl --cache-size 256 --policy sink,h2o --tokens 4000000 --threads 1 --workers 2 "
        "--resume --out eval/results/long_4m",
        "h2o-stream ppl --data books.jsonl --policy tova --exact --tokens 60000 --cache-size 256 --threads 1 --resume "
        "--out eval/results/quality/runs/tova-60k/exact",
        "h2o-stream leaderboard --data books.jsonl --tokens 250000 --workers 2 --out eval/results/leaderboard",
    ]


def test_needle_keeps_its_schema(model_dir, tmp_path):
    out = tmp_path / "needle"
    suite(
        "needle",
        "--model",
        str(model_dir),
        "--cache-size",
        "96",
        "--lengths",
        "256",
        "--depths",
        "0,1",
        "--trials",
        "1",
        "--policies",
        "sink,truncation",
        "--out",
        str(out),
    )
    written, kept = written_json(out.with_suffix(".json")), committed("needle/policies.json")
    assert written.keys() == kept.keys()
    assert written["settings"].keys() == kept["settings"].keys()
    assert shape(written["settings"]["data"]) == shape(kept["settings"]["data"])
    assert written["results"][0].keys() <= kept["results"][0].keys() | {"skipped"}
    assert out.with_suffix(".png").is_file()


def test_needle_runs_head_hybrid_with_its_classification_and_records_it(model_dir, tmp_path):
    out = tmp_path / "needle"
    suite(
        "needle",
        *("--model", str(model_dir), "--cache-size", "96", "--lengths", "256", "--depths", "1", "--trials", "1"),
        *("--policies", "head_hybrid", "--retrieval-heads", "*.0", "--out", str(out)),
    )
    written = written_json(out.with_suffix(".json"))
    assert written["settings"]["retrieval_heads"] == "*.0"
    assert {row["variant"] for row in written["results"]} == {"head_hybrid"}


def test_soak_chat_and_defaults_keep_their_schemas(model_dir, tmp_path):
    suite(
        "soak",
        "chat",
        "--model",
        str(model_dir),
        "--turns",
        "11",
        "--min-tokens",
        "0",
        "--max-new-tokens",
        "2",
        "--books",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "chat_soak.json"),
    )
    written, kept = written_json(tmp_path / "chat_soak.json"), committed("soak/chat_soak.json")
    assert written["summary"].keys() == kept["summary"].keys()
    assert written["series"].keys() == kept["series"].keys()
    assert written["settings"]["data"]["name"] == "sample"
    suite(
        "soak",
        "defaults",
        "--model",
        str(model_dir),
        "--books",
        "Pride and Prejudice",
        "--chars",
        "2000",
        "--max-new-tokens",
        "4",
        "--chat-turns",
        "1",
        "--out",
        str(tmp_path / "generation_defaults.json"),
    )
    written = written_json(tmp_path / "generation_defaults.json")
    kept = committed("soak/generation_defaults.json")
    assert written.keys() == kept.keys() and written["settings"].keys() == kept["settings"].keys()
    assert shape(written["summaries"][0]) == shape(kept["summaries"][0])


def test_serve_load_keeps_its_schema_and_refuses_a_memory_bound_that_bounds_nothing(model_dir, tmp_path):
    suite(
        "serve",
        "--model",
        str(model_dir),
        "--conversations",
        "2",
        "--turns",
        "2",
        "--in-memory",
        "1",
        "--max-tokens",
        "2",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "load.json"),
    )
    written, kept = written_json(tmp_path / "load.json"), committed("serve/load.json")
    assert shape(written, frozenset({"passed"})).keys() == shape(kept).keys()
    assert written["settings"].keys() == kept["settings"].keys() and written["rss"].keys() == kept["rss"].keys()
    assert shape(written["per_request"][0]) == shape(kept["per_request"][0])
    assert written["requests"] == 4 and written["failed"] == 0 and written["recognised"] == 2
    assert (tmp_path / "load.png").is_file()
    with pytest.raises(SystemExit) as done:
        main(["serve", "--conversations", "4", "--in-memory", "4", "--out", str(tmp_path / "no.json")])
    assert done.value.code == 2 and not (tmp_path / "no.json").exists()


def test_no_committed_result_records_an_absolute_path_or_one_outside_the_repository():
    hits = []
    for path in sorted(RESULTS.rglob("*.json")):
        if any(path.relative_to(RESULTS).as_posix().startswith(folder + "/") for folder in RUN_FILES):
            continue
        hits += [
            f"{path.relative_to(RESULTS)}: {s[:120]}"
            for s in strings(json.loads(path.read_text()))
            if ABSOLUTE.search(s) or "../" in s
        ]
    assert not hits, "\n".join(hits)


def test_a_command_line_records_the_corpus_by_name_and_paths_relative(tmp_path):
    corpus = tmp_path / "books.jsonl"
    command = scrub_command(f"python -m eval speed fair --data {corpus} --out-dir {tmp_path / 'out'}")
    assert command.startswith(f"python -m eval speed fair --data {CORPUS} --out-dir ")
    assert not re.search(r"(^|\s)/", command) and command.endswith(os.path.relpath(tmp_path / "out"))
    assert scrub_command("h2o-stream ppl --data=sample") == "h2o-stream ppl --data=sample"
    record = corpus_record("sample")
    assert record["name"] == "sample" and record["bytes"] > 0 and len(record["sha256"]) == 64


def test_device_check_runs_as_a_script():
    done = subprocess.run([sys.executable, "eval/device_check.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--device" in done.stdout


def test_every_registered_suite_is_a_command_listed_with_its_summary(capsys):
    for name, registered in SUITES.items():
        command = cli.get_command(click.Context(cli), name)
        assert isinstance(command, click.Command), name
        assert command.short_help == registered.summary
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    for name, registered in SUITES.items():
        assert re.search(rf"^  {name} +{re.escape(registered.summary[:40])}", listed, re.M), name


def test_a_bad_input_is_one_error_line_and_exit_status_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as done:
        main(
            [
                "quality",
                "gap",
                "--exact-dir",
                str(empty),
                "--chunked-dir",
                str(empty),
                "--out",
                str(tmp_path / "gap.json"),
            ]
        )
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"Error: no policy has a run in both {empty} and {empty}"]
    assert not (tmp_path / "gap.json").exists()


@pytest.mark.parametrize("command", [["speed", "fair", "--policies", "sink"], ["profile", "--policies", "sink"]])
def test_a_bad_input_the_library_finds_inside_a_suite_is_one_error_line(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--model", str(tmp_path / "missing")])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"Error: model not found: {tmp_path / 'missing'}"]


def test_quality_runs_refuses_a_folder_it_has_no_runs_for(capsys):
    """A folder named by half (h2o-60k for h2o-60k/exact) would otherwise run nothing and say nothing."""
    with pytest.raises(SystemExit) as done:
        main(["quality", "runs", "--data", "books.jsonl", "--only", "h2o-60k,exact", "--dry-run"])
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "Error: --only: no runs folder h2o-60k (the folders: exact, chunked, chunked-c64, chunked-c16, chunked-c8, "
        "h2o-60k/exact, h2o-60k/chunked, tova-60k/exact, tova-60k/chunked)"
    ]
    assert "h2o-stream ppl" not in captured.out  # not even the folder it knows: nothing runs


@pytest.mark.parametrize("command", [["needle"], ["speed", "fair"]])
def test_head_hybrid_in_a_suite_without_its_classification_is_one_error_line(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--policies", "sink,head_hybrid", "--model", str(tmp_path / "never-loaded")])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "Error: head_hybrid needs --retrieval-heads (a head classification file from h2o-stream calibrate)"
    ]


def test_attention_by_distance_splits_every_layers_mass_and_refuses_a_window_too_short(tiny, tmp_path):
    suite(
        "attention",
        "--model",
        tiny,
        "--windows",
        "2",
        "--length",
        "40",
        "--sinks",
        "2",
        "--recent",
        "8",
        "--out",
        str(tmp_path / "att"),
    )
    written = written_json(tmp_path / "att.json")
    (run,) = written["models"].values()
    assert len(run["layers"]) == 2
    for layer in run["layers"]:  # every query's attention is a distribution over the three groups
        # float32 probabilities
        assert layer["sinks"] + layer["recent"] + layer["older"] == pytest.approx(1.0, abs=1e-6)
        assert min(layer["sinks"], layer["recent"], layer["older"]) > 0
    assert sum(run["by_distance"].values()) == pytest.approx(1.0, abs=1e-6)  # float32 probabilities
    assert (tmp_path / "att.png").is_file()
    kept = committed("models/attention_by_distance.json")
    assert shape(written, frozenset({"models", "by_distance"})).keys() == shape(kept).keys()
    with pytest.raises(SystemExit) as done:
        main(
            [
                "attention",
                "--model",
                tiny,
                "--length",
                "10",
                "--sinks",
                "2",
                "--recent",
                "8",
                "--out",
                str(tmp_path / "no"),
            ]
        )
    assert done.value.code == 2 and not (tmp_path / "no.json").exists()
