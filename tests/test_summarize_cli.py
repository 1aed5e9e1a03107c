"""`h2o-stream summarize` (cli/summarize.py): streaming the summary, --out, stdin, and one-line errors before any
model is loaded."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from h2o_stream.cli.summarize import summarize as summarize_command
from summarize_helpers import BOOKS, TRAINING_TEXTS, jsonl, run, words  # noqa: F401  (TRAINING_TEXTS: conftest)

torch.set_num_threads(1)

@pytest.fixture(scope="module")
def document():
    return words(900)


def invoke(args):
    return CliRunner().invoke(summarize_command, [str(a) for a in args], catch_exceptions=True)


def test_command_streams_the_summary_and_writes_out(tmp_path, model_dir, model, tokenizer, document):
    source = tmp_path / "doc.txt"
    source.write_text(document, encoding="utf-8")
    out = tmp_path / "summary.md"
    result = invoke([source, "--model", model_dir, "--threads", 1, "--cache-size", 48, "--chunk-size", 16,
                     "--max-new-tokens", 6, "--out", out])
    assert result.exit_code == 0, result.output
    expected, _ = run(model, tokenizer, document)
    assert out.read_text(encoding="utf-8") == expected.text + "\n"
    assert expected.text in result.stdout
    assert f"read {expected.tokens_read:,} document tokens" in result.stderr
    assert "h2o heavy=24 recent=24" in result.stderr


def test_command_reads_a_jsonl_book_hierarchically(tmp_path, model_dir):
    books = jsonl(tmp_path / "books.jsonl", BOOKS)
    result = invoke([books, "--book", "emma returns", "--strategy", "hierarchical", "--section-tokens", 16,
                     "--model", model_dir, "--cache-size", 32, "--chunk-size", 8, "--max-new-tokens", 4,
                     "--section-max-new-tokens", 3, "--show-sections", "--policy", "sink"])
    assert result.exit_code == 0, result.output
    assert "summarizing Emma Returns (hierarchical, sink cache 32)" in result.stderr
    assert "[level 0 part 1, tokens 0-16]" in result.stderr


def test_command_reads_stdin(model_dir):
    result = CliRunner().invoke(summarize_command, ["-", "--model", str(model_dir), "--cache-size", "32",
                                                    "--chunk-size", "8", "--max-new-tokens", "3", "-q"],
                                input=words(100))
    assert result.exit_code == 0, result.output
    assert "summarizing" not in result.stderr and "document tokens" not in result.stderr  # -q
    assert result.stdout.strip()


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing.txt"], "no such file or directory"),
    (["{tmp}/empty.txt"], "empty.txt is empty"),
    (["{tmp}/binary.dat"], "looks like a binary file"),
    (["sample"], "sample holds 5 books: choose one by index or title"),
    (["sample", "--book", "Ulysses"], "no book 'Ulysses' in sample"),
    (["-", "--book", "1"], "--book needs a corpus"),
    (["{tmp}/doc.txt", "--instruction", ""], "instruction is empty"),
    (["{tmp}/doc.txt", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),  # the option, as typed
    (["{tmp}/doc.txt", "--cache-size", "big"], "--cache-size must be a whole number"),
    (["{tmp}/doc.txt", "--out", "{tmp}/nowhere/summary.md"], "directory .*nowhere does not exist"),
])
def test_command_errors_are_one_line_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    from h2o_stream import cli

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.dat").write_bytes(b"\x7fELF\x00\x00")
    (tmp_path / "doc.txt").write_text("A short document.")
    loads = []
    monkeypatch.setattr("h2o_stream.loading.models.load_model", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["summarize", *[a.format(tmp=tmp_path) for a in args]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert loads == []  # refused before loading a model
