"""Quality: fair chunked mode against exact mode, and a real model streamed against its own forward. `quality gap`
reads `h2o-stream ppl` run folders, `quality runs` prints and runs (one at a time) the commands that made the
committed ones; only `quality equivalence` loads a model itself.

- quality gap: fair chunked mode against exact mode on the same stream, every policy. It reads run folders (one run
  per policy; exact mode in --exact-dir, the default fair chunks in --chunked-dir) and writes, per policy found in
  both: exact and chunked PPL over the same tokens (their streams' sha256 checked), the relative gap, its standard
  error, the chunk size and the keys the queries saw. `quality runs`: the runs it reads.
- quality equivalence: on a real model (Gemma 3 270M by default), a full cache streamed in chunks equals the model's
  own forward (mean NLL, sliding windows included) and chunked sink equals exact sink, per token.
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import click

from eval.common import (
    RESULTS,
    BadInput,
    command_line,
    corpus_of,
    new_figure,
    relative,
    run_commands,
    save_figure,
    scrub_command,
    write_result,
)

GAP_TARGET = 0.01
RUNS = RESULTS / "quality" / "runs"
#: head_hybrid's classes at cache 256 (chosen on books 1-20 by `h2o-stream calibrate`, not on the stream measured)
HEAD_CLASSES_256 = ["--retrieval-heads", str(RESULTS / "calibration" / "smollm2-256.json")]
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
    ("exact", "keyformer,cam", ["--exact", "--tokens", "20000"]),
    ("chunked", "keyformer,cam", ["--tokens", "20000"]),
    ("exact", "snapkv,pyramid,scissorhands", ["--exact", "--tokens", "20000", "--workers", "1"]),
    ("chunked", "snapkv,pyramid,scissorhands", ["--tokens", "20000", "--workers", "1"]),
    ("exact", "head_hybrid", ["--exact", "--tokens", "20000", *HEAD_CLASSES_256]),
    ("chunked", "head_hybrid", ["--tokens", "20000", *HEAD_CLASSES_256]),
)


@click.group()
def quality():
    """Fair chunks vs exact mode: the perplexity gap (parts: gap, runs, equivalence)."""


@quality.command()
@click.option(
    "--exact-dir",
    "exact_dirs",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    default=[str(RUNS / "exact")],
    show_default=True,
    help="Exact-mode runs (repeatable).",
)
@click.option(
    "--chunked-dir",
    type=click.Path(exists=True, file_okay=False),
    default=str(RUNS / "chunked"),
    show_default=True,
    help="Chunked runs of the same stream.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RESULTS / "quality" / "gap.json",
    show_default=True,
    help="JSON path; the PNG goes beside it.",
)
def gap(exact_dirs, chunked_dir, out):
    """The gap per policy, from run folders (no model): quality/gap.json."""
    from h2o_stream.apps.perplexity.report import cache_size, results_in

    exact = {r["settings"]["policy"]: r for d in exact_dirs for r in results_in(d)}
    chunked = {r["settings"]["policy"]: r for r in results_in(chunked_dir)}
    rows = gaps(exact, chunked)
    if not rows:
        raise BadInput(f"no policy has a run in both {', '.join(exact_dirs)} and {chunked_dir}")
    first = chunked[next(iter(rows))]
    report = {
        "benchmark": "fair chunked mode vs exact mode: the perplexity gap",
        "model": first["settings"]["model"],
        "data": corpus_of(first["settings"]),
        "cache_size": cache_size(first),
        "command": command_line(),
        "runs": {
            "exact": [relative(d) for d in exact_dirs],
            "chunked": relative(chunked_dir),
            "commands": sorted(
                {scrub_command(r["command"]) for name in rows for r in (exact[name], chunked[name]) if r.get("command")}
            ),
            "versions": [
                dict(v)
                for v in sorted(
                    {tuple(sorted(r.get("versions", {}).items())) for r in (*exact.values(), *chunked.values())}
                )
            ],
        },
        "targets": {"abs_relative_gap": GAP_TARGET},
        "gap": rows,
        "gap_note": "exact and chunked runs read the same stream (stream_sha256 checked); the standard error "
        "is over the intervals of their running-PPL curves",
    }
    for name, row in rows.items():
        print(
            f"{name:10s} C={row['chunk_size']:3d} gap {row['relative_gap']:+.2%} (standard error "
            f"{row['gap_standard_error'] or math.nan:.2%}) over {row['tokens']:,} tokens"
        )
    write_result(out, report, plot_gap)


def gaps(exact: dict[str, dict], chunked: dict[str, dict]) -> dict[str, dict]:
    """Per policy with a run in both (name -> `h2o-stream ppl` result): PPLs over the same tokens, the gap."""
    rows = {}
    for name in sorted(exact.keys() & chunked.keys()):
        e, c = exact[name], chunked[name]
        if e["stream_sha256"] != c["stream_sha256"]:
            raise BadInput(f"{name}: the exact and chunked runs read different streams")
        rows[name] = {
            "tokens": c["predicted_tokens"],
            "exact_ppl": e["ppl"],
            "chunked_ppl": c["ppl"],
            "relative_gap": c["ppl"] / e["ppl"] - 1,
            "gap_standard_error": gap_standard_error(e, c),
            "chunk_size": c["settings"]["chunk_size"],
            "wide_chunks": c["settings"].get("wide_chunks", True),
            "max_keys_seen_chunked": c.get("max_keys_seen"),
            "max_keys_seen_exact": e.get("max_keys_seen"),
        }
    return rows


def gap_standard_error(exact: dict, chunked: dict) -> float | None:
    """Standard error of the relative gap: the spread of the log-PPL difference between the two runs over the
    intervals between the points of their running-PPL curves (every ~curve_every predictions), over the square root
    of the number of intervals. A chunked run's points fall at forward boundaries, up to a chunk past the exact
    run's, so the i-th intervals are paired (the last, partial one left out). None with fewer than 3 intervals."""
    # strict=False: nothing makes the two curves the same length, and a shorter one just pairs fewer intervals
    pairs = list(zip(_intervals(exact["curve"]), _intervals(chunked["curve"]), strict=False))[:-1]
    differences = [c - e for e, c in pairs]
    if len(differences) < 3:
        return None
    return statistics.stdev(differences) / math.sqrt(len(differences))


def _intervals(curve: list) -> list[float]:
    """Mean NLL between consecutive points of a running-PPL curve [(predictions, running PPL), ...]."""
    totals = [(0, 0.0)] + [(n, n * math.log(ppl)) for n, ppl in curve]
    return [(b - a) / (m - n) for (n, a), (m, b) in itertools.pairwise(totals)]


def plot_gap(report: dict, path: Path) -> None:
    rows = report["gap"]
    names = list(rows)
    fig, ax = new_figure(size=(max(4.0, 0.7 * len(names) + 2), 3.6))
    ax.bar(
        names,
        [100 * rows[n]["relative_gap"] for n in names],
        color="#4c72b0",
        capsize=3,
        yerr=[100 * (rows[n]["gap_standard_error"] or 0) for n in names],
    )
    for sign in (1, -1):
        ax.axhline(sign * 100 * report["targets"]["abs_relative_gap"], color="red", linestyle="--")
    ax.set_xticks(range(len(names)), [f"{n}\nC={rows[n]['chunk_size']}" for n in names], fontsize=8)
    ax.set_ylabel("chunked PPL / exact PPL - 1 (%)")
    tokens = sorted({row["tokens"] for row in rows.values()})
    save_figure(
        fig,
        path,
        f"{report['model']}, cache {report['cache_size']}, {', '.join(f'{t:,}' for t in tokens)} "
        "tokens: fair chunks vs exact mode, ± standard error",
    )


@quality.command()
@click.option("--data", required=True, help="The corpus the runs read (the committed ones: gutenberg_pre1919.jsonl).")
@click.option("--only", default=None, help="Only these folders under the runs folder, comma-separated.")
@click.option("--dry-run", is_flag=True, help="Print the commands only.")
def runs(data, only, dry_run):
    """The `h2o-stream ppl` runs the gaps read, one after another (hours: exact mode is slow)."""
    folders = list(dict.fromkeys(folder for folder, _, _ in PPL_RUNS))
    chosen = None if only is None else set(only.split(","))
    unknown = sorted((chosen or set()) - set(folders))
    if unknown:
        raise BadInput(f"--only: no runs folder {', '.join(unknown)} (the folders: {', '.join(folders)})")
    commands = [
        [
            "h2o-stream",
            "ppl",
            "--data",
            data,
            "--policy",
            policies,
            *options,
            "--cache-size",
            "256",
            "--threads",
            "1",
            "--resume",
            "--out",
            str(RUNS / folder),
        ]
        for folder, policies, options in PPL_RUNS
        if chosen is None or folder in chosen
    ]
    run_commands(commands, dry_run)


EQUIVALENCE_TARGET = 1e-4  # mean NLL (full cache) and per-token NLL (sinks), in nats


@quality.command()
@click.option("--model", "model_spec", default="gemma3-270m", show_default=True)
@click.option("--data", default="sample", show_default=True, help="The corpus whose first tokens are read.")
@click.option("--tokens", default=2048, show_default=True)
@click.option("--chunk", default=256, show_default=True, help="Tokens per forward of the streamed runs.")
@click.option("--cache-size", default=256, show_default=True, help="The sink cache's budget.")
@click.option("--threads", default=2, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RESULTS / "models" / "gemma3_equivalence.json",
    show_default=True,
)
def equivalence(model_spec, data, tokens, chunk, cache_size, threads, out):
    """Full cache in chunks = the model's forward; chunked sink = exact sink (models/gemma3_equivalence.json)."""
    from eval.common import corpus_record, corpus_tokens, environment, load_model, setup

    setup(threads)
    loaded = load_model(model_spec)
    ids = corpus_tokens(loaded.tokenizer, tokens, data).unsqueeze(0)
    measured = equivalence_measures(loaded.model, ids, chunk, cache_size)
    config = loaded.model.config.get_text_config(decoder=True)
    report = {
        "benchmark": "a full cache streamed in chunks against the model's own forward; chunked sink against exact sink",
        "model": loaded.name,
        "data": corpus_record(data),
        "tokens": tokens,
        "chunk": chunk,
        "cache_size": cache_size,
        "layer_types": sorted(set(getattr(config, "layer_types", None) or ["full_attention"])),
        "sliding_window": getattr(config, "sliding_window", None),
        "targets": {"nll": EQUIVALENCE_TARGET},
        **measured,
        "versions": environment(),
    }
    write_result(out, report, plot_equivalence)


def equivalence_measures(model, ids, chunk: int, cache_size: int) -> dict:
    """Per-token NLL of `ids` (1, T) from the model's own forward, a full StreamingCache fed `chunk` tokens per
    forward, and sink caches of `cache_size` in exact mode and in chunks: their differences and the seconds each
    took."""
    import time

    import torch

    from h2o_stream import StreamingCache, make_policy

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="none")

    def streamed(cache, width):
        with torch.no_grad():
            return torch.cat(
                [model(ids[:, s : s + width], cache=cache).logits for s in range(0, ids.shape[1], width)], dim=1
            )

    runs, seconds = {}, {}
    for name, run in (
        ("forward", lambda: model(ids).logits),
        ("full_chunked", lambda: streamed(StreamingCache(model, make_policy("full")), chunk)),
        ("sink_exact", lambda: streamed(StreamingCache(model, make_policy("sink", cache_size)), 1)),
        ("sink_chunked", lambda: streamed(StreamingCache(model, make_policy("sink", cache_size)), chunk)),
    ):
        start = time.perf_counter()
        with torch.no_grad():
            runs[name] = nll(run())
        seconds[name] = time.perf_counter() - start
    return {
        "mean_nll": {name: values.mean().item() for name, values in runs.items()},
        "full_vs_forward": {
            "mean_nll_difference": (runs["full_chunked"].mean() - runs["forward"].mean()).item(),
            "max_token_difference": (runs["full_chunked"] - runs["forward"]).abs().max().item(),
        },
        "sink_chunked_vs_exact": {
            "max_token_difference": (runs["sink_chunked"] - runs["sink_exact"]).abs().max().item(),
            "mean_nll_difference": (runs["sink_chunked"].mean() - runs["sink_exact"].mean()).item(),
        },
        "seconds": seconds,
    }


def plot_equivalence(report: dict, path: Path) -> None:
    pairs = {
        "full cache in chunks\n− own forward (mean)": abs(report["full_vs_forward"]["mean_nll_difference"]),
        "full cache in chunks\n− own forward (max token)": report["full_vs_forward"]["max_token_difference"],
        "chunked sink\n− exact sink (max token)": report["sink_chunked_vs_exact"]["max_token_difference"],
    }
    fig, ax = new_figure(size=(6.4, 3.6))
    ax.bar(list(pairs), [max(v, 1e-12) for v in pairs.values()], color="#4c72b0")
    ax.axhline(report["targets"]["nll"], color="red", linestyle="--")
    ax.set_yscale("log")
    ax.set_ylabel("|NLL difference| (nats)")
    ax.tick_params(axis="x", labelsize=8)
    save_figure(
        fig,
        path,
        f"{report['model']}, {report['tokens']:,} tokens, chunks of {report['chunk']}, "
        f"sink cache {report['cache_size']}",
    )
