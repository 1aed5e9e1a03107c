"""`python -m eval render`: docs/results.md and the marked blocks of the hand-written pages (MARKED: README.md,
docs/findings.md, docs/development.md), from eval/results/**/*.json only.

In a marked page the text between a `<!-- render:NAME -->` line and its `<!-- /render:NAME -->` line is replaced by
block NAME (one of BLOCKS), wherever the page has it; everything else is left byte for byte, and a page without some
block (or a root without the page) is fine. An unknown or unclosed block is an error. `--check` writes nothing and
exits 1, listing the files that are stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from eval.coverage.report import percent as coverage_percent
from eval.long.boards import board_table, boards, long_table, model_of, ranking_holds, verdict
from eval.page import RenderError, Results, num, pct, source, table, unexpected
from eval.results_page import PAGE, results_page
from eval.speed.section import decode_files
from eval.verdicts import long_by_model, target

README = Path("README.md")
#: the hand-written pages whose marked blocks are rendered: the product page, the findings the results add up to, and
#: the development page (the tests' coverage)
MARKED = (README, Path("docs/findings.md"), Path("docs/development.md"))
MARKER = re.compile(r"^<!-- (/?)render:([\w-]+) -->[ \t]*\r?$", re.MULTILINE)
NAMES = {"h2o": "H2O", "tova": "TOVA", "sink": "sinks"}


def missing(name: str, command: str) -> list[str]:
    return [f"_No result in `eval/results/{name}` yet: `{command}` writes it._"]


def headline(res: Results) -> list[str]:
    """Over N tokens at cache B sinks reach PPL x and H2O y: H2O z% worse, worse in k of n windows (long_4m)."""
    report = res.get("long_4m/report.json")
    if not report or not report["vs_sink"]:
        return missing("long_4m/report.json", "python -m eval long 4m --data CORPUS")
    name = "h2o-256" if "h2o-256" in report["vs_sink"] else next(iter(report["vs_sink"]))
    policy, size = name.rsplit("-", 1)
    cmp, run = report["vs_sink"][name], report["runs"][name]
    worse, model = cmp["windows_compared"] - cmp["windows_lower_than_sink"], (run.get("model") or "").split(" (")[0]
    corpus = run.get("data") or {}
    label = NAMES.get(policy, policy)
    return [
        f"Over {cmp['predicted_tokens'] + 1:,} tokens at cache {size} ({model} on {corpus.get('name')}: "
        f"{corpus.get('description')}), StreamingLLM's attention sinks reach PPL **{num(cmp['sink_ppl'])}** and "
        f"{label} **{num(cmp['ppl'])}**: {label} is {pct(cmp['ppl_ratio'] - 1).lstrip('+')} worse, and worse in "
        f"{worse} of {cmp['windows_compared']} windows of {report['window']:,} tokens."
    ]


def leaderboard(res: Results) -> list[str]:
    """The first leaderboard's table (PPL and % to sink, best in bold, by PPL at 256) and its verdict."""
    found = boards(res)
    if not found:
        return missing("leaderboard/leaderboard.json", "python -m eval leaderboard --data CORPUS")
    folder, board = found[0]
    return [
        f"Perplexity of every policy at cache 128, 256 and 512 ({board.get('title')}; the difference to sinks in "
        "brackets, the best at each size in bold):",
        "",
        *board_table(board),
        f"**Verdict:** {verdict(board)}",
        "",
        source(res, f"{folder}/leaderboard.json", command="h2o-stream leaderboard"),
    ]


def models(res: Results) -> list[str]:
    """Every other model's leaderboard (PPL and % to sink) and, in words, whether the first model's ranking holds on
    it, size by size."""
    found = boards(res)
    if len(found) < 2:
        return missing("leaderboard_*/leaderboard.json", "h2o-stream leaderboard --model MODEL --data CORPUS")
    lines = []
    for folder, board in found[1:]:
        tokens = sorted({r["tokens"] for s in board["sizes"].values() for r in s["rows"]})
        lines += [
            f"On {model_of(board)}, {', '.join(f'{t:,}' for t in tokens)} predicted tokens per run:",
            "",
            *board_table(board),
            f"**Does the ranking hold?** {ranking_holds(found[0][1], board)}",
            "",
            source(res, f"{folder}/leaderboard.json", command="h2o-stream leaderboard"),
            "",
        ]
    lines += long_by_model(res)
    return lines[:-1]


def split(res: Results) -> list[str]:
    """In words, per model: the heavy-hitter share chosen on some books and what it gives on the report stream."""
    report = res.get("split/split.json")
    if not report:
        return missing("split/split.json", "python -m eval split figure")
    choose, half = report["choose"], report["cache_size"] // 2

    def share(heavy: int) -> str:
        return (
            "no heavy share (sink's split, in fair chunks)"
            if heavy == 0
            else f"{heavy} heavy slots (1/{half * 2 // heavy})"
        )

    said, ratios = [], []
    for model in report["models"].values():
        parts = []
        for policy, held in model["report"]["policies"].items():
            ratios.append(held["vs_sink"])
            low, high = held["interval"] or (None, None)
            spread = f" ({num(low, 3)}–{num(high, 3)})" if low is not None else ""
            against_half = (
                f", {num(100 * (1 - held['vs_half_share']), 1)}% lower than at its default share of 1/2"
                if held["heavy"] != half
                else ""
            )
            parts.append(
                f"{policy} with {share(held['heavy'])} reaches PPL {num(held['ppl'], 2)}, "
                f"{num(held['vs_sink'], 3)}x sink's {num(model['report']['sink_ppl'], 2)}{spread}{against_half}"
            )
        if parts:
            said.append(f"On {model['model']}, " + "; ".join(parts) + ".")
    if not said:
        return missing("split/MODEL/report/", "python -m eval split report --data CORPUS")
    beaten = [r for r in ratios if r < 1]
    verdict_ = (
        f"a chosen share beats sink in {len(beaten)} of {len(ratios)} cases"
        if beaten
        else f"no chosen share beats sink: they trail it by {num(100 * (min(ratios) - 1), 1)}% to "
        f"{num(100 * (max(ratios) - 1), 1)}%"
    )
    return [
        f"**Does another heavy-hitter share rescue H2O?** Chosen at cache {report['cache_size']} on books "
        f"{choose['books']} (the first {choose['book_tokens']:,} tokens of each) among 0, 1/32, ..., 1/2 of the cache "
        f"and reported on the leaderboard's stream, {verdict_}. " + " ".join(said),
        "",
        source(res, "split/split.json", command="python -m eval split"),
    ]


def long(res: Results) -> list[str]:
    """The 4M table."""
    report = res.get("long_4m/report.json")
    if not report:
        return missing("long_4m/report.json", "python -m eval long 4m --data CORPUS")
    return [*long_table(report), source(res, "long_4m/report.json")]


def speed(res: Results) -> list[str]:
    """Per policy: exact-mode decode vs the raw decode step, fair chunks vs their raw twin, exact mode scanned vs the
    raw forward, at the thread counts measured."""
    decode = [res.get(n) for n in decode_files(res)]
    fair = {
        p: (t, r)
        for n in res.names("speed/fair_chunks_*.json")
        for r in [res.get(n)]
        for p, t in r["throughput"].items()
    }
    scan = res.get("speed/exact_scan.json")
    scan_counts = list(scan["threads"]) if scan else []
    policies = [p for r in decode for p in r["ratio_vs_dynamic_inference"]] + list(fair)
    policies += [
        n.split(" ")[0] for c in scan_counts for n in scan["threads"][c]["vs_raw_forward"] if not n.startswith("raw")
    ]
    if not policies:
        return missing("speed/", "python -m eval speed decode")

    def scanned(policy, count):
        ratios = scan["threads"][count]["vs_raw_forward"]
        key = next(
            (n for n in ratios if n.startswith(f"{policy} exact, scanned in ") and "tensor" not in n),
            next((n for n in ratios if n.startswith(f"{policy} chunk ")), None),
        )
        return num(ratios[key], 2) if key else "–"

    fair_threads = sorted({r["environment"]["threads"] for _, r in fair.values()})
    header = [
        "policy",
        *(f"decode, {r['environment']['threads']} thread(s)" for r in decode),
        f"fair chunk, {'/'.join(map(str, fair_threads))} thread(s)",
        *(f"scanned forward, {c} thread(s)" for c in scan_counts),
    ]
    rows = [
        [
            p if p != "chat" else "chat (h2o)",
            *(
                num(1 / r["ratio_vs_dynamic_inference"][p], 2) if p in r["ratio_vs_dynamic_inference"] else "–"
                for r in decode
            ),
            f"{num(fair[p][0]['ratio_vs_raw_forward_in_inference_mode'], 2)} (C={fair[p][0]['chunk_size']})"
            if p in fair
            else "–",
            *(scanned(p, c) for c in scan_counts),
        ]
        for p in dict.fromkeys(policies)
    ]
    sources = [
        res.shown(n)
        for n in (*decode_files(res), *res.names("speed/fair_chunks_*.json"), *res.names("speed/exact_scan.json"))
    ]
    return [
        "Speed as a fraction of the raw twin's doing the same work (ours tok/s ÷ raw tok/s, 1.00 = as fast), "
        "measured side by side in one process: decode against the raw decode step (under inference mode, like "
        "h2o-stream's forwards), each policy's fair chunk C against the raw chunked forward (also under inference "
        "mode), exact mode scanned in forwards of 256 against the raw forward of 256 tokens.",
        "",
        *table(header, rows, set(range(1, len(header)))),
        f"Sources: {', '.join(f'`{s}`' for s in sources)} (commands and versions in "
        "[docs/results.md](docs/results.md#speed)).",
    ]


def first_run(res: Results) -> list[str]:
    """The README's first command (`h2o-stream ppl --data sample --tokens 20000`), as committed in first_run/."""
    runs = [r for r in (res.get(n) for n in res.names("first_run/*.json")) if r and "curve" in r]
    if not runs:
        return missing("first_run/", "h2o-stream ppl --data sample --tokens 20000 --out eval/results/first_run")
    rows = [
        [
            r["settings"]["policy"],
            f"{r['predicted_tokens']:,}",
            num(r["ppl"], 3),
            num(r["tokens_per_second"], 0),
            num(r["peak_rss_bytes"] / 2**20, 0) if r.get("peak_rss_bytes") else "–",
        ]
        for r in runs
    ]
    name = res.names("first_run/*.json")[0]
    return [
        *table(["policy", "predicted tokens", "PPL", "tok/s", "peak RSS (MiB)"], rows, {1, 2, 3, 4}),
        source(res, name, extra=f"; {model_of({'title': runs[0]['settings'].get('model', '')})}"),
    ]


def coverage(res: Results) -> list[str]:
    """The test suite's coverage of h2o_stream per package (lines and branches), as the last measured run gave it."""
    report = res.get("coverage/coverage.json")
    if not report:
        return missing("coverage/coverage.json", "python -m eval coverage --out eval/results/coverage/coverage.json")
    rows = [
        [
            f"`{name}`" if name != "total" else "**total**",
            f"{p['covered_lines']:,} / {p['statements']:,}",
            f"{p['covered_branches']:,} / {p['branches']:,}",
            f"{coverage_percent(p):.1f}%",
        ]
        for name, p in [*report["packages"].items(), ("total", report["total"])]
    ]
    return [
        "Coverage of `h2o_stream` by the tests (lines and branches, the CLI's subprocesses included), per package:",
        "",
        *table(["package", "lines", "branches", "covered"], rows, {1, 2, 3}),
        source(res, "coverage/coverage.json"),
    ]


BLOCKS = {
    "headline": headline,
    "leaderboard": leaderboard,
    "models": models,
    "target": target,
    "split": split,
    "long": long,
    "speed": speed,
    "first_run": first_run,
    "coverage": coverage,
}


LINK = re.compile(r"\]\((?![a-z]+:|#)")


def relative_links(line: str, where: str) -> str:
    """`line` with its links, which blocks write from the repository's root, made relative to page `where`."""
    up = "../" * (len(Path(where).parts) - 1)
    return LINK.sub(f"]({up}", line) if up else line


def fill_blocks(text: str, res: Results, where: str = "README.md") -> str:
    """`text` (the page `where`, from the repository's root) with every marked block's content rendered anew; the
    rest kept byte for byte."""
    newline = "\r\n" if "\r\n" in text else "\n"
    out, position, opened = [], 0, None
    for match in MARKER.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        line = text.count("\n", 0, match.start()) + 1
        if not closing:
            if opened:
                raise RenderError(f"{where} line {line}: block {name!r} opens inside block {opened[0]!r}")
            if name not in BLOCKS:
                raise RenderError(
                    f"{where} line {line}: unknown block <!-- render:{name} --> (the blocks are: {', '.join(BLOCKS)})"
                )
            body_start = text.find("\n", match.end()) + 1 or len(text)
            opened = (name, body_start)
        else:
            if not opened or opened[0] != name:
                raise RenderError(f"{where} line {line}: <!-- /render:{name} --> closes no open block {name!r}")
            with unexpected(f"{where} block {name!r}"):
                body = newline.join(relative_links(line, where) for line in BLOCKS[name](res))
            out += [text[position : opened[1]], body + newline if body else ""]
            position, opened = match.start(), None
    if opened:
        raise RenderError(f"{where}: block {opened[0]!r} is never closed (<!-- /render:{opened[0]} -->)")
    return "".join(out) + text[position:]


@click.command()
@click.option(
    "--results",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("eval/results"),
    show_default=True,
    help="The result files to read.",
)
@click.option(
    "--root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Where README.md and docs/ are.",
)
@click.option("--check", is_flag=True, help="Write nothing; exit 1, listing them, if any file would change.")
def render(results, root, check):
    """docs/results.md and the marked blocks of README.md and docs/ from eval/results/**/*.json."""
    res = Results(results, root)
    outputs = {root / PAGE: results_page(res)}
    for page in MARKED:
        if (root / page).is_file():
            outputs[root / page] = fill_blocks((root / page).read_bytes().decode("utf-8"), res, str(page))
    stale = [path for path, text in outputs.items() if not path.is_file() or path.read_bytes() != text.encode()]
    if check:
        if stale:
            click.echo("stale (run python -m eval render): " + ", ".join(str(p) for p in stale), err=True)
            raise SystemExit(1)
        click.echo("up to date: " + ", ".join(str(p) for p in outputs))
        return
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.tmp")
        partial.write_bytes(outputs[path].encode())
        partial.replace(path)  # in one step: never a half-written page
    click.echo(f"wrote {', '.join(str(p) for p in stale) or 'nothing (up to date)'}")
