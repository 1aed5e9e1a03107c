"""`python -m eval coverage`: the figure per package, from a measured run's data (the main file and its subprocesses'
parallel files), and the README block rendered from it."""

from __future__ import annotations

import json
from pathlib import Path

import coverage
import pytest

import h2o_stream.errors
import h2o_stream.version
from eval.__main__ import main
from eval.coverage.report import package_of, per_package, percent

ERRORS, VERSION = Path(h2o_stream.errors.__file__), Path(h2o_stream.version.__file__)


def first_statement(path: Path) -> int:
    return coverage.Coverage(data_file=None).analysis2(str(path))[1][0]


def write_data(path: Path, lines: dict[Path, list[int]], suffix: str | None = None) -> None:
    """A coverage data file as a measured run leaves it (`suffix`: a subprocess's parallel file)."""
    data = coverage.CoverageData(basename=str(path), suffix=suffix)
    data.add_lines({str(file): numbers for file, numbers in lines.items()})
    data.write()


def test_packages_are_the_folders_of_h2o_stream():
    assert package_of("/x/h2o_stream/engine/policies/h2o.py") == "h2o_stream.engine.policies"
    assert package_of("h2o_stream/errors.py") == "h2o_stream"
    files = {
        "h2o_stream/engine/a.py": {
            "summary": {"num_statements": 10, "covered_lines": 7, "num_branches": 4, "covered_branches": 1}
        },
        "h2o_stream/engine/b.py": {"summary": {"num_statements": 5, "covered_lines": 5}},
        "h2o_stream/apps/__init__.py": {"summary": {"num_statements": 0, "covered_lines": 0}},
    }
    packages = per_package(files)
    assert list(packages) == ["h2o_stream.engine"]  # an empty __init__.py is no package of its own
    engine = packages["h2o_stream.engine"]
    assert engine == {"statements": 15, "covered_lines": 12, "branches": 4, "covered_branches": 1}
    assert percent(engine) == pytest.approx(100 * 13 / 19)


def test_the_parallel_files_of_subprocesses_are_combined_into_the_main_data_never_over_it(tmp_path):
    data = tmp_path / ".coverage"
    write_data(data, {ERRORS: [first_statement(ERRORS)]})
    write_data(data, {VERSION: [first_statement(VERSION)]}, suffix="host.pid1.abc")  # a subprocess's measurement
    out = tmp_path / "coverage.json"
    with pytest.raises(SystemExit) as done:
        main(["coverage", "--data-file", str(data), "--out", str(out)])
    assert done.value.code == 0
    first = json.loads(out.read_text())
    assert first["packages"]["h2o_stream"]["covered_lines"] == 2  # one line of each file: neither run was lost
    assert not list(tmp_path.glob(".coverage.*"))  # combined, once
    with pytest.raises(SystemExit):
        main(["coverage", "--data-file", str(data), "--out", str(out)])
    assert json.loads(out.read_text())["packages"] == first["packages"]  # reading again changes nothing


def test_no_data_is_one_error_line_and_exit_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["coverage", "--data-file", str(tmp_path / ".coverage")])
    assert done.value.code == 2
    assert "no coverage data at" in capsys.readouterr().err
