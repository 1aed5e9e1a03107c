"""What the leaderboard and ppl's summary refuse to report over: runs on other streams or models, result files that
are damaged, hand-edited or not results at all, options --report-only would ignore; and what they report once: a
policy or size listed twice, the full cache as the reference row."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.ppl_helpers import command, ppl, write_corpus

POLICIES = "h2o,sink"


def leaderboard(capsys, *args) -> tuple[int, str, str]:
    return command(capsys, "leaderboard", *args)


def refused(capsys, *args) -> str:
    """The one Error line of a leaderboard call that must fail with exit status 2 and no traceback."""
    code, _, stderr = leaderboard(capsys, *args)
    assert code == 2, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("Error: "), stderr
    return stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, ppl_model_dir):
    """A finished leaderboard (h2o and sink at cache 16 over 300 tokens), made once: its folder and arguments."""
    where = tmp_path_factory.mktemp("finished")
    corpus = write_corpus(where / "corpus.jsonl")
    args = ["--model", ppl_model_dir, "--data", corpus, "--policy", POLICIES, "--cache-size", "16", "--tokens", 300]
    from h2o_stream.cli import main

    try:
        main(["leaderboard", *map(str, args), "--out", str(where / "board")])
    except SystemExit as exit_:
        assert not exit_.code
    return where / "board", args


@pytest.fixture
def board(tmp_path, finished):
    """A copy of the finished leaderboard's folder, with a leaderboard.md of the user's to be kept."""
    copy = tmp_path / "board"
    shutil.copytree(finished[0], copy)
    (copy / "leaderboard.md").write_text("my notes\n")
    return copy


def edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("data_sha256", "0" * 64, "data_sha256"),
        ("model_weights", "0123456789abcdef", "model_weights"),
        ("dtype", "bfloat16", "dtype"),
        ("rolling", False, "rolling"),
        ("skip_tokens", 100, "skip_tokens"),
    ],
)
def test_runs_on_another_stream_or_model_are_never_ranked_together(capsys, board, field, value, reason):
    edit(board / "runs" / "h2o-16.json", lambda r: r["settings"].update({field: value}))
    line = refused(capsys, "--out", board, "--report-only")
    assert "h2o-16.json" in line and "not run on the same stream" in line and reason in line
    assert (board / "leaderboard.md").read_text() == "my notes\n"


def test_ppl_refuses_to_add_runs_beside_a_result_made_on_another_corpus(capsys, tmp_path, finished):
    out = tmp_path / "runs"
    shutil.copytree(finished[0] / "runs", out)
    other = write_corpus(tmp_path / "other.jsonl", text="Call me Ishmael. Some years ago, never mind how long. " * 80)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = finished[1][:2] + ["--data", other, "--policy", "tova", "--cache-size", 16, "--tokens", 300]
    code, _, stderr = ppl(capsys, *args, "--out", out, "--resume")
    assert code == 2 and "not run on the same stream" in stderr and "another text" in stderr, stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_result_still_being_written_beside_the_finished_ones_is_skipped(board, tmp_path):
    """Workers share one runs folder: while one writes its result (atomic_path's temporary name), another that lists
    the folder must neither read the half-written file nor fail on it; a user's own JSON file still fails."""
    from h2o_stream.apps.perplexity.report import results_in
    from h2o_stream.errors import H2OStreamError

    runs = tmp_path / "runs"
    shutil.copytree(board / "runs", runs)
    finished = sorted(r["settings"]["policy"] for r in results_in(runs))
    (runs / "tova-16.json.4242.tmp.json").write_text('{"settings": {"pol')  # half-written
    assert sorted(r["settings"]["policy"] for r in results_in(runs)) == finished
    (runs / "notes.json").write_text("{}")
    with pytest.raises(H2OStreamError, match="notes.json"):
        results_in(runs)


def test_a_ratio_needs_the_same_stream(board):
    from h2o_stream.apps.perplexity.leaderboard import leaderboard as rank
    from h2o_stream.apps.perplexity.report import results_in

    results = results_in(board / "runs")
    assert all(row["vs_sink"] is not None for row in rank(results)["sizes"][16]["rows"])
    for r in results:  # the same corpus, but one run fed fewer tokens: ranked, with no ratio between them
        if r["settings"]["policy"] == "h2o":
            r["stream_sha256"] = "f" * 64
    rows = {row["policy"]: row for row in rank(results)["sizes"][16]["rows"]}
    assert rows["h2o"]["vs_sink"] is None and rows["sink"]["vs_sink"] == 1.0


@pytest.mark.parametrize("inside", [False, True])
def test_out_inside_the_corpus_folder_is_refused(capsys, tmp_path, finished, inside):
    corpus = tmp_path / "books"
    corpus.mkdir()
    write_corpus(corpus / "corpus.jsonl")
    out = corpus / "board" if inside else corpus
    args = finished[1][:2] + ["--data", corpus, "--policy", "sink", "--cache-size", 16, "--tokens", 300]
    line = refused(capsys, *args, "--out", out)
    assert "inside the corpus" in line
    assert sorted(p.name for p in corpus.rglob("*")) == ["corpus.jsonl"]


def _damage_cases():
    text = {  # raw replacements of the text of h2o-16.json's fields (NaN / Infinity are not strict JSON)
        "ppl NaN": ('"ppl": PPL', '"ppl": NaN'),
        "ppl inf": ('"ppl": PPL', '"ppl": Infinity'),
        "ppl huge": ('"ppl": PPL', '"ppl": 1' + "0" * 400),
    }
    edits = {
        "ppl a string": lambda r: r.update(ppl="low"),
        "ppl 0": lambda r: r.update(ppl=0),
        "ppl missing": lambda r: r.pop("ppl"),
        "predicted_tokens missing": lambda r: r.pop("predicted_tokens"),
        "heavy missing": lambda r: r["settings"].pop("heavy"),
        "chunk_size missing": lambda r: r["settings"].pop("chunk_size"),
        "curve an int": lambda r: r.update(curve=3),
        "curve a string": lambda r: r.update(curve="up"),
        "curve negative": lambda r: r.update(curve=[[10, -2.0]]),
        "tokens_per_second null": lambda r: r.update(tokens_per_second=None),
        "policy a list": lambda r: r["settings"].update(policy=["h2o"]),
        "policy unknown": lambda r: r["settings"].update(policy="nope"),
    }
    return [pytest.param("text", v, id=k) for k, v in text.items()] + [
        pytest.param("edit", v, id=k) for k, v in edits.items()
    ]


@pytest.mark.parametrize("how, damage", _damage_cases())
@pytest.mark.parametrize("report_only", [True, False], ids=["report-only", "rerun"])
def test_a_damaged_result_is_one_error_naming_file_and_field(capsys, board, finished, how, damage, report_only):
    path = board / "runs" / "h2o-16.json"
    if how == "text":
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data).replace(damage[0].replace("PPL", json.dumps(data["ppl"])), damage[1]))
    else:
        edit(path, damage)
    runs_before = {p.name: p.read_bytes() for p in (board / "runs").iterdir()}
    args = ["--out", board, "--report-only"] if report_only else [*finished[1], "--out", board]
    line = refused(capsys, *args)
    assert "h2o-16.json" in line
    assert (board / "leaderboard.md").read_text() == "my notes\n"
    assert {p.name: p.read_bytes() for p in (board / "runs").iterdir()} == runs_before


def test_a_deeply_nested_result_and_a_fifo_are_refused(capsys, board):
    (board / "runs" / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    assert "deep.json" in refused(capsys, "--out", board, "--report-only")
    (board / "runs" / "deep.json").unlink()
    os.mkfifo(board / "runs" / "zz.json")  # would block a reader forever
    assert "not a regular file" in refused(capsys, "--out", board, "--report-only")
    assert (board / "leaderboard.md").read_text() == "my notes\n"


def test_a_json_file_that_is_no_result_keeps_the_users_leaderboard(capsys, board):
    (board / "runs" / "notes.json").write_text('{"todo": ["rerun tova"]}')
    line = refused(capsys, "--out", board, "--report-only")
    assert "notes.json" in line and "settings" in line
    assert (board / "leaderboard.md").read_text() == "my notes\n"


def test_report_only_refuses_options_it_would_ignore(capsys, board):
    line = refused(capsys, "--out", board, "--report-only", "--policy", "tova", "--model", "/nonexistent")
    assert "--policy" in line and "--model" in line and "ignored" in line
    assert (board / "leaderboard.md").read_text() == "my notes\n"


def test_a_policy_or_size_listed_twice_runs_once(capsys, tmp_path, finished):
    args = finished[1][:4] + ["--policy", "sink,sink", "--cache-size", "16,16", "--tokens", 300]
    code, stdout, stderr = leaderboard(capsys, *args, "--out", tmp_path / "b")
    assert code == 0, stderr
    assert "--policy lists sink more than once" in stderr and "--cache-size lists 16 more than once" in stderr
    assert stderr.count("== sink-16:") == 1 and stdout.count("| sink |") == 1
    assert sorted(p.name for p in (tmp_path / "b" / "runs").glob("*.json")) == ["sink-16.json", "summary.json"]


def test_full_is_the_reference_row(capsys, tmp_path, finished):
    args = finished[1][:4] + ["--policy", "full,sink", "--cache-size", "16", "--tokens", 300]
    code, stdout, stderr = leaderboard(capsys, *args, "--out", tmp_path / "b")
    assert code == 0, stderr
    board = json.loads((tmp_path / "b" / "leaderboard.json").read_text())
    full = json.loads((tmp_path / "b" / "runs" / "full.json").read_text())
    assert [row["policy"] for row in board["reference"]] == ["full"] and board["reference"][0]["ppl"] == full["ppl"]
    assert "| all | full |" in stdout and [r["policy"] for r in board["sizes"]["16"]["rows"]] == ["sink"]


def test_a_bad_ray_address_fails_before_the_model_loads(capsys, tmp_path, finished, monkeypatch):
    import h2o_stream.loading.models as models

    monkeypatch.setattr(models, "load_model", lambda **_: pytest.fail("the model was loaded"))
    for address in ("127.0.0.1:1", "nonsense"):
        line = refused(capsys, *finished[1], "--out", tmp_path / address.replace(":", "_"), "--ray", address)
        assert "Ray" in line


#: JSON values a hand edit or a damaged disk could leave in a field
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.text(max_size=5),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.just({}),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_randomly_damaged_results_never_give_a_traceback_or_replace_a_file(capsys, tmp_path_factory, finished, data):
    board = tmp_path_factory.mktemp("damaged") / "board"
    shutil.copytree(finished[0], board)
    (board / "leaderboard.md").write_text("my notes\n")
    path = board / "runs" / data.draw(st.sampled_from(["h2o-16.json", "sink-16.json"]))
    result = json.loads(path.read_text())
    how = data.draw(st.sampled_from(["truncate", "replace", "remove", "setting"]))
    if how == "truncate":
        text = json.dumps(result)
        path.write_text(text[: data.draw(st.integers(0, len(text) - 1))])
    else:
        target = result["settings"] if how == "setting" else result
        key = data.draw(st.sampled_from(sorted(target)))
        if how == "remove":
            del target[key]
        else:
            target[key] = data.draw(ODD)
        path.write_text(json.dumps(result))
    code, _, stderr = leaderboard(capsys, "--out", board, "--report-only")
    assert "Traceback" not in stderr
    if code == 0:  # the edit left a valid result (a field no report reads): the report is over valid results
        return
    assert code == 2 and path.name in stderr.strip().splitlines()[-1], stderr
    assert (board / "leaderboard.md").read_text() == "my notes\n"


def test_a_dollar_in_the_corpus_or_model_name_is_drawn_as_text(capsys, board, tmp_path):
    from h2o_stream.apps.perplexity.report import plot_curves, results_in

    for path in (board / "runs").glob("*-16.json"):
        edit(path, lambda r: r["settings"].update(data=r"books $\undefined^$ (local jsonl)", model="m$del"))
    code, _, stderr = leaderboard(capsys, "--out", board, "--report-only")
    assert code == 0, stderr
    assert (board / "leaderboard.md").read_text() != "my notes\n"
    assert all((board / name).stat().st_size > 0 for name in ("ppl_vs_cache.png", "windowed_ppl.png"))
    plot_curves(results_in(board / "runs"), tmp_path / "ppl.png", r"a $\undefined^$ title")
    assert (tmp_path / "ppl.png").stat().st_size > 0
