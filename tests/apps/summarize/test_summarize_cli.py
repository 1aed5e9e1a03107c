"""`h2o-stream summarize` (cli/summarize.py): streaming the summary, --out, stdin, and one-line errors before any
model is loaded."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

import h2o_stream.apps.summarize
from h2o_stream.apps.summarize import SummaryResult
from h2o_stream.apps.summarize.text import Unwrap, ends_a_sentence, unwrap
from h2o_stream.cli.summarize import summarize as summarize_command
from support.summarize_helpers import BOOKS, TRAINING_TEXTS, jsonl, run, words  # noqa: F401  (TRAINING_TEXTS: conftest)

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
    result = invoke(
        [
            source,
            "--model",
            model_dir,
            "--threads",
            1,
            "--cache-size",
            48,
            "--chunk-size",
            16,
            "--max-new-tokens",
            6,
            "--out",
            out,
        ]
    )
    assert result.exit_code == 0, result.output
    expected, _ = run(model, tokenizer, document)
    assert out.read_text(encoding="utf-8") == unwrap(expected.text) + "\n"
    assert unwrap(expected.text) in result.stdout
    assert f"read {expected.tokens_read:,} document tokens" in result.stderr
    assert "h2o heavy=24 recent=24" in result.stderr


def test_command_reads_a_jsonl_book_hierarchically(tmp_path, model_dir):
    books = jsonl(tmp_path / "books.jsonl", BOOKS)
    result = invoke(
        [
            books,
            "--book",
            "emma returns",
            "--strategy",
            "hierarchical",
            "--section-tokens",
            16,
            "--model",
            model_dir,
            "--cache-size",
            32,
            "--chunk-size",
            8,
            "--max-new-tokens",
            4,
            "--section-max-new-tokens",
            3,
            "--show-sections",
            "--policy",
            "sink",
        ]
    )
    assert result.exit_code == 0, result.output
    assert "summarizing Emma Returns (hierarchical, sink cache 32)" in result.stderr
    assert "[level 0 part 1, tokens 0-16]" in result.stderr


def test_command_reads_stdin(model_dir):
    result = CliRunner().invoke(
        summarize_command,
        ["-", "--model", str(model_dir), "--cache-size", "32", "--chunk-size", "8", "--max-new-tokens", "3", "-q"],
        input=words(100),
    )
    assert result.exit_code == 0, result.output
    assert "summarizing" not in result.stderr and "document tokens" not in result.stderr  # -q
    assert result.stdout.strip()


HARD_WRAPPED = [
    "Elizabeth Bennet meets",
    " Mr. Darcy at a ball",
    ",\nand they quarrel.",
    "\n",
    "\nLater",
    " she\nreads",
    " his letter:\n",
    "- he",
    " saved Lydia\n",
    "- he loves",
    " her\nstill and",
]


def summarizing(pieces: list[str], stop_reason: str):
    """A stand-in for summarize(): streams `pieces` as the model's text and ends for `stop_reason`."""

    def summarize(document, model, *, on_text=None, **_settings):
        for piece in pieces:
            on_text(piece)
        return SummaryResult(
            text="".join(pieces).strip(),
            tokens_read=100,
            evictions=0,
            seconds=1.0,
            strategy="single",
            policy={"policy": "h2o", "heavy": 16, "recent": 16},
            cache_size=32,
            chunk_size=8,
            rolling=True,
            tokens_generated=40,
            tokens_fed=140,
            peak_slots=32,
            read_seconds=0.5,
            generate_seconds=0.5,
            stop_reason=stop_reason,
        )

    return summarize


def test_the_summary_is_printed_and_written_as_paragraphs_and_a_cut_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(h2o_stream.apps.summarize, "summarize", summarizing(HARD_WRAPPED, "length"))
    (tmp_path / "doc.txt").write_text("A document.")
    result = invoke([tmp_path / "doc.txt", "--out", tmp_path / "summary.md", "--max-new-tokens", 40])
    assert result.exit_code == 0, result.output
    paragraphs = (
        "Elizabeth Bennet meets Mr. Darcy at a ball, and they quarrel.\n\nLater she reads his letter:\n"
        "- he saved Lydia\n- he loves her still and"
    )
    assert result.stdout == paragraphs + "\n"
    assert (tmp_path / "summary.md").read_text() == paragraphs + "\n"
    assert (
        "note: the summary stopped at --max-new-tokens 40, in the middle of a sentence; a larger "
        "--max-new-tokens lets it finish"
    ) in result.stderr


@pytest.mark.parametrize(
    "pieces, stop_reason",
    [(["It ends", " here."], "length"), (["It ends", " here and"], "eos"), (['He said "go', '."'], "length")],
)
def test_a_summary_that_ends_a_sentence_or_ends_itself_says_nothing_of_a_cut(
    tmp_path, monkeypatch, pieces, stop_reason
):
    monkeypatch.setattr(h2o_stream.apps.summarize, "summarize", summarizing(pieces, stop_reason))
    (tmp_path / "doc.txt").write_text("A document.")
    result = invoke([tmp_path / "doc.txt", "-q"])
    assert result.exit_code == 0, result.output
    assert "stopped at --max-new-tokens" not in result.stderr


@pytest.mark.parametrize(
    "text, paragraphs",
    [
        ("one\ntwo\n\nthree", "one two\n\nthree"),
        ("items:\n- a\n* b\n1. c\n12) d\n# title\n> quote", "items:\n- a\n* b\n1. c\n12) d\n# title\n> quote"),
        ("in\n1813 she\n12 x", "in 1813 she 12 x"),
        ("a\n  \nb", "a\n\nb"),
        ("trailing\n", "trailing"),
    ],
)
def test_unwrap_joins_wrapped_lines_and_keeps_paragraphs_and_lists_whatever_the_pieces(text, paragraphs):
    assert unwrap(text) == paragraphs
    for size in (1, 2, 3):
        joiner = Unwrap()
        assert (
            "".join(joiner.push(text[i : i + size]) for i in range(0, len(text), size)) + joiner.finish() == paragraphs
        )


def test_a_sentence_ends_at_its_stop_with_quotes_after_it():
    assert ends_a_sentence("It ended.") and ends_a_sentence("“Go!”") and ends_a_sentence("Why? ")
    assert not ends_a_sentence("and then the") and not ends_a_sentence("Mr")


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing.txt"], "no such file or directory"),
        (["{tmp}/empty.txt"], "empty.txt is empty"),
        (["{tmp}/binary.dat"], "looks like a binary file"),
        (["sample"], "sample holds 5 books: choose one by index or title"),
        (["sample", "--book", "Ulysses"], "no book 'Ulysses' in sample"),
        (["-", "--book", "1"], "--book needs a corpus"),
        (["{tmp}/doc.txt", "--instruction", ""], "instruction is empty"),
        (["{tmp}/doc.txt", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),  # the option, as typed
        (["{tmp}/doc.txt", "--cache-size", "big"], "--cache-size must be a whole number"),
        (["{tmp}/doc.txt", "--out", "{tmp}/nowhere/summary.md"], "directory .*nowhere does not exist"),
    ],
)
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
