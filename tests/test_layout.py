"""The repository's shape: one-way layers (import-linter), no import cycle, and nothing that points outside the
repository. Modules are split by concept, not by a line count."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_layers_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is part of the test extra"
    run = subprocess.run([lint], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_no_module_imports_itself_through_a_cycle():
    graph = grimp.build_graph("h2o_stream")
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            # A package's __init__ importing its own submodules (re-exports) is not a cycle of the code.
            if imported.startswith(module + ".") or module.startswith(imported + "."):
                continue
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append(f"{module} -> {imported} -> ... -> {module}")
    assert not cycles, "\n".join(cycles)


OUTSIDE = re.compile(r"\.\./shared|/work/|shared/data|/tmp/h2o|the guide\b|issue #\d")


@pytest.mark.parametrize("where", ["README.md", "docs", "h2o_stream", "tests", "eval", ".ci", "pyproject.toml"])
def test_nothing_points_outside_the_repository(where):
    root = REPO / where
    files = (
        [root]
        if root.is_file()
        else [p for p in root.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".sh", ".toml", ""}]
    )
    hits = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in files
        if p != Path(__file__)
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)
