"""`python -m eval split`: the heavy-hitter share chosen on one stream and reported on another, on a tiny model in a
results folder of its own: the commands it runs, the share it chooses (the lowest PPL, read back from the run files
here), the runs it leaves to the leaderboard, and the report and figure it writes."""

from __future__ import annotations

import json

import pytest

from eval.__main__ import main
from eval.split.run import SHARES
from support.ppl_helpers import ppl, result, write_corpus

TINY_RUN = ("--cache-size", 256, "--threads", 1, "--workers", 1, "--tokens", 700)


def suite(capsys, *argv) -> str:
    """`python -m eval ARGV` in this process; its stdout (fails the test on a non-zero exit)."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert done.value.code in (0, None), err
    return out


@pytest.fixture
def study(ppl_model_dir, tmp_path, capsys):
    """A results folder with a tiny 'smollm2' leaderboard (sink, h2o, h2o_sinks at 256) and its choosing runs."""
    corpus = write_corpus(tmp_path / "books.jsonl", books=4, text="Call me Ishmael. Some years ago, never mind. " * 40)
    results = tmp_path / "results"
    board = ("--model", ppl_model_dir, "--data", corpus, "--policy", "sink,h2o,h2o_sinks", *TINY_RUN)
    assert ppl(capsys, *board, "--out", results / "leaderboard" / "runs")[0] == 0
    shares = ",".join(map(str, SHARES))
    choose = results / "split" / "smollm2" / "choose"
    code, _, err = ppl(capsys, *board, "--heavy", shares, "--books", "1-3", "--book-tokens", 300, "--out", choose)
    assert code == 0, err
    return corpus, results


def test_choose_runs_every_share_of_both_policies_beside_sink_on_the_choosing_books(capsys):
    out = suite(capsys, "split", "choose", "--data", "books.jsonl", "--dry-run")
    assert out.splitlines() == [
        "h2o-stream ppl --data books.jsonl --cache-size 256 --policy sink,h2o,h2o_sinks --heavy 0,8,16,32,64,128 "
        "--books 1-20 --book-tokens 1000 --tokens 20000 --threads 1 --workers 2 --checkpoint-every 10000 --resume "
        "--out eval/results/split/smollm2/choose"
    ]


def test_the_chosen_share_is_the_lowest_ppl_and_is_reported_on_the_board_stream(study, ppl_model_dir, capsys):
    corpus, results = study
    choose = results / "split" / "smollm2" / "choose"
    lowest = {
        policy: min((result(choose, f"{policy}-256-heavy={h}")["ppl"], h) for h in SHARES)[1]
        for policy in ("h2o", "h2o_sinks")
    }
    defaults = {"h2o": 128, "h2o_sinks": 128}  # the board's runs: half the cache heavy
    out = suite(capsys, "split", "report", "--data", corpus, "--results", results, "--dry-run").splitlines()
    for policy, heavy in lowest.items():
        on_board = heavy == defaults[policy]
        assert f"{policy}: heavy={heavy} chosen" + (" (the board has it)" if on_board else "") in out
        command = [line for line in out if line.startswith("h2o-stream ppl") and f"--policy {policy} " in line]
        assert len(command) == (0 if on_board else 1), out
        if not on_board:
            assert f"--heavy {heavy} --tokens 700 " in command[0] and "split/smollm2/report" in command[0]
            # the printed run, on the tiny model (the suite's own would load the real one)
            report = results / "split" / "smollm2" / "report"
            code, _, err = ppl(capsys, "--model", ppl_model_dir, "--data", corpus, "--policy", policy,
                               "--heavy", heavy, *TINY_RUN, "--out", report)  # fmt: skip
            assert code == 0, err
    suite(capsys, "split", "figure", "--results", results)
    written = json.loads((results / "split" / "split.json").read_text())
    model = written["models"]["smollm2"]
    sink = result(choose, "sink-256")
    assert model["choose"]["sink_ppl"] == sink["ppl"]
    for policy, heavy in lowest.items():
        rows = model["choose"]["policies"][policy]
        assert [r["heavy"] for r in rows] == list(SHARES)
        for row in rows:
            assert row["vs_sink"] == pytest.approx(
                result(choose, f"{policy}-256-heavy={row['heavy']}")["ppl"] / sink["ppl"]
            )
        held = model["report"]["policies"][policy]
        board_sink = result(results / "leaderboard" / "runs", "sink-256")
        assert held["heavy"] == heavy and held["vs_sink"] == pytest.approx(held["ppl"] / board_sink["ppl"])
        half = result(results / "leaderboard" / "runs", f"{policy}-256")["ppl"]
        assert held["half_share_ppl"] == half and held["vs_half_share"] == pytest.approx(held["ppl"] / half)
    assert (results / "split" / "split.png").stat().st_size > 0


def test_report_and_figure_need_every_share_chosen_first(study, capsys):
    corpus, results = study
    (results / "split" / "smollm2" / "choose" / "h2o-256-heavy=16.json").unlink()
    with pytest.raises(SystemExit) as done:
        main(["split", "report", "--data", str(corpus), "--results", str(results), "--dry-run"])
    assert done.value.code == 2 and "h2o has 5 of its 6 shares: finish `choose` first" in capsys.readouterr().err


def test_a_share_chosen_on_another_corpus_is_not_reported_beside_the_board(study, ppl_model_dir, tmp_path, capsys):
    corpus, results = study
    choose = results / "split" / "smollm2" / "choose"
    other = write_corpus(tmp_path / "other.jsonl", books=4, text="It was a bright cold day in April. " * 60)
    for path in choose.glob("*"):
        path.unlink()
    code, _, err = ppl(capsys, "--model", ppl_model_dir, "--data", other, "--policy", "sink,h2o,h2o_sinks",
                       *TINY_RUN, "--heavy", ",".join(map(str, SHARES)), "--out", choose)  # fmt: skip
    assert code == 0, err
    for part in (["report", "--data", str(corpus), "--dry-run"], ["figure"]):
        with pytest.raises(SystemExit) as done:
            main(["split", *part, "--results", str(results)])
        assert done.value.code == 2 and "differ in data_sha256" in capsys.readouterr().err
    assert not (results / "split" / "split.json").exists()
