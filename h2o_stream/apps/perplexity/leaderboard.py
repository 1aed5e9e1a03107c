"""The leaderboard: every policy at every cache size on one stream, as a table and two plots.

It is built from `h2o-stream ppl` result files alone (`report.results_in`), so it can be redrawn at any time and it
covers whatever runs have finished; runs not made on one stream through one model are refused, never ranked side by
side (`report.check_comparable`). Per cache size it ranks the policies by perplexity and gives each one's ratio to
sink and to h2o at that size (only between runs over the same tokens: the same stream digest; otherwise the ratio is
None), with a 95% bootstrap interval over windows of 10,000 tokens (`ratio_interval`), the most keys any query saw,
the chunk size and the speed; a run without eviction (full) is the reference row and line. Files: `leaderboard.json`,
`leaderboard.md`,
`ppl_vs_cache.png` (PPL against cache size, one line per policy) and `windowed_ppl.png` (PPL of consecutive windows
of the stream, one panel per cache size).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import math
import os
import random
import statistics
from pathlib import Path

from h2o_stream.files import atomic_path, write_json

from .report import (
    LINE_STYLES,
    cache_size,
    check_comparable,
    pyplot,
    results_in,
    run_label,
    save_figure,
    title_figure,
    title_of,
)

FILES = ("leaderboard.json", "leaderboard.md", "ppl_vs_cache.png", "windowed_ppl.png")
BASELINES = ("sink", "h2o")
#: predicted tokens per window of the bootstrap behind each ratio's interval (`ratio_interval`)
INTERVAL_WINDOW = 10_000


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
        # the baselines at their own split, never a run of a sweep over one of their parts
        baselines = {run_label(r): r for r in runs if run_label(r) in BASELINES}
        rows = [_row(r, baselines) for r in sorted(runs, key=lambda r: r["ppl"])]
        board[size] = {"rows": rows, "winner": rows[0]["policy"]}
    # a policy without a budget (full: no eviction) is the reference every size is measured against, not a contestant
    reference = [_row(r, {}) for r in results if cache_size(r) is None]
    return {"title": title_of(results), "about": about(results), "sizes": board, "reference": reference}


def about(results: list[dict], today: datetime.date | None = None) -> dict:
    """What the runs were: model, corpus (name, size, sha256), stream tokens asked for and predicted, when they
    finished; each field lists its distinct values (one, when the runs agree). `commands`: each command and how many
    runs it made, most first. `drawn`: the date the board is drawn (`today`), shown when no run records when it
    finished."""

    def each(get, kind: type = str) -> list:
        # a field of a run file that is not of its kind (a damaged or hand-made file) is left out, never fatal
        found = (get(r) for r in results)
        return list(dict.fromkeys(v for v in found if isinstance(v, kind) and not isinstance(v, bool)))

    finished = sorted(each(lambda r: r.get("finished")))
    commands = collections.Counter(c for r in results if isinstance(c := r.get("command"), str))
    selection = each(lambda r: stream_selection(r["settings"]))
    return {
        **({"selection": selection} if any(selection) else {}),  # only boards over chosen books say so
        "runs": len(results),
        "model": each(lambda r: r["settings"].get("model")),
        "corpus": each(lambda r: r["settings"].get("data")),
        "corpus_sha256": each(lambda r: r["settings"].get("data_sha256")),
        "corpus_bytes": each(lambda r: r["settings"].get("data_bytes"), int),
        "requested_tokens": each(lambda r: r.get("requested_tokens"), int),
        "predicted_tokens": each(lambda r: r.get("predicted_tokens"), int),
        "finished": [finished[0][:10], finished[-1][:10]] if finished else None,
        "undated_runs": sum(not isinstance(r.get("finished"), str) for r in results),
        "commands": dict(commands.most_common()),
        "drawn": (today or datetime.date.today()).isoformat(),
    }


def stream_selection(settings: dict) -> str:
    """The part of the corpus a run read, in words ('' for all of it): 'books 1-20, the first 1,000 tokens of each'."""
    books, cut = settings.get("books"), settings.get("book_tokens")
    words = [f"books {books}" if books else "", f"the first {cut:,} tokens of each book" if cut else ""]
    return ", ".join(word for word in words if word)


def heading(about: dict) -> list[str]:
    """The Markdown lines above the table: model, corpus with its sha256, tokens and date. Not the commands: they
    name the corpus by its path on the machine that ran them (leaderboard.json and the run files keep them)."""

    def listed(values, show=str) -> str:
        return "; ".join(show(v) for v in values) or "not recorded"

    corpus = listed(about["corpus"])
    read = [f"read: {listed(about['selection'], lambda s: s or 'all of it')}"] if about.get("selection") else []
    identity = [
        *(f"sha256 {digest[:12]}…" for digest in about["corpus_sha256"]),
        *(f"{size:,} bytes" for size in about["corpus_bytes"]),
    ]
    finished = about["finished"]
    if finished:
        when = "finished " + (finished[0] if finished[0] == finished[1] else f"{finished[0]} to {finished[1]}")
        when += f" ({about['undated_runs']} run files record no date)" if about["undated_runs"] else ""
    else:
        when = f"drawn {about['drawn']} (the run files record no dates)"
    return [
        f"## Leaderboard: {listed(about['model'])} on {corpus}",
        "",
        f"- Model: {listed(about['model'])}",
        f"- Corpus: {', '.join([corpus, *identity, *read])}",
        f"- Tokens: {listed(about['requested_tokens'], lambda n: f'{n:,}')} stream tokens per run, of which "
        f"{listed(about['predicted_tokens'], lambda n: f'{n:,}')} predicted (the stream's first token, or each "
        "book's with --reset-per-book, has nothing before it to be predicted from)",
        f"- Runs: {about['runs']}, {when}",
        "",
    ]


def _row(result: dict, baselines: dict[str, dict]) -> dict:
    row = {
        "policy": run_label(result),
        "ppl": result["ppl"],
        "tokens": result["predicted_tokens"],
        "max_keys_seen": result.get("max_keys_seen"),
        "tokens_per_second": result["tokens_per_second"],
        "chunk_size": result["settings"]["chunk_size"],
        "wide_chunks": result["settings"].get("wide_chunks", True),
        "span": result.get("span"),
    }
    for name in BASELINES:
        base = baselines.get(name)
        if base is not None and base["stream_sha256"] == result["stream_sha256"]:  # over the same tokens
            row[f"vs_{name}"] = result["ppl"] / base["ppl"]
            row[f"vs_{name}_interval"] = ratio_interval(result, base) if base is not result else None
        else:
            row[f"vs_{name}"] = None
            row[f"vs_{name}_interval"] = None
    return row


def window_nlls(curve: list[tuple[int, float]], ends: list[int]) -> list[float]:
    """The NLL summed over each window of predicted tokens ending at `ends` (points of a running-PPL curve; the
    first window starts at 0)."""
    totals = {n: n * math.log(ppl) for n, ppl in curve}
    sums, before = [], 0.0
    for end in ends:
        sums.append(totals[end] - before)
        before = totals[end]
    return sums


def ratio_interval(
    result: dict, base: dict, window: int = INTERVAL_WINDOW, draws: int = 2000, seed: int = 0
) -> list[float] | None:
    """A 95% bootstrap interval of `result`'s PPL over `base`'s (runs over the same tokens): windows of about
    `window` predicted tokens (ending at curve points both runs share) are drawn with replacement, both runs' NLL
    over the same draw, so that a reader can tell a 3% gap from noise. None with fewer than 5 windows. Seeded: the
    same runs give the same interval."""
    shared = sorted({n for n, _ in result["curve"]} & {n for n, _ in base["curve"]})
    ends, last = [], 0
    for n in shared:
        if n - last >= window:
            ends.append(n)
            last = n
    if len(ends) < 5:
        return None
    mine, theirs = window_nlls(result["curve"], ends), window_nlls(base["curve"], ends)
    lengths = [end - start for start, end in itertools.pairwise([0, *ends])]
    generator = random.Random(seed)
    ratios = []
    for _ in range(draws):
        picks = [generator.randrange(len(ends)) for _ in ends]
        tokens = sum(lengths[i] for i in picks)
        ratios.append(math.exp(sum(mine[i] - theirs[i] for i in picks) / tokens))
    ratios.sort()
    return [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]]


def markdown(board: dict) -> str:
    """The leaderboard as Markdown: a heading saying what was run (`heading`), then a table with one block of rows
    per cache size, best first, and the reference (full cache) last."""
    lines = heading(board["about"]) if "about" in board else []
    lines += [
        "| cache | policy | PPL | vs sink | vs h2o | max keys seen | chunk | tok/s | predicted tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    blocks = [(str(size), entry["rows"]) for size, entry in board["sizes"].items()]
    for size, rows in [*blocks, ("all", board.get("reference", []))]:
        for row in rows:
            ratios = [ratio_text(row, name) for name in BASELINES]
            lines.append(
                f"| {size} | {row['policy']} | {row['ppl']:.3f} | {ratios[0]} | {ratios[1]} | "
                f"{row['max_keys_seen'] if row['max_keys_seen'] is not None else '—'} | "
                f"{row['chunk_size']}{' wide' if row['wide_chunks'] else ''}{_span(row)} | "
                f"{row['tokens_per_second']:.0f} | {row['tokens']:,} |"
            )
    return "\n".join(lines) + "\n"


def ratio_text(row: dict, baseline: str, missing: str = "—") -> str:
    """'1.043 (1.031–1.056)': a leaderboard row's ratio to a baseline and its bootstrap interval when it has one,
    `missing` where there is no ratio."""
    ratio, interval = row.get(f"vs_{baseline}"), row.get(f"vs_{baseline}_interval")
    if ratio is None:
        return missing
    return f"{ratio:.3f}" + (f" ({interval[0]:.3f}–{interval[1]:.3f})" if interval else "")


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
    points = [(0, 0.0)] + [(n, n * math.log(ppl)) for n, ppl in curve[stride - 1 :: stride]]
    return [
        (end, math.exp((total - before) / (end - start)))
        for (start, before), (end, total) in itertools.pairwise(points)
        if end > start
    ]


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


def _windows_text(ends: list[int]) -> str:
    """', windows of 1,000 tokens' (or 'of about ...' when they differ: curve points fall at forward ends) for windows
    ending at `ends`, the first starting at 0; '' for none."""
    lengths = [end - start for start, end in itertools.pairwise([0, *ends])]
    if not lengths:
        return ""
    typical = statistics.median_low(lengths)
    return f", windows of {'' if len(set(lengths)) == 1 else 'about '}{typical:,} tokens"


def _styles(results: list[dict]) -> dict[str, str]:
    """A line style for each run label (policy, or policy and swept part): ten colours per style."""
    policies = sorted({run_label(r) for r in results})
    return {p: LINE_STYLES[i // 10 % len(LINE_STYLES)] for i, p in enumerate(policies)}


def _plot_ppl_vs_cache(results: list[dict], path: Path, title: str) -> None:
    """PPL against cache size, one line per policy; with a single cache size, one bar per policy from 0 (two dots
    on an axis zoomed to their gap would make a 1% difference look like a chasm)."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5), layout="constrained")
    reference = [r for r in results if cache_size(r) is None]  # no eviction: a line across, not a contestant
    sized = [(size, r) for r in results if (size := cache_size(r)) is not None]
    results = [r for _, r in sized]
    sizes = sorted({size for size, _ in sized})
    if len(sizes) == 1:
        runs = sorted(results, key=lambda r: r["ppl"])
        bars = ax.bar([run_label(r) for r in runs], [r["ppl"] for r in runs], color="#4c72b0")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylim(0, max(r["ppl"] for r in runs) * 1.12)
        ax.set_xlabel(f"policy, at cache size {sizes[0]} (entries per layer and KV head)")
    else:
        for policy, style in _styles(results).items():
            line = sorted((size, r["ppl"]) for size, r in sized if run_label(r) == policy)
            ax.plot([s for s, _ in line], [p for _, p in line], style, marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("cache size (entries per layer and KV head)")
        ax.legend(fontsize=8)
    for r in reference:
        ax.axhline(r["ppl"], color="gray", linewidth=1, label=f"{r['settings']['policy']} (no eviction)")
        ax.legend(fontsize=8)
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    title_figure(fig, title)
    save_figure(fig, path)


def _plot_windowed(results: list[dict], path: Path, title: str) -> None:
    """PPL of consecutive windows of the stream (each window's own, not the running PPL), one panel per cache size;
    each panel says how long its windows are."""
    sizes = sorted({size for r in results if (size := cache_size(r)) is not None})
    fig, axes = pyplot().subplots(
        1, max(len(sizes), 1), figsize=(4.5 * max(len(sizes), 1), 4), squeeze=False, layout="constrained"
    )
    styles = _styles(results)
    for ax, size in zip(axes[0], sizes, strict=False):  # one empty panel when there is no size
        ends: set[int] = set()
        # each panel: that size's runs, and the reference (no eviction) in every panel
        for r in sorted((r for r in results if cache_size(r) in (size, None)), key=run_label):
            points = windowed(r["curve"])
            ends.update(n for n, _ in points)
            policy = run_label(r)
            ax.plot([n for n, _ in points], [p for _, p in points], styles[policy], label=policy)
        ax.set_title(f"cache {size}{_windows_text(sorted(ends))}", fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity of each window")
    axes[0][0].legend(fontsize=7)
    title_figure(fig, title)
    save_figure(fig, path)
