"""`h2o-stream calibrate`: the head classification head_hybrid reads, measured on held-out text; refused settings,
files and models, each with one error and exit status 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h2o_stream.apps.calibrate import classify, older_mass
from h2o_stream.cli.leaderboard import BOUNDED
from support.ppl_helpers import command, ppl, ppl_error, result, write_corpus
from support.tiny_models import random_ids, save_tiny_model_dir, tiny_model

SETTINGS = ["--cache-size", 16, "--windows", 2, "--length", 48]


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


def calibrate(capsys, model_dir, corpus, out, *extra) -> tuple[int, str, str]:
    return command(capsys, "calibrate", "--model", model_dir, "--data", corpus, *SETTINGS, "--out", out, *extra)


def test_calibrate_writes_the_heads_with_most_attention_beyond_the_window_and_ppl_runs_them(
    ppl_model_dir, corpus, tmp_path, capsys
):
    out = tmp_path / "heads.json"
    code, stdout, stderr = calibrate(capsys, ppl_model_dir, corpus, out, "--retrieval-share", 0.25)
    assert code == 0, stderr
    heads = json.loads(out.read_text())
    masses = heads["older_mass"]  # per layer, per KV head: the tiny llama has 2 of each
    assert [len(layer) for layer in masses] == [2, 2] and all(0 < m < 1 for layer in masses for m in layer)
    top = max(((layer, head) for layer in range(2) for head in range(2)), key=lambda p: masses[p[0]][p[1]])
    assert heads["retrieval_heads"] == f"{top[0]}.{top[1]}"  # a quarter of 4 heads: the one reading furthest
    assert heads["model_signature"] == "llama: 2 layers x 2 KV heads x 16" and heads["data"]["sha256"]
    assert f"1 of 4 KV heads retrieval ({heads['retrieval_heads']})" in stdout

    args = ["--model", ppl_model_dir, "--data", corpus, "--tokens", 80, "--cache-size", 16, "--out", tmp_path / "o"]
    code, _, stderr = ppl(capsys, *args, "--policy", "head_hybrid", "--retrieval-heads", out)
    assert code == 0, stderr
    settings = result(tmp_path / "o", "head_hybrid-16")["settings"]
    assert settings["retrieval_heads"] == heads["retrieval_heads"]  # the classes, not the file's path
    assert settings["calibrated_for"] == heads["model_signature"]


def test_older_mass_is_the_attention_a_streaming_head_would_not_see():
    """Against the model's attentions summed key by key: a query at q sees the first `sinks` keys and keys
    q - (cache - sinks) .. q as a streaming head; the rest, averaged over queries >= cache and query heads."""
    model = tiny_model("llama", init_std=0.2)  # 4 query heads over 2 KV heads
    ids = random_ids(40, seed=3)
    cache, sinks = 12, 2
    measured = older_mass(model, ids, cache, sinks)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    for layer, probs in enumerate(attentions):
        for kv_head in range(2):
            total = 0.0
            for q_head in (2 * kv_head, 2 * kv_head + 1):
                for q in range(cache, 40):
                    total += sum(float(probs[0, q_head, q, k]) for k in range(sinks, q - (cache - sinks)))
            assert measured[layer][kv_head] == pytest.approx(total / (2 * (40 - cache)), rel=1e-9)


def test_classify_takes_a_share_of_the_policy_layers_heads():
    masses = [[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]]
    assert classify(masses, [0, 1, 2], 0.5) == "0.0,1.0,2.1"  # of equal masses the lower head
    assert classify(masses, [1, 2], 0.25) == "2.1"  # layer 0 does not run the policy (a sliding layer)
    assert classify(masses, [0, 1, 2], 0.01) == "0.0" and classify(masses, [0, 1, 2], 0) == "none"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sinks", 16], "--sinks (16) must be at least 0 and below --cache-size (16)"),
        (["--length", 16], "--length (16) must exceed --cache-size (16)"),
        (["--retrieval-share", 1.5], "--retrieval-share must lie in [0, 1], got 1.5"),
        (["--windows", 0], "--windows must be at least 1"),
        (["--windows", 1000], "fewer than --windows x --length (1000 x 48 = 48,000)"),
    ],
)
def test_bad_settings_are_refused_and_write_nothing(ppl_model_dir, corpus, tmp_path, capsys, extra, message):
    code, _, stderr = calibrate(capsys, ppl_model_dir, corpus, tmp_path / "heads.json", *extra)
    assert code == 2 and message in stderr and "Traceback" not in stderr, stderr
    assert not list(tmp_path.glob("heads.json*"))


def test_an_existing_file_is_kept_unless_forced(ppl_model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "heads.json"
    out.write_text("mine")
    code, _, stderr = calibrate(capsys, ppl_model_dir, corpus, out)
    assert code == 2 and "exists; choose another --out or pass --force" in stderr
    assert out.read_text() == "mine"
    code, _, stderr = calibrate(capsys, ppl_model_dir, corpus, out, "--force")
    assert code == 0, stderr
    assert json.loads(out.read_text())["kind"] == "h2o-stream head classification"


def test_a_classification_of_another_model_or_no_classification_is_refused(ppl_model_dir, corpus, tmp_path, capsys):
    other = save_tiny_model_dir(tmp_path / "other", num_key_value_heads=1, init_std=0.2)
    heads = tmp_path / "heads.json"
    assert calibrate(capsys, other, corpus, heads)[0] == 0
    out = tmp_path / "o"
    args = ["--model", ppl_model_dir, "--data", corpus, "--tokens", 80, "--cache-size", 16, "--out", out]
    error = ppl_error(capsys, *args, "--policy", "head_hybrid", "--retrieval-heads", heads)
    assert "made on another model (llama: 2 layers x 1 KV heads x 16), not this one (llama: 2 layers x 2" in error
    not_heads = tmp_path / "not_heads.json"
    not_heads.write_text(json.dumps({"kind": "something else"}))
    error = ppl_error(capsys, *args, "--policy", "head_hybrid", "--retrieval-heads", not_heads)
    assert "is not a head classification file" in error
    error = ppl_error(capsys, *args, "--policy", "head_hybrid")
    assert "--retrieval-heads must be given" in error
    assert not list(out.glob("*.json"))  # no run started (its lock file aside)


def test_the_leaderboard_runs_head_hybrid_only_when_named():
    assert "head_hybrid" not in BOUNDED.split(",") and "h2o_sinks" in BOUNDED.split(",")


def test_eval_calibration_runs_what_is_missing_and_draws_the_committed_files(tmp_path, monkeypatch, capsys):
    import shutil

    import eval.calibration.run as suite
    from eval.__main__ import main as eval_main

    committed = Path(__file__).resolve().parents[3] / suite.OUT  # (tests run in a temporary directory)
    shutil.copy(committed / "smollm2-256.json", tmp_path / "smollm2-256.json")
    monkeypatch.setattr(suite, "OUT", tmp_path)
    with pytest.raises(SystemExit) as done:
        eval_main(["calibration", "run", "--data", "books.jsonl", "--dry-run"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("--cache-size ")[1].split()[0] for line in lines] == ["128", "512"]  # 256 is there
    assert lines[0].startswith("h2o-stream calibrate --data books.jsonl --books 1-20 --cache-size 128")
    monkeypatch.setattr(suite, "OUT", committed)
    with pytest.raises(SystemExit) as done:
        eval_main(["calibration", "figure", "--out", str(tmp_path / "figure.png")])
    assert done.value.code == 0 and (tmp_path / "figure.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "out, says",
    [
        ("missing/dir/heads.json", "the folder"),
        ("/proc/heads.json", "no file can be created in /proc"),
    ],
    ids=["missing-folder", "unwritable-folder"],
)
def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, corpus, capsys, out, says):
    target = tmp_path / out if not out.startswith("/") else out
    code, _, stderr = calibrate(capsys, tmp_path / "no-such-model", corpus, target)  # a model that would fail to load
    last = stderr.strip().splitlines()[-1]
    assert code == 2 and last.startswith("Error: cannot write --out") and says in last, stderr
    assert "Traceback" not in stderr and "loading " not in stderr
    assert not (tmp_path / "missing").exists()
