"""Verified files (h2o_stream.files): what ppl checkpoints are, and what every file the tool reads back should be.
A crafted file never runs code, a flipped or missing byte is a clear error, and so is a file of another kind."""

from __future__ import annotations

import io

import pytest
import torch

from h2o_stream.apps.perplexity.run import CHECKPOINT_KIND, CHECKPOINT_VERSION
from h2o_stream.files import MAGIC, UnverifiedFile, read_verified, remove_partials, write_verified
from support.crafted_files import KIND, crafted_body, with_header
from support.ppl_helpers import ppl, ppl_error, snapshot, write_corpus


def test_the_crafted_payload_really_runs_code_when_loaded_unsafely(tmp_path):
    """The premise of the tests below: without weights_only, loading the crafted body runs its code."""
    marker = tmp_path / "marker"
    torch.load(io.BytesIO(crafted_body(marker)), weights_only=False)
    assert marker.read_text() == "code ran"


def test_round_trip_of_plain_data(tmp_path):
    data = {
        "a": torch.arange(5),
        "b": [1, 2.5, "x", None, (3, 4.0)],
        "c": {"d": torch.zeros(2, dtype=torch.float64)},
        "e": True,
    }
    write_verified(tmp_path / "f", KIND, 3, data)
    back = read_verified(tmp_path / "f", KIND, 3)
    assert torch.equal(back["a"], data["a"]) and back["b"] == data["b"] and back["e"] is True
    assert back["c"]["d"].dtype == torch.float64
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temporary file left


@pytest.mark.parametrize("framed", [False, True])
def test_a_crafted_file_never_runs_code(tmp_path, framed):
    marker = tmp_path / "marker"
    path = tmp_path / "f"
    body = crafted_body(marker)
    path.write_bytes(with_header(body) if framed else body)
    with pytest.raises(UnverifiedFile, match="plain data" if framed else "not a file written by h2o-stream"):
        read_verified(path, KIND, 1)
    assert not marker.exists()


def test_every_damage_is_a_clear_error(tmp_path):
    path = tmp_path / "f"
    write_verified(path, KIND, 1, {"x": torch.arange(1000)})
    good = path.read_bytes()
    header_end = good.index(b"\n", len(MAGIC)) + 1
    for offset in (header_end, header_end + 100, len(good) // 2, len(good) - 1):  # a flipped byte in the body
        flipped = bytearray(good)
        flipped[offset] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(UnverifiedFile, match="do not match their checksum"):
            read_verified(path, KIND, 1)
    path.write_bytes(good[:-10])
    with pytest.raises(UnverifiedFile, match="truncated"):
        read_verified(path, KIND, 1)
    path.write_bytes(good.replace(b'"sha256"', b'"sha257"'))
    with pytest.raises(UnverifiedFile, match="header is not readable"):
        read_verified(path, KIND, 1)
    path.write_bytes(good)
    with pytest.raises(UnverifiedFile, match="is not a other kind: it is a test file") as kind:
        read_verified(path, "other kind", 1)
    assert kind.value.found_kind == KIND
    with pytest.raises(UnverifiedFile, match="format version 1; this h2o-stream reads version 2") as version:
        read_verified(path, KIND, 2)
    assert version.value.found_version == 1
    with pytest.raises(UnverifiedFile, match="does not exist"):
        read_verified(tmp_path / "missing", KIND, 1)
    assert read_verified(path, KIND, 1)["x"].sum() == sum(range(1000))


def test_remove_partials_removes_only_what_killed_writers_left(tmp_path):
    for name in ("h2o-16.ckpt", "h2o-16.ckpt.123.tmp.ckpt", "summary.json.9.tmp.json", "notes.2024.tmp", "a.tmp.json"):
        (tmp_path / name).write_text("x")
    removed = remove_partials(tmp_path)
    assert sorted(p.name for p in removed) == ["h2o-16.ckpt.123.tmp.ckpt", "summary.json.9.tmp.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tmp.json", "h2o-16.ckpt", "notes.2024.tmp"]


# -- through the command ------------------------------------------------------------------------------------------


@pytest.fixture
def checkpointed(ppl_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
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
        "--out",
        out,
        "--tokens",
    ]
    assert ppl(capsys, *args, 300)[0] == 0
    return args, out


@pytest.mark.parametrize("framed", [False, True])
def test_resume_from_a_crafted_checkpoint_runs_no_code(checkpointed, tmp_path, capsys, framed):
    args, out = checkpointed
    marker = tmp_path / "marker"
    body = crafted_body(marker)
    (out / "h2o-16.ckpt").write_bytes(with_header(body, CHECKPOINT_KIND, CHECKPOINT_VERSION) if framed else body)
    before = snapshot(out)
    message = ppl_error(capsys, *args, 600, "--resume")
    assert "is never used" in message and str(out / "h2o-16.ckpt") in message
    assert not marker.exists()
    assert snapshot(out) == before


def test_resume_from_a_checkpoint_with_a_flipped_byte_is_refused(checkpointed, capsys):
    args, out = checkpointed
    checkpoint = out / "h2o-16.ckpt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x20
    checkpoint.write_bytes(bytes(data))
    assert "damaged: its contents do not match their checksum" in ppl_error(capsys, *args, 600, "--resume")
