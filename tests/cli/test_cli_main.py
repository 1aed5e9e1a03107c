"""The entry point's exits: what each way a command can end becomes on the terminal, and the exit status."""

from __future__ import annotations

import click
import pytest

import h2o_stream.cli as cli_module
from h2o_stream import H2OStreamError


def ended_by(monkeypatch, capsys, outcome) -> tuple[int | None, str]:
    """Run the entry point with a group whose run ends in `outcome` (an exception to raise, or a value to return)."""

    def run(**kwargs):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(cli_module.cli, "main", run)
    with pytest.raises(SystemExit) as done:
        cli_module.main(["ppl"])
        raise SystemExit(None)  # a run that ends without one: status 0
    return done.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("outcome", "status", "said"),
    [
        (H2OStreamError("the corpus is empty"), 2, "Error: the corpus is empty\n"),
        (click.exceptions.Abort(), 130, "Aborted.\n"),
        (KeyboardInterrupt(), 130, "Interrupted.\n"),
        (click.UsageError("no such option: --x"), 2, "Error: no such option: --x\n"),
        (3, 3, ""),  # a command's own status
        (0, None, ""),
    ],
    ids=["our-error", "abort", "ctrl-c", "usage", "status", "success"],
)
def test_each_ending_is_one_line_and_its_exit_status(monkeypatch, capsys, outcome, status, said):
    code, err = ended_by(monkeypatch, capsys, outcome)
    assert code == status
    assert err == said
