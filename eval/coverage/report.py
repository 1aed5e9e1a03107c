"""`python -m eval coverage`: the test suite's coverage of h2o_stream, per package (lines and branches).

It reads the data a measured run left (`python -m pytest -q --cov`, as `.ci/run` runs it; the CLI's subprocesses are
measured too, see [tool.coverage.run] in pyproject.toml), prints one line per package and the total, and with
`--out` writes them as JSON for the README's tests section (`python -m eval render`).
"""

from __future__ import annotations

import datetime
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import click

from eval.common import BadInput, command_line

FIELDS = ("statements", "covered_lines", "branches", "covered_branches")


def package_of(path: str) -> str:
    """The dotted package a measured file belongs to (h2o_stream/engine/policies/h2o.py: h2o_stream.engine.policies)."""
    parts = Path(path).parts
    start = parts.index("h2o_stream") if "h2o_stream" in parts else 0
    return ".".join(parts[start:-1]) or parts[-1]


def per_package(files: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Sum coverage.py's per-file summaries (its JSON report's `files`) by package."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for path, entry in files.items():
        summary = entry["summary"]
        if not summary["num_statements"]:  # an empty __init__.py: no package of its own
            continue
        package = totals[package_of(path)]
        package["statements"] += summary["num_statements"]
        package["covered_lines"] += summary["covered_lines"]
        package["branches"] += summary.get("num_branches", 0)
        package["covered_branches"] += summary.get("covered_branches", 0)
    return dict(sorted(totals.items()))


def total_of(packages: dict[str, dict[str, int]]) -> dict[str, int]:
    """The counts of all `packages` together."""
    return {field: sum(p[field] for p in packages.values()) for field in FIELDS}


def percent(counts: dict[str, int]) -> float:
    """Lines and branches together, as coverage.py counts its total: covered / (statements + branches)."""
    whole = counts["statements"] + counts["branches"]
    return 100.0 * (counts["covered_lines"] + counts["covered_branches"]) / whole if whole else 100.0


def read_report(data_file: Path) -> dict[str, dict]:
    """coverage.py's per-file JSON summaries of `data_file`, the parallel files beside it (subprocesses that no
    `coverage combine` has merged yet) combined into it first."""
    import coverage

    parallel = list(data_file.parent.glob(data_file.name + ".*"))
    if not data_file.exists() and not parallel:
        raise BadInput(f"no coverage data at {data_file}: run `python -m pytest -q --cov` first")
    cov = coverage.Coverage(data_file=str(data_file))
    if parallel:
        cov.load()  # first: combining merges into what is loaded, and saving would otherwise drop data_file's data
        cov.combine(keep=False)
        cov.save()
    cov.load()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "coverage.json"
        cov.json_report(outfile=str(out), ignore_errors=True)
        return json.loads(out.read_text())["files"]


def lines_of(packages: dict[str, dict[str, int]]) -> list[str]:
    """The table printed: package, lines covered, branches covered, the figure."""
    total = total_of(packages)
    rows = [(name, p) for name, p in packages.items()] + [("total", total)]
    width = max(len(name) for name, _ in rows)
    return [
        f"{name:<{width}}  lines {p['covered_lines']:>5}/{p['statements']:<5}  "
        f"branches {p['covered_branches']:>4}/{p['branches']:<4}  {percent(p):5.1f}%"
        for name, p in rows
    ]


@click.command()
@click.option(
    "--data-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path(".coverage"),
    show_default=True,
    help="coverage.py's data file (the parallel .coverage.* beside it are combined in).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the figures as JSON (eval/results/coverage/coverage.json is the committed one).",
)
def coverage(data_file: Path, out: Path | None) -> None:
    """Print the coverage of h2o_stream per package, from a measured test run."""
    packages = per_package(read_report(data_file))
    if not packages:
        raise BadInput(f"{data_file} measured no file of h2o_stream")
    for line in lines_of(packages):
        click.echo(line)
    if out is not None:
        import coverage as coverage_py

        from h2o_stream.files import write_json

        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(
            out,
            {
                "benchmark": "coverage",
                "packages": packages,
                "total": total_of(packages),
                "measured_with": "python -m pytest -q --cov (the README's test command, measured)",
                "coverage_py": coverage_py.__version__,
                "command": command_line(),
                "date": datetime.date.today().isoformat(),
            },
        )
        click.echo(f"wrote {out}", err=True)
