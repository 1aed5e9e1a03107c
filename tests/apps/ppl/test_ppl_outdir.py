"""The --out directory: one run at a time, checked to take files before the model loads, a full disk keeps the last good
checkpoint, and the reports cover every run in it without overwriting another call's files unasked."""

from __future__ import annotations

import errno
import json
import os

import pytest

import h2o_stream.files
from h2o_stream.apps.perplexity.outdir import claim
from support.ppl_helpers import ppl, ppl_error, result, snapshot, write_corpus
from support.read_only import read_only_directory


@pytest.fixture
def base(ppl_model_dir, tmp_path):
    """Arguments of a short h2o run, without --out."""
    return [
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "corpus.jsonl"),
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--tokens",
        300,
    ]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the command gets as far as loading the model."""
    import h2o_stream.loading.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(h2o_stream.loading.models, "load_model", refuse)


# -- one run per --out ----------------------------------------------------------------------------------


def test_a_second_run_into_a_held_directory_names_the_holder(base, tmp_path, capsys, no_model_load):
    out = tmp_path / "out"
    with claim(out):  # another run holds it (a second open of the lock file conflicts like another process)
        message = ppl_error(capsys, *base, "--out", out)
    assert f"is in use by another h2o-stream ppl run (pid {os.getpid()})" in message


def test_the_lock_is_released_after_a_run(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert ppl(capsys, *base, "--out", out)[0] == 0
    with claim(out):
        pass


# -- an unusable --out fails before the model loads; a full disk keeps the last good checkpoint ----------


def test_a_read_only_out_fails_before_the_model_loads(base, tmp_path, capsys, no_model_load):
    out, reason = read_only_directory(tmp_path)  # one that refuses root too: the tests run as root in CI
    message = ppl_error(capsys, *base, "--out", out)
    assert f"cannot write into --out {out} ({reason})" in message


@pytest.mark.parametrize("where, message", [("file.txt", "is a file"), ("file.txt/out", "which is a file")])
def test_an_out_at_or_under_a_file_fails_before_the_model_loads(base, tmp_path, capsys, no_model_load, where, message):
    (tmp_path / "file.txt").write_text("not a directory")
    assert message in ppl_error(capsys, *base, "--out", tmp_path / where)


def test_a_full_disk_keeps_the_last_good_checkpoint_and_leaves_no_partial_file(base, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert ppl(capsys, *base, "--out", out, "--checkpoint-every", 64)[0] == 0
    before = snapshot(out)

    def disk_full(file, body):
        file.write(body[: len(body) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(h2o_stream.files, "_write_body", disk_full)
    message = ppl_error(capsys, *base[:-1], 600, "--out", out, "--checkpoint-every", 64, "--resume")
    assert "No space left on device (the disk is full)" in message
    assert "the last good checkpoint, at token 256, is kept" in message and "no partial file is left" in message
    assert snapshot(out) == before  # the checkpoint and the 300-token result untouched, no temporary file

    monkeypatch.undo()
    assert ppl(capsys, *base[:-1], 600, "--out", out, "--checkpoint-every", 64, "--resume")[0] == 0
    assert result(out, "h2o-16")["tokens_fed"] == 600


# -- reports cover every run in --out and never silently replace another call's ---------------------------


def test_reports_cover_every_run_in_the_directory(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert ppl(capsys, *base, "--out", out)[0] == 0
    code, table, _ = ppl(capsys, *[("sink" if a == "h2o" else a) for a in base], "--out", out, "--resume")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["settings"]["policy"] for r in summary) == ["h2o", "sink"]
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["h2o", "sink"]


@pytest.mark.parametrize("report", ["ppl.png", "summary.json"])
def test_an_existing_report_is_not_overwritten_without_resume(base, tmp_path, capsys, no_model_load, report):
    out = tmp_path / "out"
    out.mkdir()
    (out / report).write_bytes(b"someone's earlier report")
    assert "--resume" in ppl_error(capsys, *base, "--out", out)
    assert (out / report).read_bytes() == b"someone's earlier report"


def test_a_claim_that_fails_before_writing_removes_what_it_made_and_keeps_what_was_written(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError), claim(out):
        raise RuntimeError("refused")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError), claim(out) as held:
        (held / "run.ckpt").write_text("work")
        raise RuntimeError("failed later")
    assert (out / "run.ckpt").read_text() == "work"
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError), claim(existing):
        raise RuntimeError("refused")
    assert existing.is_dir() and not list(existing.iterdir())
