"""The leaderboard: every policy at every cache size on one stream, as a table and two plots.

It is built from `h2o-stream ppl` result files alone (`report.results_in`), so it can be redrawn at any time and it
covers whatever runs have finished; runs not made on one stream through one model are refused, never ranked side by
side (`report.check_comparable`). Per cache size it ranks the policies by perplexity and gives each one's ratio to
sink and to h2o at that size (only between runs over the same tokens: the same stream digest; otherwise the ratio is
None), the most keys any query saw, the chunk size and the speed; a run without eviction (full) is the reference row
and line. Files: `leaderboard.json`, `leaderboard.md`,
`ppl_vs_cache.png` (PPL against cache size, one line per policy) and `windowed_ppl.png` (PPL of consecutive windows
of the stream, one panel per cache size).
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

from h2o_stream.files import atomic_path, write_json
from .report import LINE_STYLES, cache_size, check_comparable, plain_text, results_in, title_of

FILES = ("leaderboard.json", "leaderboard.md", "ppl_vs_cache.png", "windowed_ppl.png")
BASELINES = ("sink", "h2o")


def leaderboard(results: list[dict]) -> dict:
    """{'sizes': {size: {'rows': [...best first], 'winner': name}}, 'reference': [full's row]} over `results` (runs
    on one stream: `report.check_comparable`). A ratio is given only between runs over the same tokens (the same
    stream digest), else None."""
    sizes: dict[int, list[dict]] = {}
    for result in results:
        size = cache_size(result)
        if size is not None:
            sizes.setdefault(size, []).append(result)
    board = {}
    for size, runs in sorted(sizes.items()):
        baselines = {r["settings"]["policy"]: r for r in runs if r["settings"]["policy"] in BASELINES}
        rows = [_row(r, baselines) for r in sorted(runs, key=lambda r: r["ppl"])]
        board[size] = {"rows": rows, "winner": rows[0]["policy"]}
    # a policy without a budget (full: no eviction) is the reference every size is measured against, not a contestant
    reference = [_row(r, {}) for r in results if cache_size(r) is None]
    return {"title": title_of(results), "sizes": board, "reference": reference}


def _row(result: dict, baselines: dict[str, dict]) -> dict:
    row = {"policy": result["settings"]["policy"], "ppl": result["ppl"], "tokens": result["predicted_tokens"],
           "max_keys_seen": result.get("max_keys_seen"), "tokens_per_second": result["tokens_per_second"],
           "chunk_size": result["settings"]["chunk_size"], "wide_chunks": result["settings"].get("wide_chunks", True),
           "span": result.get("span")}
    for name in BASELINES:
        base = baselines.get(name)
        same = base is not None and base["stream_sha256"] == result["stream_sha256"]
        row[f"vs_{name}"] = result["ppl"] / base["ppl"] if same else None
    return row


def markdown(board: dict) -> str:
    """The leaderboard as a Markdown table, one block of rows per cache size, best first; the reference (full
    cache) last."""
    lines = ["| cache | policy | PPL | vs sink | vs h2o | max keys seen | chunk | tok/s | tokens |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    blocks = [(str(size), entry["rows"]) for size, entry in board["sizes"].items()]
    for size, rows in [*blocks, ("all", board.get("reference", []))]:
        for row in rows:
            ratios = [f"{row[f'vs_{name}']:.3f}" if row[f"vs_{name}"] is not None else "—" for name in BASELINES]
            lines.append(f"| {size} | {row['policy']} | {row['ppl']:.3f} | {ratios[0]} | {ratios[1]} | "
                         f"{row['max_keys_seen'] if row['max_keys_seen'] is not None else '—'} | "
                         f"{row['chunk_size']}{' wide' if row['wide_chunks'] else ''}{_span(row)} | "
                         f"{row['tokens_per_second']:.0f} | {row['tokens']:,} |")
    return "\n".join(lines) + "\n"


def _span(row: dict) -> str:
    """How the chunks were fed, when several rode in one forward (a scan: the same results, faster)."""
    span = row.get("span")
    return f" in {span}" if span and span != row["chunk_size"] else ""


def windowed(curve: list[tuple[int, float]], windows: int = 25) -> list[tuple[int, float]]:
    """(end token, PPL of the window ending there) for about `windows` consecutive windows, from a running-PPL curve
    [(predicted tokens, running PPL), ...]: a window's mean NLL is the difference of the running sums at its ends."""
    if len(curve) < 2:
        return []
    stride = max(1, round((len(curve) - 1) / windows))
    points = [(0, 0.0)] + [(n, n * math.log(ppl)) for n, ppl in curve[stride - 1::stride]]
    return [(end, math.exp((total - before) / (end - start)))
            for (start, before), (end, total) in zip(points, points[1:]) if end > start]


def write_leaderboard(runs_dir: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Build the leaderboard from every result in `runs_dir` and write its files (FILES) into `out`."""
    results = results_in(runs_dir)
    check_comparable(results, runs_dir)
    board = leaderboard(results)
    out = Path(out)
    write_json(out / "leaderboard.json", board)
    with atomic_path(out / "leaderboard.md") as partial:
        Path(partial).write_text(markdown(board))
    _plot_ppl_vs_cache(results, out / "ppl_vs_cache.png", board["title"])
    _plot_windowed(results, out / "windowed_ppl.png", board["title"])
    return board


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=120)
    _pyplot().close(fig)


def _styles(results: list[dict]) -> dict[str, str]:
    policies = sorted({r["settings"]["policy"] for r in results})
    return {p: LINE_STYLES[i // 10 % len(LINE_STYLES)] for i, p in enumerate(policies)}


@plain_text
def _plot_ppl_vs_cache(results: list[dict], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bounded = [r for r in results if cache_size(r) is not None]
    styles = _styles(bounded)
    for policy, style in styles.items():
        runs = sorted((cache_size(r), r["ppl"]) for r in bounded if r["settings"]["policy"] == policy)
        ax.plot([s for s, _ in runs], [p for _, p in runs], style, marker="o", label=policy)
    for r in results:
        if cache_size(r) is None:
            ax.axhline(r["ppl"], color="gray", linewidth=1, label=f"{r['settings']['policy']} (no eviction)")
    ax.set_xscale("log", base=2)
    sizes = sorted({cache_size(r) for r in bounded})
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("cache size (entries per layer and KV head)")
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


@plain_text
def _plot_windowed(results: list[dict], path: Path, title: str) -> None:
    plt = _pyplot()
    sizes = sorted({cache_size(r) for r in results if cache_size(r) is not None})
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(4.5 * max(len(sizes), 1), 4), squeeze=False)
    styles = _styles(results)
    for ax, size in zip(axes[0], sizes):
        # each panel: that size's runs, and the reference (no eviction) in every panel
        for r in sorted((r for r in results if cache_size(r) in (size, None)), key=lambda r: r["settings"]["policy"]):
            points = windowed(r["curve"])
            policy = r["settings"]["policy"]
            ax.plot([n for n, _ in points], [p for _, p in points], styles[policy], label=policy)
        ax.set_title(f"cache {size}", fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity of each window")
    axes[0][0].legend(fontsize=7)
    # wrapped to the figure's width: with one cache size the figure is narrower than the title
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(14 * fig.get_figwidth()))), fontsize=9)
    _save(fig, path)
