"""A damaged on-disk cache of the compiled exact-mode loop (numba's index and data files) is recovered from: the run
goes on with the same numbers, says so once, and the next run finds a good cache again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
sys.path.insert(0, {tests!r})
from support.tiny_models import random_ids, tiny_model
from h2o_stream import StreamingCache, make_policy
model = tiny_model("llama")
cache = StreamingCache(model, make_policy("h2o", 16), decide_every=1)
with torch.no_grad():
    logits = model(random_ids(40), cache=cache).logits
print(repr(float(logits.double().sum())))
"""


def run_probe(cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "H2O_STREAM_COMPILED": "1"}
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(tests=str(TESTS))], env=env, capture_output=True, text=True, timeout=300
    )


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(b"\x80 not a pickle at all " * 8)
    elif how == "emptied":
        path.write_bytes(b"")
    else:  # bytes flipped all through the file
        path.write_bytes(bytes(b ^ 0xFF if i % 97 == 5 else b for i, b in enumerate(data)))


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory):
    """A cache directory the loop was compiled into, and the logits' sum it gave."""
    cache_dir = tmp_path_factory.mktemp("numba")
    first = run_probe(cache_dir)
    assert first.returncode == 0, first.stderr
    assert list(cache_dir.rglob("*.nbi")) and list(cache_dir.rglob("*.nbc")), "the loop was not cached on disk"
    return cache_dir, first.stdout.strip()


@pytest.mark.parametrize("target, how", [("nbi", "garbage"), ("nbi", "emptied"), ("nbc", "flipped")])
def test_a_damaged_cache_is_cleared_and_the_loop_compiled_afresh(good_cache, tmp_path, target, how):
    source, expected = good_cache
    cache_dir = tmp_path / "numba"
    subprocess.run(["cp", "-r", str(source), str(cache_dir)], check=True)
    for path in cache_dir.rglob(f"*.{target}"):
        damage(path, how)
    damaged = run_probe(cache_dir)
    assert damaged.returncode == 0, damaged.stderr
    assert damaged.stdout.strip() == expected
    assert damaged.stderr.count("cache on disk could not be read") == 1, damaged.stderr
    again = run_probe(cache_dir)  # the cache written afresh is good
    assert again.returncode == 0 and again.stdout.strip() == expected
    assert "could not be read" not in again.stderr
