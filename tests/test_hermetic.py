"""The tests are hermetic (conftest.py): each runs in an empty working directory of its own, without the user's
Hugging Face or h2o-stream settings, so that the README's two commands pass one after the other in the clone's root,
also with HF_HUB_OFFLINE=1 set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: what a user's shell may hold: offline mode (as offline users set it), the compiled loop switched off, a Hugging
#: Face cache of their own
USERS_SETTINGS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "H2O_STREAM_COMPILED": "0"}


@pytest.mark.parametrize("turn", ["first", "second"])
def test_a_test_runs_in_an_empty_directory_of_its_own(turn, tmp_path):
    here = Path.cwd()
    assert not list(here.iterdir()), f"{turn} test: the working directory holds files"
    assert here != tmp_path and REPO not in (here, *here.parents)
    (here / "h2o-stream-ppl").mkdir()  # what `ppl` without --out leaves: the next test must not find it


@pytest.mark.parametrize("turn", ["first", "second"])
def test_a_test_runs_without_the_users_settings(turn):
    from huggingface_hub import constants

    assert not {name: os.environ[name] for name in USERS_SETTINGS if name in os.environ}, turn
    assert not constants.HF_HUB_OFFLINE  # read once, when huggingface_hub was imported
    assert Path(constants.HF_HOME) != Path.home() / ".cache" / "huggingface"
    os.environ["H2O_STREAM_COMPILED"] = "0"  # set as the code under test may set it: the next test must not see it


def test_the_tests_pass_offline_and_beside_an_earlier_runs_results(tmp_path):
    """A few tests once failed so: `ppl` run without --out, when the README's first command had left
    `h2o-stream-ppl/` in the directory; and the unreachable Hub's message, when HF_HUB_OFFLINE was set."""
    user = tmp_path / "clone"
    left = user / "h2o-stream-ppl"
    left.mkdir(parents=True)
    (left / "h2o-256.json").write_text(json.dumps({"ppl": 41.5}))
    (left / "summary.json").write_text(json.dumps([{"ppl": 41.5}]))
    before = {path.name: path.read_bytes() for path in left.iterdir()}
    hub_home = tmp_path / "users-hf-home"
    hub_home.mkdir()
    selection = [
        "apps/ppl/test_perplexity.py::test_directory_without_usable_files",
        "apps/ppl/test_ppl_options.py::test_an_unreachable_hub_fails_fast_for_a_model",
        "apps/ppl/test_ppl_options.py::test_an_unreachable_hub_fails_fast_for_the_corpus",
        "test_hermetic.py::test_a_test_runs_in_an_empty_directory_of_its_own",
        "test_hermetic.py::test_a_test_runs_without_the_users_settings",
    ]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--basetemp",
        str(tmp_path / "base"),
        *(str(TESTS / test) for test in selection),
    ]
    env = {**os.environ, **USERS_SETTINGS, "HF_HOME": str(hub_home)}
    done = subprocess.run(command, cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "7 passed" in done.stdout, done.stdout[-3000:]
    assert {path.name: path.read_bytes() for path in left.iterdir()} == before  # the user's results untouched
    assert sorted(path.name for path in user.iterdir()) == ["h2o-stream-ppl"] and not list(hub_home.iterdir())
