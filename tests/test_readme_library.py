"""README.md's "Library" example, run as written: its cache evicts and holds its size, the text it wrote is decoded,
its perplexity covers the sample's first 2,048 tokens; on the real default model (slow) it prints exactly the output
the README shows."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
SEEN = re.compile(r"^seen (\d+) tokens, kept (\d+) entries per layer and KV head$", re.MULTILINE)
PPL = re.compile(r"^PPL ([\d.]+) over (\d+) predicted tokens$", re.MULTILINE)


def library_section() -> tuple[str, str]:
    """The section's Python block and the output block that follows it."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("\n## Library\n") :]
    section = section[: section.index("\n## ", 1)]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    shown = re.search(r"```text\n(.*?)```", section, re.DOTALL)
    assert code and shown and code.end() < shown.start(), "the section shows its code, then what it prints"
    return code[1], shown[1]


def run(code: str) -> tuple[str, dict]:
    """What `code` prints, and its names after it ran."""
    names: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), names)
    return printed.getvalue(), names


def test_the_library_example_evicts_holds_its_size_decodes_and_measures_the_sample(model_dir):
    code, _ = library_section()
    assert code.count("load_model()") == 1
    printed, names = run(code.replace("load_model()", f"load_model({str(model_dir)!r})"))  # the tiny model
    generated = names["lm"].tokenizer.decode(names["out"][0, names["ids"].shape[1] :], skip_special_tokens=True)
    assert isinstance(generated, str) and printed.startswith(generated + "\n")
    caches = SEEN.findall(printed)
    assert len(caches) == 2
    for seen, kept in caches:
        assert int(seen) > 64 and int(kept) == 64  # a stream longer than the cache, which keeps its size
    assert names["cache"].seen > 64 and names["cache"].slots == 64 and names["cache"].evicted > 0
    (ppl, predicted), *_ = PPL.findall(printed)
    assert int(predicted) == 2047 and math.isfinite(float(ppl)) and float(ppl) > 1


@pytest.mark.slow
def test_the_library_example_prints_what_the_readme_shows_on_the_default_model():
    code, shown = library_section()
    printed, _ = run(code)
    assert printed == shown
