"""`h2o-stream summarize` against what users actually do: --out naming the document itself (also through links),
a write that fails, stdin that is not text, option names in messages, an instruction longer than the cache."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner

from h2o_stream.apps.summarize import summarize
from h2o_stream.cli.summarize import summarize as summarize_command
from support.ppl_helpers import unmeasured
from support.summarize_helpers import TRAINING_TEXTS, words  # noqa: F401  (TRAINING_TEXTS: conftest)

torch.set_num_threads(1)
SMALL = ["--cache-size", "16", "--chunk-size", "8", "--max-new-tokens", "3", "--threads", "1"]
LONG_INSTRUCTION = "Summarize the document above in a few sentences. " * 6


def main_errors(args, monkeypatch, capsys) -> str:
    """Run `h2o-stream summarize ARGS` in this process, expecting one error line and exit 2 before any model is
    loaded; that line."""
    from h2o_stream import cli

    loads = []
    monkeypatch.setattr("h2o_stream.loading.models.load_model", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["summarize", *map(str, args)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert loads == []
    return err


def process(args, stdin: bytes = b"", preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if preexec_fn is not None:  # the file-size limit (the only use) would stop coverage.py's data file too
        env = unmeasured(env)
    return subprocess.run(
        [sys.executable, "-m", "h2o_stream", "summarize", *map(str, args)],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=120,
        preexec_fn=preexec_fn,
    )


# -- --out never replaces what is summarized, and is never left half-written ------------------------------------------


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink", "relative"])
def test_out_that_is_the_document_itself_is_refused(tmp_path, link, monkeypatch, capsys):
    source = tmp_path / "d.txt"
    source.write_text("A document that must survive.", encoding="utf-8")
    out = {
        "same": source,
        "symlink": tmp_path / "link.txt",
        "hardlink": tmp_path / "hard.txt",
        "relative": tmp_path / "sub" / ".." / "d.txt",
    }[link]
    if link == "symlink":
        out.symlink_to(source)
    elif link == "hardlink":
        os.link(source, out)
    elif link == "relative":
        (tmp_path / "sub").mkdir()
    err = main_errors([source, "--out", out], monkeypatch, capsys)
    assert f"Error: --out {out} is the file being summarized ({source}): the summary would replace the document" in err
    assert source.read_text(encoding="utf-8") == "A document that must survive."


def test_out_that_is_a_file_of_the_corpus_directory_is_refused(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "books"
    corpus.mkdir()
    (corpus / "a.txt").write_text("First book.", encoding="utf-8")
    (corpus / "b.txt").write_text("Second book.", encoding="utf-8")
    err = main_errors([corpus, "--book", "0", "--out", corpus / "b.txt"], monkeypatch, capsys)
    assert f"is a file of the corpus directory {corpus} that is being summarized" in err
    assert (corpus / "b.txt").read_text(encoding="utf-8") == "Second book."


def test_out_through_a_link_writes_the_file_it_points_to(tmp_path, model_dir):
    source, real = tmp_path / "doc.txt", tmp_path / "real.md"
    source.write_text(words(60), encoding="utf-8")
    real.write_text("old summary\n", encoding="utf-8")
    (tmp_path / "link.md").symlink_to(real)
    result = CliRunner().invoke(
        summarize_command, [str(source), "--model", str(model_dir), "-q", *SMALL, "--out", str(tmp_path / "link.md")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "link.md").is_symlink()  # the link stays a link
    assert real.read_text(encoding="utf-8") != "old summary\n"
    assert real.read_text(encoding="utf-8").strip() == result.stdout.strip()


def test_a_failed_write_of_out_leaves_the_old_file_whole(tmp_path, model_dir):
    """A real write failure from the kernel (the file size limit; a full disk behaves alike): one error line,
    and --out keeps its old contents, with no partial file beside it."""
    limit = 8  # bytes: enough for the temporary-directory probe at start-up, not for the summary

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    source, out = tmp_path / "doc.txt", tmp_path / "summary.md"
    source.write_text(words(60), encoding="utf-8")
    args = [source, "--model", model_dir, "-q", *SMALL, "--max-new-tokens", 24]
    summary = CliRunner().invoke(summarize_command, list(map(str, args))).stdout  # greedy: what the write will hold
    assert len(summary.encode()) > limit, summary
    out.write_text("the previous summary\n", encoding="utf-8")
    result = process([*args, "--out", out], preexec_fn=small_files)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"Error: cannot write {out}: File too large"
    assert out.read_text(encoding="utf-8") == "the previous summary\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt", "summary.md"]


# -- stdin that is not text --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        (
            b"\x7fELF\x02\x01\x01\x00\x00\x00",
            "Error: stdin is not UTF-8 text: it looks like binary data (it contains NUL bytes)",
        ),
        (
            "Un caf\u00e9 cr\u00e8me.".encode("latin-1"),
            "Error: stdin is not UTF-8 text (byte 0xe9 at offset 6); "
            "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8",
        ),
    ],
)
def test_stdin_that_is_not_utf8_text_is_one_error_line(data, message):
    result = process(["-", "--model", "no-model-is-loaded"], data)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err == message + "\n"


# -- what the messages say ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "Error: --max-new-tokens must be at least 1, got 0"),
        (["--chunk-size", "0"], "Error: --chunk-size must be at least 1, got 0"),
        (
            ["--strategy", "hierarchical", "--section-tokens", "-3"],
            "Error: --section-tokens must be at least 1, got -3",
        ),
        (
            ["--strategy", "hierarchical", "--section-max-new-tokens", "0"],
            "Error: --section-max-new-tokens must be at least 1, got 0",
        ),
        (["--instruction", " "], "Error: --instruction is empty"),
        (["--temperature", "nan"], "Error: --temperature must be a number"),
        (["--temperature", "inf"], "Error: --temperature must be a number"),
        (["--top-p", "nan"], "Error: --top-p must be a number"),
        (["--repetition-penalty", "nan"], "Error: --repetition-penalty must be a number"),
    ],
)
def test_the_command_names_its_options_not_the_functions_arguments(tmp_path, args, message, monkeypatch, capsys):
    (tmp_path / "doc.txt").write_text("A short document.", encoding="utf-8")
    err = main_errors([tmp_path / "doc.txt", *args], monkeypatch, capsys)
    assert err.startswith(message) and "_" not in err.split(":")[1], err


def test_an_instruction_longer_than_the_cache_is_warned_about(tmp_path, model_dir, model, tokenizer):
    source = tmp_path / "doc.txt"
    source.write_text(words(60), encoding="utf-8")
    result = CliRunner().invoke(
        summarize_command, [str(source), "--model", str(model_dir), *SMALL, "--instruction", LONG_INSTRUCTION]
    )
    assert result.exit_code == 0, result.output
    assert "warning: the instruction is " in result.stderr
    assert (
        "tokens with the prompt's closing, more than the cache holds (16 entries): the model cannot see all of "
        "it" in result.stderr
    )
    short = CliRunner().invoke(
        summarize_command, [str(source), "--model", str(model_dir), *SMALL, "--instruction", "Summarize."]
    )
    assert short.exit_code == 0 and "warning" not in short.stderr

    heard = []  # the library: a callback, else Python's warnings
    summarize(
        words(30),
        (model, tokenizer),
        cache_size=32,
        chunk_size=8,
        max_new_tokens=2,
        strategy="hierarchical",
        section_instruction=LONG_INSTRUCTION,
        on_warning=heard.append,
    )
    assert len(heard) == 1 and heard[0].startswith("the section instruction is ")
    with pytest.warns(UserWarning, match="the instruction is .* more than the cache holds"):
        summarize(
            words(30), (model, tokenizer), cache_size=16, chunk_size=8, max_new_tokens=2, instruction=LONG_INSTRUCTION
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summarize(words(30), (model, tokenizer), cache_size=64, chunk_size=8, max_new_tokens=2)  # no warning
