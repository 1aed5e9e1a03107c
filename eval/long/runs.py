"""The suites that run `h2o-stream` over the corpus and report on its run folders: leaderboard and long.

- leaderboard: every policy at cache 128, 256 and 512 over one stream (`h2o-stream leaderboard`).
- long fair / fair_gemma3 / 4m: the long runs (`h2o-stream ppl --resume` continues them), then their report.
  `long report DIR` reads the results in DIR and writes DIR/report.json and DIR/figure5.png: running PPL and PPL per
  window against tokens, every policy against sinks at the same cache size (over the predictions both runs have
  made), and resident memory late in the stream against early (~50k tokens into the run's last process, where the
  result records its processes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from eval.common import (
    RESULTS,
    BadInput,
    command_line,
    corpus_of,
    new_figure,
    run_commands,
    save_figure,
    scrub_command,
    write_result,
)

EARLY_RSS_AT = 50_000  # compare late RSS with the first sample at or after this many tokens
#: the long runs as committed: folder -> (the `h2o-stream ppl` runs, each as its options, the report's window)
LONG_RUNS = {
    "fair": (
        "long_fair",
        [
            ["--cache-size", "256", "--policy", "sink,sepllm,h2o", "--tokens", "1048576"],
            ["--cache-size", "128,512", "--policy", "sink,h2o", "--tokens", "1048576"],
            ["--cache-size", "256", "--policy", "cam", "--tokens", "1048576"],
            # the new policies' best two at 256 on the 250k leaderboard: cam, then snapkv
            ["--cache-size", "256", "--policy", "snapkv", "--tokens", "1048576", "--checkpoint-every", "10000"],
        ],
        100_000,
    ),
    "fair_gemma3": (
        "long_fair_gemma3",
        [
            ["--model", "gemma3-270m", "--cache-size", "256", "--policy", "sink,h2o,cam,sepllm"]
            + ["--tokens", "1048576", "--checkpoint-every", "10000"],
        ],
        100_000,
    ),
    "4m": ("long_4m", [["--cache-size", "256", "--policy", "sink,h2o", "--tokens", "4000000"]], 200_000),
}
data_required = click.option("--data", required=True, help="The corpus (the committed runs: gutenberg_pre1919.jsonl).")
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the commands only.")


@click.command()
@data_required
@click.option("--model", "model_spec", default=None, help="Another model: write its board to its own folder.")
@click.option("--tokens", default=250_000, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option(
    "--out",
    default=str(RESULTS / "leaderboard"),
    show_default=True,
    help="The board's folder (eval/results/leaderboard*/ are all rendered).",
)
@dry_run_option
def leaderboard(data, model_spec, tokens, workers, out, dry_run):
    """Every policy at cache 128, 256 and 512 over one stream (`h2o-stream leaderboard`; reruns continue)."""
    model = ["--model", model_spec] if model_spec else []
    run_commands(
        [
            [
                "h2o-stream",
                "leaderboard",
                "--data",
                data,
                *model,
                "--tokens",
                str(tokens),
                "--workers",
                str(workers),
                "--out",
                out,
            ]
        ],
        dry_run,
    )


@click.group()
def long():
    """The long fair-chunk runs (parts: fair, fair_gemma3, 4m, report)."""


def _runs_part(name: str):
    folder, runs, window = LONG_RUNS[name]

    @data_required
    @click.option("--workers", default=2, show_default=True)
    @dry_run_option
    def part(data, workers, dry_run):
        out = RESULTS / folder
        run_commands(
            [
                [
                    "h2o-stream",
                    "ppl",
                    "--data",
                    data,
                    *options,
                    "--threads",
                    "1",
                    "--workers",
                    str(workers),
                    "--resume",
                    "--out",
                    str(out),
                ]
                for options in runs
            ],
            dry_run,
        )
        if not dry_run:
            write_report(out, window)

    part.__doc__ = f"The runs in {RESULTS / folder} (--resume: continues where they stopped), then their report."
    return long.command(name)(part)


for _name in LONG_RUNS:
    _runs_part(_name)


@long.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--window", default=50_000, show_default=True, help="Tokens per window of the windowed PPL panel.")
def report(run_dir, window):
    """RUN_DIR/report.json and figure5.png from the runs in RUN_DIR (no model)."""
    write_report(run_dir, window)


def write_report(run_dir: Path, window: int) -> dict:
    """Read the run results in `run_dir`, write its report.json and figure5.png, return the report."""
    named = {p.stem: json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("*-*.json"))}
    named = {name: r for name, r in named.items() if "curve" in r}
    if not named:
        raise BadInput(f"no run results (<policy>-<size>.json) in {run_dir}")
    report = {"window": window, "runs": {}, "vs_sink": {}, "command": command_line()}
    for name, r in named.items():
        report["runs"][name] = {
            "tokens": r["tokens_fed"],
            "ppl": r["ppl"],
            "tokens_per_second": r["tokens_per_second"],
            "windows": windows(r["curve"], window),
            "rss": rss_growth(r),
            "command": scrub_command(r["command"]) if r.get("command") else None,
            "versions": r.get("versions"),
            "model": r["settings"].get("model"),
            "data": corpus_of(r["settings"]),
        }
    curves = {name: dict(r["curve"]) for name, r in named.items()}
    for name in report["runs"]:
        policy, size = name.rsplit("-", 1)
        sink = f"sink-{size}"
        if policy != "sink" and sink in curves:
            common = max(set(curves[name]) & set(curves[sink]), default=None)  # runs may have stopped apart
            if common:
                own_windows, sink_windows = (
                    windows([c for c in named[n]["curve"] if c[0] <= common], window) for n in (name, sink)
                )
                report["vs_sink"][name] = {
                    "predicted_tokens": common,
                    "ppl": curves[name][common],
                    "sink_ppl": curves[sink][common],
                    "ppl_ratio": curves[name][common] / curves[sink][common],
                    "windows_lower_than_sink": sum(  # strict=False: the two runs' curves may end apart
                        h < k for (_, h), (_, k) in zip(own_windows, sink_windows, strict=False)
                    ),
                    "windows_compared": len(own_windows),
                }
    for name, cmp in report["vs_sink"].items():
        print(
            f"{name}: over the first {cmp['predicted_tokens']:,} predictions PPL {cmp['ppl']:.3f}, sink "
            f"{cmp['sink_ppl']:.3f} (ratio {cmp['ppl_ratio']:.4f}); lower than sink in "
            f"{cmp['windows_lower_than_sink']} of {cmp['windows_compared']} windows"
        )
    write_result(
        Path(run_dir) / "report.json",
        report,
        lambda rep, path: plot(rep, list(named.values()), path),
        figure=Path(run_dir) / "figure5.png",
    )
    return report


def windows(curve: list, width: int) -> list[tuple[int, float]]:
    """(end, PPL over the window) from a running-PPL curve [(predicted, running ppl), ...]."""
    points, out, last_n, last_sum = [], [], 0, 0.0
    for n, ppl in curve:
        points.append((n, n * math.log(ppl)))  # cumulative NLL
    for n, nll_sum in points:
        if n - last_n >= width or n == points[-1][0]:
            if n > last_n:
                out.append((n, math.exp((nll_sum - last_sum) / (n - last_n))))
            last_n, last_sum = n, nll_sum
    return out


def rss_growth(result: dict) -> dict | None:
    """Resident memory late in the run against early: within the run's last process when the result says where its
    processes began (`process_starts`; the early sample then is the first at or after EARLY_RSS_AT tokens of that
    process), else over the samples as they are, which may come from several processes (`within_one_process`
    False)."""
    samples, starts = result["rss_samples"], result.get("process_starts")
    start = starts[-1] if starts else 0
    own = [(p, r) for p, r in samples if p > start] if starts else samples
    early = next(((p, r) for p, r in own if p - start >= EARLY_RSS_AT), None)
    if early is None or own[-1][0] <= early[0]:
        return None
    late = own[-1]
    return {
        "early_tokens": early[0],
        "early_rss_bytes": early[1],
        "late_tokens": late[0],
        "late_rss_bytes": late[1],
        "ratio": late[1] / early[1],
        "process_start": start if starts else None,
        "within_one_process": bool(starts),
    }


def plot(report: dict, results: list[dict], path: Path) -> None:
    """Running and windowed PPL of every run (colour: policy, line: cache size)."""
    fig, (running, windowed) = new_figure(1, 2, size=(12, 4.6))
    colors, styles = {}, {}
    for r, (name, run) in zip(results, report["runs"].items(), strict=True):
        policy, size = name.rsplit("-", 1)
        color = colors.setdefault(policy, f"C{len(colors)}")
        style = styles.setdefault(size, ("-", "--", ":", "-.")[len(styles) % 4])
        running.plot(*zip(*r["curve"], strict=True), style, color=color, label=f"{name} ({run['ppl']:.2f})")
        windowed.plot(*zip(*run["windows"], strict=True), style, color=color, marker=".", label=name)
    running.set_title("running perplexity (all tokens so far)", fontsize=9)
    windowed.set_title(f"perplexity per {report['window']:,}-token window", fontsize=9)
    for ax in (running, windowed):
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = next(iter(report["runs"].values()))
    save_figure(
        fig,
        path,
        f"running and windowed perplexity per run (colour: policy, line: cache size), "
        f"{first['model']}, {first['data']['name']}",
    )
