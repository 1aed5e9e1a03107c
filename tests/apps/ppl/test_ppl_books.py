"""--books and --book-tokens: a stream over some books of a corpus, or over each book's first tokens; recorded in the
run's settings, bound on --resume, refused when they name what the corpus does not have."""

from __future__ import annotations

import json

import pytest

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.corpus import books_text, parse_books
from support.ppl_helpers import TEXT, command, ppl, ppl_error, result, snapshot, write_corpus


def test_parse_books_reads_indices_and_ranges_in_order_each_once():
    assert parse_books("3,1-2,7,2") == (1, 2, 3, 7)
    assert parse_books(" 0 - 4 ") == (0, 1, 2, 3, 4)
    assert books_text(parse_books("3,1-2,7,9,8")) == "1-3,7-9"
    assert parse_books(books_text((5, 0, 2, 3))) == (0, 2, 3, 5)


@pytest.mark.parametrize(
    ("text", "why"),
    [("", "not a book index"), ("a", "not a book index"), ("-1", "not a book index"), ("1-", "not a book index"),
     ("1,,2", "not a book index"), ("5-2", "ends before it starts"), ("1.5", "not a book index")],
)  # fmt: skip
def test_parse_books_refuses_anything_else(text, why):
    with pytest.raises(H2OStreamError, match=why):
        parse_books(text)


def _books(tmp_path, count=4):
    """A corpus of `count` books, each its own text (the char tokenizer: one token per character, BOS first)."""
    path = tmp_path / "books.jsonl"
    rows = [{"short_book_title": f"Book {i}", "text": f"{i} " + TEXT[i * 37 :]} for i in range(count)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path, [r["text"] for r in rows]


RUN = ("--policy", "h2o,sink", "--cache-size", 16, "--chunk-size", 8, "--threads", 1)


def test_chosen_books_cut_to_their_first_tokens_stream_as_a_corpus_of_just_those(ppl_model_dir, tmp_path, capsys):
    corpus, texts = _books(tmp_path)
    chosen, alone = tmp_path / "chosen", tmp_path / "alone"
    code, _, err = ppl(
        capsys, "--model", ppl_model_dir, "--data", corpus, "--books", "1,3", "--book-tokens", 40, *RUN,
        "--tokens", 1000, "--out", chosen,
    )  # fmt: skip
    assert code == 0, err
    assert "the stream of --books 1,3 cut to --book-tokens 40 has only 80 tokens" in err
    # the same two book beginnings as a corpus of their own: BOS + 39 characters is each book's first 40 tokens
    just_those = tmp_path / "just_those.jsonl"
    just_those.write_text("\n".join(json.dumps({"text": texts[i][:39]}) for i in (1, 3)))
    code, _, err = ppl(capsys, "--model", ppl_model_dir, "--data", just_those, *RUN, "--tokens", 1000, "--out", alone)
    assert code == 0, err
    for name in ("h2o-16", "sink-16"):
        picked, whole = result(chosen, name), result(alone, name)
        assert picked["tokens_fed"] == whole["tokens_fed"] == 80 and picked["corpus_exhausted"]
        assert picked["nll_sum"] == whole["nll_sum"] and picked["curve"] == whole["curve"]
        assert picked["settings"]["books"] == "1,3" and picked["settings"]["book_tokens"] == 40
        assert "books" not in whole["settings"] and "book_tokens" not in whole["settings"]


def test_a_run_on_other_books_does_not_resume_or_join_a_run_on_these(ppl_model_dir, tmp_path, capsys):
    corpus, _ = _books(tmp_path)
    out = tmp_path / "out"
    args = ("--model", ppl_model_dir, "--data", corpus, *RUN, "--tokens", 60, "--out", out)
    assert ppl(capsys, *args, "--books", "0-1")[0] == 0
    before = snapshot(out)
    for other in (("--books", "2-3"), ("--books", "0-1", "--book-tokens", 30), ()):
        message = ppl_error(capsys, *args, *other, "--resume")
        assert "other settings" in message and "books" in message, message
    assert snapshot(out) == before
    assert ppl(capsys, *args, "--books", "0,1", "--tokens", 120, "--resume")[0] == 0  # the same books, written apart
    assert result(out, "h2o-16")["tokens_fed"] == 120


def test_books_the_corpus_lacks_are_one_error_before_anything_is_written(ppl_model_dir, tmp_path, capsys):
    corpus, _ = _books(tmp_path)
    out = tmp_path / "out"
    message = ppl_error(capsys, "--model", ppl_model_dir, "--data", corpus, "--books", "2-6", *RUN, "--out", out)
    assert message == "Error: --books 2-6: books.jsonl (local jsonl) has no book 4 (4 books, indices 0-3)"
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [("--books", "3-1", "the range '3-1' ends before it starts"), ("--books", "x", "'x' is not a book index"),
     ("--book-tokens", 0, "--book-tokens must be at least 1, got 0")],
)  # fmt: skip
def test_bad_selections_are_usage_errors(tmp_path, capsys, option, value, says):
    code, _, err = ppl(capsys, "--data", "sample", option, value, "--out", tmp_path / "out")
    assert code == 2 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_leaderboard_streams_the_chosen_books_too_and_says_so(ppl_model_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl", books=3)
    board = ("leaderboard", "--model", ppl_model_dir, "--data", corpus, "--policy", "sink,h2o", "--cache-size", 16,
             "--tokens", 50, "--workers", 1)  # fmt: skip
    code, _, err = command(capsys, *board, "--books", "2", "--book-tokens", 30, "--out", tmp_path / "chosen")
    assert code == 0, err
    run = result(tmp_path / "chosen" / "runs", "sink-16")
    assert run["tokens_fed"] == 30 and run["settings"]["books"] == "2" and run["settings"]["book_tokens"] == 30
    corpus_line = (tmp_path / "chosen" / "leaderboard.md").read_text().splitlines()[3]
    assert corpus_line.startswith("- Corpus: ") and corpus_line.endswith(
        ", read: books 2, the first 30 tokens of each book"
    ), corpus_line
    code, _, err = command(capsys, *board, "--out", tmp_path / "whole")
    assert code == 0, err
    assert "read:" not in (tmp_path / "whole" / "leaderboard.md").read_text()
