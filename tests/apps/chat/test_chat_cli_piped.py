"""`h2o-stream chat` with stdin piped: every line is one turn or command, run one after another."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from h2o_stream.apps.chat import CHAT_SAMPLING
from h2o_stream.apps.chat.session_file import SESSION_FORMAT, SESSION_VERSION
from h2o_stream.cli.chat import chat
from h2o_stream.files import read_verified
from support.chat_helpers import ONE_THREAD, TRAINING_TEXTS, main_command, tiny_tokenizer  # noqa: F401


def run_chat(args, stdin, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    return CliRunner().invoke(chat, [str(a) for a in args], input=stdin)


def test_piped_turns_and_commands(model_dir, tmp_path, monkeypatch):
    stdin = (
        "\n".join(
            [
                "hello",
                "",
                "   ",
                "/stats",
                "/nosuch",
                "what is two plus two?",
                "/save",
                f"/save {tmp_path}/s.pt",
                "/load",
                f"/load {tmp_path}/missing.pt",
                f"/load {tmp_path}/s.pt",
                "/help",
                "/reset",
                "/stats",
                "/exit",
                "never read",
            ]
        )
        + "\n"
    )
    result = run_chat(
        ["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 5, "--seed", 1], stdin, monkeypatch
    )
    out, err = result.stdout, result.stderr
    assert result.exit_code == 1, (out, err)  # piped, and some commands failed
    assert "cache occupancy: 16/16" in out and "turns:           2" not in out
    assert "unknown command /nosuch; type /help" in err
    assert "/save needs a file name" in err and "/load needs a file name" in err
    assert "no session file at" in err
    assert "saved the session (turn 2" in out and "resumed the session from" in out
    assert "/stats" in out and "session reset: 2 turn(s) forgotten" in out
    assert "turns:           0" in out
    assert err.count("[reply cut at --max-new-tokens 5]") == 2  # the two messages, not the empty lines or /exit
    assert (tmp_path / "s.pt").is_file()


def test_piped_session_without_failures_exits_zero(model_dir, monkeypatch):
    # Greedy, so the replies are the same on every run (sampled ones could hold newlines or stop early).
    result = run_chat(
        ["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0], "hello\n//slash is a message\n", monkeypatch
    )
    assert result.exit_code == 0, result.output
    assert "unknown command" not in result.stderr
    assert result.stderr.count("[reply cut at --max-new-tokens 3]") == 2  # "//..." was sent as a message


def test_sampling_options_reach_the_session(model_dir, tmp_path, monkeypatch):
    path = tmp_path / "s.pt"
    result = run_chat(
        [
            "--model",
            model_dir,
            "--max-new-tokens",
            3,
            "--temperature",
            0.5,
            "--top-p",
            0.8,
            "--top-k",
            7,
            "--repetition-penalty",
            1.4,
            "--no-repeat-ngram-size",
            3,
            "--seed",
            9,
        ],
        f"hello\n/save {path}\n/load {path}\n",
        monkeypatch,
    )
    assert result.exit_code == 0, result.output
    assert "temperature 0.5, top-p 0.8, repetition-penalty 1.4, max-new-tokens 3" in result.stdout
    sampling = read_verified(path, SESSION_FORMAT, SESSION_VERSION)["sampling"]
    assert sampling == {
        "temperature": 0.5,
        "top_p": 0.8,
        "max_new_tokens": 3,
        "seed": 9,
        "top_k": 7,
        "repetition_penalty": 1.4,
        "no_repeat_ngram_size": 3,
    }


def test_the_command_line_defaults_are_the_chats(model_dir, tmp_path, monkeypatch):
    path = tmp_path / "s.pt"
    result = run_chat(["--model", model_dir, "--max-new-tokens", 2], f"hello\n/save {path}\n", monkeypatch)
    assert result.exit_code == 0, result.output
    sampling = read_verified(path, SESSION_FORMAT, SESSION_VERSION)["sampling"]
    assert {k: sampling[k] for k in CHAT_SAMPLING} == {**CHAT_SAMPLING, "max_new_tokens": 2}


def test_plain_format_notice_on_the_command_line(model, tmp_path, monkeypatch):
    directory = tmp_path / "plain"
    model.save_pretrained(directory)
    tiny_tokenizer(None).save_pretrained(directory)
    result = run_chat(["--model", directory, "--max-new-tokens", 3], "hello\n", monkeypatch)
    assert result.exit_code == 0 and "note: the tokenizer has no chat template" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cache-size", "big"], "--cache-size must be a whole number"),
        (["--policy", "nope"], "unknown policy"),
        (["--top-p", "0"], "top-p"),
        (["--repetition-penalty", "0.5"], "repetition-penalty"),
    ],
)
def test_bad_options(model_dir, args, message, monkeypatch):
    result = run_chat(["--model", model_dir, *args], "", monkeypatch)
    assert result.exit_code != 0
    assert message in (result.output + str(result.exception))


def test_a_session_saved_by_one_process_continues_in_another(model_dir, tmp_path):
    """Sampled, not greedy: the RNG state travels too. Process A: 2 turns, save, third turn. Process B: load (no
    --seed, which would start a fresh random stream), the same third turn gives the same reply."""
    common = ["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 8, "--temperature", 1.0, "--threads", 1]
    path = tmp_path / "s.pt"
    a = subprocess.run(
        main_command(*common, "--seed", 5),
        input=f"hello\nworld\n/save {path}\nthird turn\n",
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        timeout=120,
    )
    b = subprocess.run(
        main_command(*common, "--load", path),
        input="third turn\n",
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        timeout=120,
    )
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert "resumed the session" in b.stderr
    reply_a = a.stdout.split("saved the session")[1].split("\n", 1)[1]
    assert reply_a.strip() and b.stdout == reply_a


def test_a_bad_session_on_the_command_line_is_one_error_line(model_dir, tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"junk")
    result = subprocess.run(
        main_command("--model", model_dir, "--load", tmp_path / "bad.pt"),
        input="",
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"Error: {tmp_path / 'bad.pt'} is not a readable chat")
