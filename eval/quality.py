"""Quality: fair chunked mode against exact mode on the same stream, every policy: the perplexity gap.

`gap` reads `h2o-stream ppl` run folders (one run per policy; exact mode in --exact-dir, the default fair chunks in
--chunked-dir) and writes, per policy found in both: exact and chunked PPL over the same tokens (their streams'
sha256 checked), the relative gap, its standard error, the chunk size and the keys the queries saw. No model is
loaded. `runs` prints or runs the `h2o-stream ppl` commands that made the committed run folders.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import click

from eval.common import (KNOWN_CORPORA, RESULTS, environment, new_figure, run_commands, save_figure,
                         scrub_command, write_result)
from h2o_stream.apps.perplexity.report import cache_size, results_in

GAP_TARGET = 0.01
RUNS = RESULTS / "quality" / "runs"
#: the committed run folders under RUNS: (folder, policies, options besides --data, --cache-size 256, --threads 1,
#: --resume), in the order they were made
PPL_RUNS = (
    ("exact", "tova,h2o,a2sf,sepllm,keydiff,h2o_sinks,roco", ["--exact", "--tokens", "20000"]),
    ("chunked", "h2o,sink,window,a2sf,h2o_sinks,sepllm,keydiff", ["--tokens", "20000"]),
    ("chunked", "roco", ["--tokens", "20000", "--chunk-size", "8"]),  # roco's default chunk then (now exact mode)
    ("chunked-c64", "tova,h2o,a2sf,h2o_sinks,sepllm,keydiff", ["--tokens", "20000", "--chunk-size", "64"]),
    ("chunked-c16", "tova,roco", ["--tokens", "20000", "--chunk-size", "16"]),
    ("chunked-c8", "tova,roco", ["--tokens", "20000", "--chunk-size", "8"]),
    ("h2o-60k/exact", "h2o", ["--exact", "--tokens", "60000"]),
    ("h2o-60k/chunked", "h2o", ["--tokens", "60000"]),
    ("tova-60k/exact", "tova", ["--exact", "--tokens", "60000"]),
    ("tova-60k/chunked", "tova", ["--tokens", "60000", "--chunk-size", "16"]),  # tova's default chunk then
)


@click.group()
def quality():
    """Fair chunks vs exact mode: the perplexity gap (parts: gap, runs)."""


@quality.command()
@click.option("--exact-dir", "exact_dirs", multiple=True, type=click.Path(exists=True, file_okay=False),
              default=[str(RUNS / "exact")], show_default=True, help="Exact-mode runs (repeatable).")
@click.option("--chunked-dir", type=click.Path(exists=True, file_okay=False), default=str(RUNS / "chunked"),
              show_default=True, help="Chunked runs of the same stream.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS / "quality" / "gap.json",
              show_default=True, help="JSON path; the PNG goes beside it.")
def gap(exact_dirs, chunked_dir, out):
    """The gap per policy, from run folders (no model): quality/gap.json."""
    exact = {r["settings"]["policy"]: r for d in exact_dirs for r in results_in(d)}
    chunked = {r["settings"]["policy"]: r for r in results_in(chunked_dir)}
    rows = gaps(exact, chunked)
    if not rows:
        raise click.ClickException(f"no policy has a run in both {', '.join(exact_dirs)} and {chunked_dir}")
    first = chunked[next(iter(rows))]
    report = {"benchmark": "fair chunked mode vs exact mode: the perplexity gap", "model": first["settings"]["model"],
              "data": corpus_of(first["settings"]), "cache_size": cache_size(first),
              "environment": environment(),
              "runs": {"exact": list(exact_dirs), "chunked": chunked_dir,
                       "commands": sorted({scrub_command(r["command"]) for name in rows
                                           for r in (exact[name], chunked[name]) if r.get("command")}),
                       "versions": [dict(v) for v in sorted({tuple(sorted(r.get("versions", {}).items()))
                                                             for r in (*exact.values(), *chunked.values())})]},
              "targets": {"abs_relative_gap": GAP_TARGET}, "gap": rows,
              "gap_note": "exact and chunked runs read the same stream (stream_sha256 checked); the standard error "
                          "is over the intervals of their running-PPL curves"}
    for name, row in rows.items():
        print(f"{name:10s} C={row['chunk_size']:3d} gap {row['relative_gap']:+.2%} (standard error "
              f"{row['gap_standard_error'] or math.nan:.2%}) over {row['tokens']:,} tokens")
    write_result(out, report, plot_gap)


def gaps(exact: dict[str, dict], chunked: dict[str, dict]) -> dict[str, dict]:
    """Per policy with a run in both (name -> `h2o-stream ppl` result): PPLs over the same tokens, the gap."""
    rows = {}
    for name in sorted(exact.keys() & chunked.keys()):
        e, c = exact[name], chunked[name]
        if e["stream_sha256"] != c["stream_sha256"]:
            raise click.ClickException(f"{name}: the exact and chunked runs read different streams")
        rows[name] = {"tokens": c["predicted_tokens"], "exact_ppl": e["ppl"], "chunked_ppl": c["ppl"],
                      "relative_gap": c["ppl"] / e["ppl"] - 1, "gap_standard_error": gap_standard_error(e, c),
                      "chunk_size": c["settings"]["chunk_size"], "wide_chunks": c["settings"].get("wide_chunks", True),
                      "max_keys_seen_chunked": c.get("max_keys_seen"), "max_keys_seen_exact": e.get("max_keys_seen")}
    return rows


def gap_standard_error(exact: dict, chunked: dict) -> float | None:
    """Standard error of the relative gap: the spread of the log-PPL difference between the two runs over the
    intervals between the points of their running-PPL curves (every ~curve_every predictions), over the square root
    of the number of intervals. A chunked run's points fall at forward boundaries, up to a chunk past the exact
    run's, so the i-th intervals are paired (the last, partial one left out). None with fewer than 3 intervals."""
    pairs = list(zip(_intervals(exact["curve"]), _intervals(chunked["curve"])))[:-1]
    differences = [c - e for e, c in pairs]
    if len(differences) < 3:
        return None
    return statistics.stdev(differences) / math.sqrt(len(differences))


def _intervals(curve: list) -> list[float]:
    """Mean NLL between consecutive points of a running-PPL curve [(predictions, running PPL), ...]."""
    totals = [(0, 0.0)] + [(n, n * math.log(ppl)) for n, ppl in curve]
    return [(b - a) / (m - n) for (n, a), (m, b) in zip(totals, totals[1:])]


def corpus_of(settings: dict) -> dict:
    """The corpus of a `h2o-stream ppl` result as the suites record one: name, what it is, bytes, sha256."""
    described, sha = settings.get("data", ""), settings.get("data_sha256")
    name = described.split(":")[0] if described.startswith("sample:") else described.rsplit(" (", 1)[0]
    return {"name": name, "description": KNOWN_CORPORA.get(sha) or described, "bytes": settings.get("data_bytes"),
            "sha256": sha}


def plot_gap(report: dict, path: Path) -> None:
    rows = report["gap"]
    names = list(rows)
    fig, ax = new_figure(size=(max(4.0, 0.7 * len(names) + 2), 3.6))
    ax.bar(names, [100 * rows[n]["relative_gap"] for n in names], color="#4c72b0", capsize=3,
           yerr=[100 * (rows[n]["gap_standard_error"] or 0) for n in names])
    for sign in (1, -1):
        ax.axhline(sign * 100 * report["targets"]["abs_relative_gap"], color="red", linestyle="--")
    ax.set_xticks(range(len(names)), [f"{n}\nC={rows[n]['chunk_size']}" for n in names], fontsize=8)
    ax.set_ylabel("chunked PPL / exact PPL - 1 (%)")
    tokens = sorted({row["tokens"] for row in rows.values()})
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, {', '.join(f'{t:,}' for t in tokens)} "
                           "tokens: fair chunks vs exact mode, ± standard error")


@quality.command()
@click.option("--data", required=True, help="The corpus the runs read (the committed ones: gutenberg_pre1919.jsonl).")
@click.option("--only", default=None, help="Only these folders under the runs folder, comma-separated.")
@click.option("--dry-run", is_flag=True, help="Print the commands only.")
def runs(data, only, dry_run):
    """The `h2o-stream ppl` runs the gaps read, one after another (hours: exact mode is slow)."""
    chosen = None if only is None else set(only.split(","))
    commands = [["h2o-stream", "ppl", "--data", data, "--policy", policies, *options, "--cache-size", "256",
                 "--threads", "1", "--resume", "--out", str(RUNS / folder)]
                for folder, policies, options in PPL_RUNS if chosen is None or folder in chosen]
    run_commands(commands, dry_run)
