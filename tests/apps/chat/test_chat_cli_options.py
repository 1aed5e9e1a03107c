"""`h2o-stream chat`'s options and the files it writes: /save never replaces a file that is not a chat session unless
forced; --server must be an http(s) URL and refuses the options it would ignore; --seed is one torch takes; options
given on the command line win over a loaded session's settings (or a note says which it kept); the errors name the
options."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from h2o_stream import H2OStreamError
from h2o_stream.apps.chat import Sampling
from h2o_stream.apps.chat.session_file import SESSION_FORMAT, SESSION_VERSION, NotReplaced
from h2o_stream.apps.perplexity.run import CHECKPOINT_KIND
from h2o_stream.apps.serve.client import RemoteSession, base_url
from h2o_stream.cli.chat import chat
from h2o_stream.cli.options import SEEDS
from h2o_stream.files import MAGIC, not_ours, read_verified, write_verified
from h2o_stream.generation import MAX_SEED, check_sampling
from support.chat_helpers import ONE_THREAD, TRAINING_TEXTS, session_for  # noqa: F401
from support.startup import heavy_in, imported_modules

NOTES = "my notes: buy milk\n"


def run_chat(args, stdin, monkeypatch):
    monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    return CliRunner().invoke(chat, [str(a) for a in args], input=stdin)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def main_error(args, monkeypatch, capsys) -> str:
    """Run `h2o-stream chat ARGS` in this process with a message on stdin, expecting one error line and exit 2
    before any model loads and before any connection to a server; that line."""
    from h2o_stream import cli

    loads, opened = [], []
    monkeypatch.setattr("h2o_stream.loading.models.load_model", lambda *a, **k: loads.append(a))
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: opened.append(a))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat", *map(str, args)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert loads == [] and opened == []
    return err.strip()


def saved_sampling(path) -> dict:
    return read_verified(path, SESSION_FORMAT, SESSION_VERSION)["sampling"]


# -- /save replaces a chat session, never anything else unless forced --------------------------------------------------


def _user_text(path):
    path.write_text(NOTES, encoding="utf-8")


def _json(path):
    path.write_text(json.dumps({"kind": "results", "mean_nll": 3.1}), encoding="utf-8")


def _checkpoint(path):
    write_verified(path, CHECKPOINT_KIND, 1, {"tokens": 5})


def _damaged_header(path):
    path.write_bytes(MAGIC + b"not a header\n" + b"body")


@pytest.mark.parametrize(
    "make, what",
    [
        (_user_text, "is not a file written by h2o-stream"),
        (_json, "is not a file written by h2o-stream"),
        (_checkpoint, f"is a {CHECKPOINT_KIND}"),
        (_damaged_header, "is an h2o-stream file whose header is not readable"),
    ],
    ids=["text", "json", "checkpoint", "damaged"],
)
def test_save_never_replaces_a_file_that_is_not_a_chat_session_unless_forced(
    model_dir, tmp_path, monkeypatch, make, what
):
    path = tmp_path / "notes.txt"
    make(path)
    before = path.read_bytes()
    refused = run_chat(
        ["--model", model_dir, "--max-new-tokens", 2, "--temperature", 0], f"hello\n/save {path}\n/stats\n", monkeypatch
    )
    assert refused.exit_code == 1, refused.output  # piped, one command failed
    assert error_lines(refused.stderr) == [
        f"Error: {path} {what}, not a chat session: /save does not replace it (/save {path} --force does; or "
        "choose another file)"
    ]
    assert path.read_bytes() == before  # untouched
    assert "turns:           1" in refused.stdout  # the chat went on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # and left no partial file

    for command in (f"/save {path} --force", f"/save --force {path}"):
        forced = run_chat(
            ["--model", model_dir, "--max-new-tokens", 2, "--temperature", 0], f"hi\n{command}\n", monkeypatch
        )
        assert forced.exit_code == 0 and error_lines(forced.stderr) == [], forced.output
        assert read_verified(path, SESSION_FORMAT, SESSION_VERSION)["counters"]["turns"] == 1
        make(path)


def test_save_replaces_an_older_session_and_help_tells_of_force(model_dir, tmp_path, monkeypatch):
    path = tmp_path / "s.pt"
    result = run_chat(
        ["--model", model_dir, "--max-new-tokens", 2, "--temperature", 0],
        f"hello\n/save {path}\nworld\n/save {path}\n/help\n/save --force\n",
        monkeypatch,
    )
    assert error_lines(result.stderr) == ["Error: /save needs a file name: /save PATH --force"]
    assert result.stdout.count(f"to {path}") == 2
    assert read_verified(path, SESSION_FORMAT, SESSION_VERSION)["counters"]["turns"] == 2
    assert "/save PATH --force" in result.stdout


def test_the_library_save_follows_the_same_rule(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer)
    session.chat("hello")
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES, encoding="utf-8")
    with pytest.raises(NotReplaced, match="is not a file written by h2o-stream, not a chat session") as refused:
        session.save(notes)
    assert isinstance(refused.value, H2OStreamError) and "force=True" in str(refused.value)
    assert notes.read_text(encoding="utf-8") == NOTES
    session.save(notes, force=True)
    session.save(notes)  # now a chat session: a newer save replaces it
    assert read_verified(notes, SESSION_FORMAT, SESSION_VERSION)["counters"]["turns"] == 1


def test_not_ours_is_the_rule_for_any_verified_file(tmp_path):
    kind = "h2o-stream test file"
    assert not_ours(tmp_path / "absent", kind) is None
    write_verified(tmp_path / "same", kind, 1, {"a": 1})
    write_verified(tmp_path / "older", kind, 0, {"a": 1})
    assert not_ours(tmp_path / "same", kind) is None and not_ours(tmp_path / "older", kind) is None
    write_verified(tmp_path / "other", "h2o-stream other file", 1, {})
    assert not_ours(tmp_path / "other", kind) == "is a h2o-stream other file"
    (tmp_path / "text").write_text(NOTES, encoding="utf-8")
    assert not_ours(tmp_path / "text", kind) == "is not a file written by h2o-stream"
    (tmp_path / "empty").write_bytes(b"")
    assert not_ours(tmp_path / "empty", kind) == "is not a file written by h2o-stream"
    assert not_ours(tmp_path, kind) == "is a directory"


# -- --server: an http(s) URL, and no option it would ignore -----------------------------------------------------------


@pytest.mark.parametrize(
    "url, says",
    [
        ("not-a-url", "is not an http:// or https:// URL; did you mean http://not-a-url?"),
        ("ftp://x", "is not an http:// or https:// URL"),
        ("http://", "names no host"),
        ("https://:8000/v1", "names no host"),
        ("localhost:8000", "did you mean http://localhost:8000?"),
        ("http://my server:8000", "holds a space"),
        ("http://host:99999", "has a port that is not a number"),
        ("http://host:8000/v1?key=1", "takes no ?query"),
        ("", "is empty"),
    ],
)
def test_a_server_that_is_not_an_http_url_is_one_error_line(url, says, monkeypatch, capsys):
    err = main_error(["--server", url], monkeypatch, capsys)
    assert err.startswith("Error: --server ") and says in err, err
    with pytest.raises(H2OStreamError, match="^the server URL "):
        RemoteSession(url)


def test_a_server_url_names_the_api_base(monkeypatch):
    assert base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("https://example.org/v1/") == "https://example.org/v1"


@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "tova", "--cache-size", "64"],
        ["--model", "some/model"],
        ["--dtype", "bfloat16", "--device", "cpu", "--threads", "1"],
        ["--heavy", "8"],
        ["--no-rolling"],
        ["--chunk-size", "8"],
        ["--no-repeat-ngram-size", "3"],
    ],
    ids=" ".join,
)
def test_options_that_change_nothing_with_a_server_are_refused(args, monkeypatch, capsys):
    err = main_error(["--server", "http://127.0.0.1:9", *args, "--temperature", "0.5"], monkeypatch, capsys)
    flags = [arg for arg in args if arg.startswith("--")]
    assert err.startswith("Error: " + ", ".join(flags)) and "no effect with --server" in err, err
    assert "--temperature" not in err


def test_the_options_a_server_takes_reach_it(monkeypatch, capsys):
    """--temperature, --seed, --system, --max-new-tokens, --top-p, --top-k, --repetition-penalty go with --server:
    the chat tries to connect (and says it cannot); --api-key without --server is refused."""
    from h2o_stream import cli

    opened = []

    def refuse(request, timeout):
        opened.append(request.full_url)
        raise OSError("refused")

    monkeypatch.setattr("urllib.request.urlopen", refuse)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    given = ["--temperature", 0.5, "--seed", 3, "--system", "Be brief.", "--max-new-tokens", 5, "--top-p", 0.8]
    with pytest.raises(SystemExit):
        cli.main(["chat", "--server", "http://127.0.0.1:9", *given, "--top-k", 2, "--repetition-penalty", 1.2])
    assert opened == ["http://127.0.0.1:9/v1/models"]
    assert capsys.readouterr().err.startswith("Error: cannot reach a server at http://127.0.0.1:9/v1")
    err = main_error(["--api-key", "secret"], monkeypatch, capsys)
    assert err.startswith("Error: --api-key ") and "--server" in err


# -- --seed: what torch takes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [str(2**64), "99999999999999999999999", "-1"])
def test_a_seed_torch_cannot_take_is_refused_before_torch_loads(tmp_path, seed):
    done, modules = imported_modules(tmp_path, "chat", "--seed", seed)
    assert done.returncode == 2, done.stderr
    assert "Invalid value for '--seed'" in done.stderr and "Traceback" not in done.stderr
    assert heavy_in(modules) == []
    summarized = subprocess.run(
        [sys.executable, "-m", "h2o_stream", "summarize", "-", "--seed", seed],
        input="A document.",
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        timeout=120,
    )
    assert summarized.returncode == 2 and "Invalid value for '--seed'" in summarized.stderr


def test_the_seed_range_is_torchs(model_dir, tmp_path, monkeypatch):
    assert (SEEDS.min, SEEDS.max) == (0, MAX_SEED)
    torch.Generator().manual_seed(MAX_SEED)
    with pytest.raises((RuntimeError, ValueError, OverflowError)):  # what torch refuses, by version
        torch.Generator().manual_seed(MAX_SEED + 1)
    for bad in (MAX_SEED + 1, -1):
        with pytest.raises(H2OStreamError, match=rf"^seed must be an integer in \[0, {MAX_SEED}\], got {bad}$"):
            Sampling(seed=bad)
    assert Sampling(seed=MAX_SEED).new_generator().initial_seed() == MAX_SEED
    path = tmp_path / "s.pt"
    result = run_chat(
        ["--model", model_dir, "--max-new-tokens", 2, "--seed", MAX_SEED], f"hello\n/save {path}\n", monkeypatch
    )
    assert result.exit_code == 0, result.output
    assert saved_sampling(path)["seed"] == MAX_SEED


# -- a loaded session and the options given on the command line --------------------------------------------------------


@pytest.fixture(scope="module")
def saved(model_dir, tmp_path_factory):
    """A session saved greedy, with replies of at most 2 tokens, chunk size 4, seed 1, a sink cache of 16."""
    path = tmp_path_factory.mktemp("saved") / "s.pt"
    result = CliRunner(env={"H2O_STREAM_CHAT_HISTORY": ""}).invoke(
        chat,
        [
            *("--model", str(model_dir), "--policy", "sink", "--cache-size", "16", "--temperature", "0"),
            *("--max-new-tokens", "2", "--chunk-size", "4", "--seed", "1", "--system", "Be brief."),
        ],
        input=f"hello\n/save {path}\n",
    )
    assert result.exit_code == 0, result.output
    return path


def test_options_given_with_load_win_over_the_sessions_settings(model_dir, saved, tmp_path, monkeypatch):
    again = tmp_path / "again.pt"
    result = run_chat(
        [
            *("--model", model_dir, "--load", saved, "--temperature", 0.9, "--max-new-tokens", 40),
            *("--top-k", 5, "--chunk-size", 8, "--seed", 7, "--top-p", 0.9),  # 0.9: the session's top-p too
        ],
        f"/save {again}\n",
        monkeypatch,
    )
    assert result.exit_code == 0, result.output
    state = read_verified(again, SESSION_FORMAT, SESSION_VERSION)
    assert state["sampling"] == {
        "temperature": 0.9,
        "top_p": 0.9,
        "max_new_tokens": 40,
        "seed": 7,
        "top_k": 5,
        "repetition_penalty": 1.1,
        "no_repeat_ngram_size": 0,
    }
    assert state["chunk_size"] == 8
    assert torch.equal(state["rng_state"], torch.Generator().manual_seed(7).get_state())  # a fresh stream of seed 7
    assert (
        "note: --chunk-size 8, --temperature 0.9, --top-k 5, --max-new-tokens 40, --seed 7 from the command line "
        "apply instead of the loaded session's chunk-size 4, temperature 0.0, top-k 0, max-new-tokens 2, seed 1"
    ) in result.stderr
    assert "keeps its own cache" not in result.stderr  # no cache option given: the file's cache is no surprise
    assert "--top-p" not in result.stderr  # the same as the session's: nothing to say


def test_a_load_without_options_keeps_the_sessions_settings(model_dir, saved, tmp_path, monkeypatch):
    again = tmp_path / "again.pt"
    result = run_chat(["--model", model_dir, "--load", saved], f"/save {again}\n", monkeypatch)
    assert result.exit_code == 0, result.output
    assert saved_sampling(again) == saved_sampling(saved)
    assert "note: --" not in result.stderr and "from the command line" not in result.stderr


@pytest.mark.parametrize(
    "args, kept",
    [
        (["--policy", "h2o"], "(--policy does not apply: a saved session's cache cannot change)"),
        (["--cache-size", "32", "--no-rolling"], "(--cache-size, --no-rolling do not apply"),
        (["--policy", "sink", "--sinks", "2"], "(--policy, --sinks do not apply"),
    ],
)
def test_cache_options_given_with_load_are_named_as_kept(model_dir, saved, args, kept, monkeypatch):
    result = run_chat(["--model", model_dir, "--load", saved, *args], "/stats\n", monkeypatch)
    assert result.exit_code == 0, result.output
    assert "note: the loaded session keeps its own cache, sink(sinks=4, recent=12)" in result.stderr
    assert kept in result.stderr
    assert "16/16" in result.stdout


def test_a_system_prompt_given_with_load_is_named_as_kept(model_dir, saved, monkeypatch):
    other = run_chat(["--model", model_dir, "--load", saved, "--system", "Be long."], "", monkeypatch)
    assert other.exit_code == 0, other.output
    assert "note: the loaded session keeps its own system prompt ('Be brief.'); --system does not apply" in other.stderr
    same = run_chat(["--model", model_dir, "--load", saved, "--system", "Be brief."], "", monkeypatch)
    assert same.exit_code == 0 and "system prompt (" not in same.stderr


def test_options_given_on_the_command_line_also_win_at_a_load_in_the_chat(model_dir, saved, tmp_path, monkeypatch):
    again = tmp_path / "again.pt"
    result = run_chat(
        ["--model", model_dir, "--max-new-tokens", 3, "--policy", "sink", "--cache-size", 16],
        f"/load {saved}\n/save {again}\n",
        monkeypatch,
    )
    assert result.exit_code == 0, result.output
    assert saved_sampling(again) == {**saved_sampling(saved), "max_new_tokens": 3}
    assert "note: --max-new-tokens 3 from the command line applies instead of the loaded session's" in result.stderr
    assert "keeps its own cache" not in result.stderr  # the same cache: nothing kept against the command line


# -- the errors name the options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "nan"], "Error: --temperature must be a number >= 0 and finite, got nan"),
        (["--temperature", "inf"], "Error: --temperature must be a number >= 0 and finite, got inf"),
        (["--top-p", "nan"], "Error: --top-p must be a number in (0, 1], got nan"),
        (
            ["--repetition-penalty", "nan"],
            "Error: --repetition-penalty must be a number >= 1 (1 = off) and finite, got nan",
        ),
    ],
)
def test_the_command_names_its_options_not_the_sessions_settings(args, message, monkeypatch, capsys):
    assert main_error(args, monkeypatch, capsys) == message


def test_the_library_names_its_settings_and_a_command_its_options():
    with pytest.raises(H2OStreamError, match=r"^top_p must be a number in \(0, 1\], got nan$"):
        Sampling(top_p=float("nan"))
    with pytest.raises(H2OStreamError, match="^max_new_tokens must be an integer >= 1, got 0$"):
        Sampling(max_new_tokens=0)
    with pytest.raises(H2OStreamError, match="^--no-repeat-ngram-size must be an integer >= 0, got -1$"):
        check_sampling(options=True, no_repeat_ngram_size=-1)
    with pytest.raises(H2OStreamError, match="^no sampling setting is named top_q"):
        check_sampling(top_q=1)
    check_sampling(options=True, seed=None, top_k=0)
