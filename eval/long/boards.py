"""The leaderboards and the long runs on the results page (and the tables README.md's blocks take from them): each
board's grid of policies by cache size, its verdict, whether two models rank alike, and each long run's report.
"""

from __future__ import annotations

from pathlib import Path

from eval.page import Results, num, pct, run_provenance, source, table
from h2o_stream.apps.perplexity.leaderboard import ratio_text


def boards(res: Results) -> list[tuple[str, dict]]:
    """(folder, leaderboard.json) of every eval/results/leaderboard*/ folder, `leaderboard` first."""
    folders = sorted(
        (n.split("/")[0] for n in res.names("leaderboard*/leaderboard.json")), key=lambda f: (f != "leaderboard", f)
    )
    return [(folder, res.get(f"{folder}/leaderboard.json")) for folder in folders]


def model_of(board: dict) -> str:
    return board.get("title", "").split(" · ")[0] or "unnamed model"


def board_grid(board: dict) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """(cache sizes, policy -> size -> row), policies sorted by PPL at 256 (else at the middle size)."""
    sizes = sorted(board["sizes"], key=int)
    grid: dict[str, dict[str, dict]] = {}
    for size in sizes:
        for row in board["sizes"][size]["rows"]:
            grid.setdefault(row["policy"], {})[size] = row
    key = "256" if "256" in sizes else sizes[len(sizes) // 2]
    order = sorted(grid, key=lambda p: (grid[p].get(key, {}).get("ppl", float("inf")), p))
    return sizes, {p: grid[p] for p in order}


def board_table(board: dict) -> list[str]:
    """Policies × cache sizes: PPL and the % difference to sink, the best at each size in bold."""
    sizes, grid = board_grid(board)
    best = {s: min((r[s]["ppl"] for r in grid.values() if s in r), default=None) for s in sizes}

    def cell(row, size):
        if size not in row:
            return "–"
        text = num(row[size]["ppl"]) + (
            "" if row[size].get("vs_sink", 1) == 1 else f" ({pct(row[size]['vs_sink'] - 1)})"
        )
        return f"**{text}**" if row[size]["ppl"] == best[size] else text

    return table(
        ["policy", *(f"cache {s}" for s in sizes)],
        [[p, *(cell(r, s) for s in sizes)] for p, r in grid.items()],
        set(range(1, len(sizes) + 1)),
    )


def verdict(board: dict) -> str:
    """Which policy wins at each cache size, and by how much the best other trails it."""
    sizes, _ = board_grid(board)
    places = []  # (size, winner, runner-up, how much worse)
    for size in sizes:
        rows = sorted(board["sizes"][size]["rows"], key=lambda r: r["ppl"])
        if len(rows) > 1:
            places.append((size, rows[0]["policy"], rows[1]["policy"], rows[1]["ppl"] / rows[0]["ppl"] - 1))
    if not places:
        return ""
    trails = ", ".join(f"{pct(gap).lstrip('+')} at {size} ({second})" for size, _, second, gap in places)
    winners = list(dict.fromkeys(winner for _, winner, _, _ in places))
    if len(winners) == 1:
        return f"{winners[0]} has the lowest PPL at every cache size; the best other policy trails it by {trails}."
    return (
        "; ".join(
            f"{winner} wins at {size}, {second} trails by {pct(gap).lstrip('+')}"
            for size, winner, second, gap in places
        )
        + "."
    )


def ranking_holds(first: dict, other: dict) -> str:
    """In words, size by size: does `other`'s board rank the policies as `first`'s does (the same winner, the same
    runner-up and its gap, the share of policy pairs in the same order), and which sizes only one board has."""
    (sizes_a, grid_a), (sizes_b, grid_b) = board_grid(first), board_grid(other)
    name_a, name_b = (model_of(b).split(" (")[0] for b in (first, other))
    said = []
    for size in [s for s in sizes_a if s in sizes_b]:
        rows_a = sorted(first["sizes"][size]["rows"], key=lambda r: r["ppl"])
        rows_b = sorted(other["sizes"][size]["rows"], key=lambda r: r["ppl"])
        common = [p for p in grid_a if size in grid_a[p] and size in grid_b.get(p, {})]
        pairs = [(p, q) for i, p in enumerate(common) for q in common[i + 1 :]]
        agree = sum(
            (grid_a[p][size]["ppl"] < grid_a[q][size]["ppl"]) == (grid_b[p][size]["ppl"] < grid_b[q][size]["ppl"])
            for p, q in pairs
        )
        win_a, win_b = rows_a[0]["policy"], rows_b[0]["policy"]
        gap = lambda rows: f"{rows[1]['policy']} +{(rows[1]['ppl'] / rows[0]['ppl'] - 1) * 100:.1f}%"  # noqa: E731
        winner = f"{win_a} is best on both" if win_a == win_b else f"{win_a} is best on {name_a}, {win_b} on {name_b}"
        said.append(
            f"at cache {size}, {winner} (next: {gap(rows_a)} on {name_a}, {gap(rows_b)} on {name_b}); "
            f"{agree} of {len(pairs)} policy pairs are in the same order"
        )
    only = [s for s in sizes_a if s not in sizes_b]
    text = ("; ".join(said) + ".") if said else f"{name_b} shares no cache size with {name_a} yet."
    return text[0].upper() + text[1:] + (f" Not yet run on {name_b}: cache {', '.join(only)}." if only else "")


def leaderboard_section(res: Results, page: Path) -> list[str]:
    lines = ["## Leaderboard", ""]
    found = boards(res)
    if not found:
        return lines + ["No leaderboard in eval/results yet (`python -m eval leaderboard --data CORPUS`).", ""]
    for folder, board in found:
        tokens = sorted({r["tokens"] for s in board["sizes"].values() for r in s["rows"]})
        digests = ", ".join(f"sha256 {d[:12]}…" for d in board.get("about", {}).get("corpus_sha256", []))
        lines += [
            f"### {model_of(board)}",
            "",
            f"{board.get('title', '')}{f' ({digests})' if digests else ''}, "
            f"{', '.join(f'{t:,}' for t in tokens)} predicted tokens per run. PPL (and the difference to sink); "
            "best at each cache size in bold. In the second table each ratio has its 95% bootstrap interval "
            "over windows of 10,000 tokens (both runs over the same draw).",
            "",
        ]
        lines += board_table(board) + [verdict(board), ""]
        lines += table(
            ["cache", "policy", "PPL", "vs sink", "vs h2o", "max keys seen", "chunk", "tok/s", "predicted tokens"],
            [
                [
                    size,
                    r["policy"],
                    num(r["ppl"], 3),
                    ratio_text(r, "sink", "–"),
                    ratio_text(r, "h2o", "–"),
                    r.get("max_keys_seen", "–"),
                    r.get("chunk_size", "–"),
                    num(r.get("tokens_per_second"), 0),
                    f"{r['tokens']:,}",
                ]
                for size in sorted(board["sizes"], key=int)
                for r in board["sizes"][size]["rows"]
            ],
            {0, 2, 3, 4, 5, 6, 7, 8},
        )
        lines += [
            source(
                res, f"{folder}/leaderboard.json", command="h2o-stream leaderboard", extra=" (the runs' commands below)"
            ),
            "",
        ]
        lines += run_provenance(
            [res.get(n) for n in res.names(f"{folder}/runs/*.json") if not n.endswith("/summary.json")]
        )  # the sweep's own report beside its runs
        for png, alt in (("ppl_vs_cache.png", "PPL against cache size"), ("windowed_ppl.png", "windowed PPL")):
            lines += res.figure(f"{folder}/{png}", page, f"{model_of(board)}: {alt}")
    if len(found) > 1:
        lines += ["### Side by side", "", *(ranking_holds(found[0][1], board) + "\n" for _, board in found[1:])]
        grids = [(model_of(b), *board_grid(b)) for _, b in found]
        policies = list(dict.fromkeys(p for _, _, grid in grids for p in grid))
        header = ["policy", *(f"{m}, {s}" for m, sizes, _ in grids for s in sizes)]
        lines += table(
            header,
            [
                [p, *(num(grid.get(p, {}).get(s, {}).get("ppl")) for _, sizes, grid in grids for s in sizes)]
                for p in policies
            ],
            set(range(1, len(header))),
        )
    return lines


# --- long runs -------------------------------------------------------------------------------------------------------


def long_table(report: dict) -> list[str]:
    """Per run: tokens, PPL, ratio to sinks at its cache size, windows lower than sinks, RSS in its last process."""
    rows = []
    for name, run in report["runs"].items():
        cmp, rss = report["vs_sink"].get(name), run.get("rss")
        memory = (
            f"{rss['early_rss_bytes'] / 2**20:,.0f} MiB at {rss['early_tokens']:,} → "
            f"{rss['late_rss_bytes'] / 2**20:,.0f} MiB at {rss['late_tokens']:,} ({num(rss['ratio'], 3)}×"
            f"{'' if rss['within_one_process'] else ', over several processes'})"
            if rss
            else "–"
        )
        rows.append(
            [
                name,
                f"{run['tokens']:,}",
                num(run["ppl"], 3),
                num(cmp["ppl_ratio"], 3) if cmp else "–",
                f"{cmp['windows_lower_than_sink']} of {cmp['windows_compared']}" if cmp else "–",
                memory,
            ]
        )
    return table(
        [
            "run",
            "tokens",
            "PPL",
            "PPL ÷ sink's",
            f"{report['window']:,}-token windows lower than sink",
            "RSS early → late, last process",
        ],
        rows,
        {1, 2, 3},
    )


def long_section(res: Results, page: Path) -> list[str]:
    lines = ["## Long runs", ""]
    for folder, what in (
        ("long_4m", "The 4M-token runs at cache 256"),
        ("long_fair", "The 1M-token fair-chunk runs at cache 128, 256 and 512"),
        ("long_fair_gemma3", "Gemma 3 270M: the 1M-token fair-chunk runs at cache 256"),
    ):
        report = res.get(f"{folder}/report.json")
        if report:
            lines += [f"### {what}", ""] + long_table(report) + [source(res, f"{folder}/report.json"), ""]
            lines += run_provenance(list(report["runs"].values()))
            lines += res.figure(f"{folder}/figure5.png", page, f"{what}: running and windowed PPL")
    return lines
