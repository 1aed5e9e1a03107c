"""Figure-5-style report of a long `h2o-stream ppl` run directory: running PPL and PPL per window vs tokens, every
policy against sinks at the same cache size (over the predictions both runs have made), and resident memory late in
the stream against early (~50k tokens into the run's last process, where the result records its processes).

    python eval/long_run_report.py eval/results/pg19_long --window 50000
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from common import new_figure, save_figure, write_json

EARLY_RSS_AT = 50_000  # compare late RSS with the first sample at or after this many tokens


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
    return {"early_tokens": early[0], "early_rss_bytes": early[1], "late_tokens": late[0], "late_rss_bytes": late[1],
            "ratio": late[1] / early[1], "process_start": start if starts else None,
            "within_one_process": bool(starts)}


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--window", default=50_000, show_default=True, help="Tokens per window of the windowed PPL panel.")
def main(run_dir, window):
    paths = sorted(Path(run_dir).glob("*-*.json"))
    named = {p.stem: json.loads(p.read_text()) for p in paths}
    named = {name: r for name, r in named.items() if "curve" in r}
    if not named:
        raise click.ClickException(f"no run results (<policy>-<size>.json) in {run_dir}")
    report = {"window": window, "runs": {}, "vs_sink": {}}
    for name, r in named.items():
        report["runs"][name] = {"tokens": r["tokens_fed"], "ppl": r["ppl"], "tokens_per_second": r["tokens_per_second"],
                                "windows": windows(r["curve"], window), "rss": rss_growth(r)}
    curves = {name: dict(r["curve"]) for name, r in named.items()}
    for name in report["runs"]:
        policy, size = name.rsplit("-", 1)
        sink = f"sink-{size}"
        if policy != "sink" and sink in curves:
            common = max(set(curves[name]) & set(curves[sink]), default=None)  # runs may have stopped apart
            if common:
                own_windows, sink_windows = (windows([c for c in named[n]["curve"] if c[0] <= common], window)
                                             for n in (name, sink))
                report["vs_sink"][name] = {
                    "predicted_tokens": common, "ppl": curves[name][common], "sink_ppl": curves[sink][common],
                    "ppl_ratio": curves[name][common] / curves[sink][common],
                    "windows_lower_than_sink": sum(h < k for (_, h), (_, k) in zip(own_windows, sink_windows)),
                    "windows_compared": len(own_windows)}
    print("| run | tokens | PPL | tok/s | RSS early → late |")
    print("|---|---|---|---|---|")
    for name, run in report["runs"].items():
        rss = run["rss"]
        memory = (f"{rss['early_rss_bytes'] / 2**20:.0f} MiB @ {rss['early_tokens']:,} → "
                  f"{rss['late_rss_bytes'] / 2**20:.0f} MiB @ {rss['late_tokens']:,} ({rss['ratio']:.4f}×"
                  f"{'' if rss['within_one_process'] else ', several processes'})" if rss else "-")
        print(f"| {name} | {run['tokens']:,} | {run['ppl']:.3f} | {run['tokens_per_second']:.0f} | {memory} |")
    for name, cmp in report["vs_sink"].items():
        print(f"{name}: over the first {cmp['predicted_tokens']:,} predictions PPL {cmp['ppl']:.3f}, sink "
              f"{cmp['sink_ppl']:.3f} (ratio {cmp['ppl_ratio']:.4f}); lower than sink in "
              f"{cmp['windows_lower_than_sink']} of {cmp['windows_compared']} windows")
    write_json(Path(run_dir) / "report.json", report)
    plot(report, list(named.values()), Path(run_dir) / "figure5.png")


def plot(report: dict, results: list[dict], path: Path) -> None:
    fig, (running, windowed) = new_figure(1, 2, size=(12, 4.6))
    colors, styles = {}, {}
    for r, (name, run) in zip(results, report["runs"].items()):
        policy, size = name.rsplit("-", 1)
        color = colors.setdefault(policy, f"C{len(colors)}")
        style = styles.setdefault(size, ("-", "--", ":", "-.")[len(styles) % 4])
        running.plot(*zip(*r["curve"]), style, color=color, label=f"{name} ({run['ppl']:.2f})")
        windowed.plot(*zip(*run["windows"]), style, color=color, marker=".", label=name)
    running.set_title("running perplexity (all tokens so far)", fontsize=9)
    windowed.set_title(f"perplexity per {report['window']:,}-token window", fontsize=9)
    for ax in (running, windowed):
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, "running and windowed perplexity per run (colour: policy, line: cache size), SmolLM2-135M, "
                           "local PG-19-style corpus")


if __name__ == "__main__":
    main()
