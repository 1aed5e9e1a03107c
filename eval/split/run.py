"""`python -m eval split`: the heavy-hitter share of h2o and h2o_sinks at cache 256, chosen on some books and
reported on others (parts: choose, report, figure).

`choose` runs sink and both policies at every share of `SHARES` (0, 1/32, 1/16, 1/8, 1/4 and 1/2 of the cache as
heavy-hitter slots, the rest recent) over the first `BOOK_TOKENS` tokens of each of books `CHOOSE_BOOKS` (the stream
that picks). `report` takes, per policy, the share with the lowest PPL there and runs it over the leaderboard's own
stream (the corpus from its first token: in gutenberg_pre1919.jsonl book 0 alone, which the choosing stream leaves
out) beside the leaderboard's sink and its default h2o / h2o_sinks (share 1/2) at 256; a run the leaderboard already
has is not run again. `figure` writes eval/results/split/split.json and split.png from what both parts left (no
model). Every part continues where it stopped (`h2o-stream ppl --resume`).
"""

from __future__ import annotations

from pathlib import Path

import click

from eval.common import RESULTS, BadInput, command_line, new_figure, run_commands, save_figure, write_result
from eval.page import num, source, table

CACHE = 256
SHARES = (0, 8, 16, 32, 64, 128)  # heavy-hitter slots: 0, 1/32, 1/16, 1/8, 1/4 and 1/2 of the cache
POLICIES = ("h2o", "h2o_sinks")
CHOOSE_BOOKS, BOOK_TOKENS, CHOOSE_TOKENS = "1-20", 1000, 20_000
#: model name -> (its --model, the folder of its leaderboard: the stream and the runs the report stands beside)
MODELS = {"smollm2": (None, "leaderboard"), "gemma3-270m": ("gemma3-270m", "leaderboard_gemma3")}
#: predicted tokens per window of the bootstrap behind a ratio's interval on the choosing stream (10 windows)
CHOOSE_WINDOW = 2000

model_option = click.option("--model", "model_name", type=click.Choice(list(MODELS)), default="smollm2")
data_option = click.option("--data", required=True, help="The corpus (the committed runs: gutenberg_pre1919.jsonl).")
workers_option = click.option("--workers", default=2, show_default=True)
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the commands only.")
results_option = click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    default=RESULTS,
    show_default=True,
    help="The results folder: the leaderboards' runs are read there and the study goes to its split/.",
)


def run_options(command):
    """--data, --model, --workers, --results and --dry-run: what the parts that run `h2o-stream ppl` take."""
    for option in reversed((data_option, model_option, workers_option, results_option, dry_run_option)):
        command = option(command)
    return command


@click.group()
def split():
    """The heavy-hitter share studied: chosen on some books, reported on others (parts: choose, report, figure)."""


def _ppl(data: str, model_name: str, workers: int, out: Path, *options: str) -> list[str]:
    spec = MODELS[model_name][0]
    return [
        "h2o-stream", "ppl", "--data", data, *(["--model", spec] if spec else []), "--cache-size", str(CACHE),
        *options, "--threads", "1", "--workers", str(workers), "--checkpoint-every", "10000", "--resume",
        "--out", str(out),
    ]  # fmt: skip


@split.command()
@run_options
def choose(data, model_name, workers, results, dry_run):
    """Sink, h2o and h2o_sinks at every share over the choosing stream (split/MODEL/choose)."""
    shares = ",".join(map(str, SHARES))
    options = ["--policy", "sink," + ",".join(POLICIES), "--heavy", shares, "--books", CHOOSE_BOOKS]
    options += ["--book-tokens", str(BOOK_TOKENS), "--tokens", str(CHOOSE_TOKENS)]
    run_commands([_ppl(data, model_name, workers, results / "split" / model_name / "choose", *options)], dry_run)


@split.command()
@run_options
def report(data, model_name, workers, results, dry_run):
    """Each policy's chosen share over the leaderboard's stream (split/MODEL/report), unless the board has it."""
    picked = _results(results / "split" / model_name / "choose")
    board = _results(results / MODELS[model_name][1] / "runs")
    check_same_model_and_corpus(picked, board)
    chosen = chosen_shares(picked)
    tokens = _only(board, "sink")["requested_tokens"]
    missing = [(policy, heavy) for policy, heavy in chosen.items() if _find(board, policy, heavy) is None]
    out = results / "split" / model_name / "report"
    commands = [
        _ppl(data, model_name, workers, out, "--policy", policy, "--heavy", str(heavy), "--tokens", str(tokens))
        for policy, heavy in missing
    ]
    for policy, heavy in chosen.items():
        click.echo(f"{policy}: heavy={heavy} chosen" + ("" if (policy, heavy) in missing else " (the board has it)"))
    run_commands(commands, dry_run)


@split.command()
@results_option
def figure(results):
    """split.json and split.png from the choosing and report runs of every model that has them (no model)."""
    out = results / "split"
    models = {name: model_report(results, name) for name in MODELS if (out / name / "choose").is_dir()}
    if not models:
        raise BadInput(f"no runs in {out}/*/choose: run `python -m eval split choose` first")
    report = {
        "benchmark": "heavy-hitter share of h2o and h2o_sinks at cache 256, chosen on some books, reported on others",
        "cache_size": CACHE,
        "shares": list(SHARES),
        "choose": {"books": CHOOSE_BOOKS, "book_tokens": BOOK_TOKENS, "tokens": CHOOSE_TOKENS, "window": CHOOSE_WINDOW},
        "models": models,
        "command": command_line(),
    }
    write_result(out / "split.json", report, plot_split)


def model_report(results: Path, name: str) -> dict:
    """One model's study: PPL at every share on the choosing stream (and against sink there), the share chosen per
    policy, and on the report stream the chosen share, sink and share 1/2 side by side with bootstrap intervals."""
    from h2o_stream.apps.perplexity.leaderboard import ratio_interval

    picked = _results(results / "split" / name / "choose")
    sink = _only(picked, "sink")
    choosing = {
        policy: [
            {"heavy": heavy, "ppl": run["ppl"], "vs_sink": run["ppl"] / sink["ppl"],
             "interval": ratio_interval(run, sink, window=CHOOSE_WINDOW)}
            for heavy in SHARES if (run := _find(picked, policy, heavy)) is not None
        ]
        for policy in POLICIES
    }  # fmt: skip
    board = _results(results / MODELS[name][1] / "runs")
    check_same_model_and_corpus(picked, board)
    held_out_runs = results / "split" / name / "report"
    reported = _results(held_out_runs) if held_out_runs.is_dir() else []
    base = _only(board, "sink")
    held_out = {}
    for policy, heavy in chosen_shares(picked).items():
        run = _find(reported, policy, heavy) or _find(board, policy, heavy)
        default = _find(board, policy, CACHE // 2)
        if run is None or run["stream_sha256"] != base["stream_sha256"]:
            continue  # not run yet over the report stream
        held_out[policy] = {
            "heavy": heavy,
            "ppl": run["ppl"],
            "vs_sink": run["ppl"] / base["ppl"],
            "interval": ratio_interval(run, base),
            "half_share_ppl": default and default["ppl"],
            "vs_half_share": default and run["ppl"] / default["ppl"],
        }
    return {
        "model": sink["settings"]["model"],
        "corpus": {"name": sink["settings"]["data"], "sha256": sink["settings"]["data_sha256"]},
        "choose": {"sink_ppl": sink["ppl"], "predicted_tokens": sink["predicted_tokens"], "policies": choosing},
        "report": {
            "stream": f"the leaderboard's first {base['requested_tokens']:,} tokens (from book 0 on)",
            "predicted_tokens": base["predicted_tokens"],
            "sink_ppl": base["ppl"],
            "policies": held_out,
        },
    }


def check_same_model_and_corpus(picked: list[dict], board: list[dict]) -> None:
    """The choosing runs and the leaderboard's must share their model (weights, dtype) and corpus (its sha256): a
    share chosen on another corpus's books, or with another model, says nothing about this board."""
    for key in ("model_weights", "dtype", "data_sha256"):
        mine = {r["settings"].get(key) for r in picked}
        theirs = {r["settings"].get(key) for r in board}
        if len(mine | theirs) > 1:
            raise BadInput(
                f"the choosing runs and the leaderboard's differ in {key} ({', '.join(map(str, sorted(mine)))} "
                f"against {', '.join(map(str, sorted(theirs)))}): run both on one model and corpus"
            )


def chosen_shares(results: list[dict]) -> dict[str, int]:
    """Per policy, the share (heavy slots) with the lowest PPL among `results`; the smaller share on a tie."""
    chosen = {}
    for policy in POLICIES:
        runs = [(run["ppl"], heavy) for heavy in SHARES if (run := _find(results, policy, heavy)) is not None]
        if len(runs) != len(SHARES):
            raise BadInput(f"{policy} has {len(runs)} of its {len(SHARES)} shares: finish `choose` first")
        chosen[policy] = min(runs)[1]
    return chosen


def _results(folder: Path) -> list[dict]:
    from h2o_stream.apps.perplexity.report import results_in

    return [r for r in results_in(folder) if _size(r) == CACHE]


def _size(result: dict) -> int | None:
    from h2o_stream.apps.perplexity.report import cache_size

    return cache_size(result)


def _find(results: list[dict], policy: str, heavy: int) -> dict | None:
    """The run of `policy` with `heavy` heavy-hitter slots (its other parts their defaults for the cache)."""
    from h2o_stream.engine.policies import make_policy

    parts = make_policy(policy, CACHE, heavy=heavy).split()
    for run in results:
        settings = run["settings"]
        if settings["policy"] == policy and all(settings.get(k) == v for k, v in parts.items()):
            return run
    return None


def _only(results: list[dict], policy: str) -> dict:
    runs = [r for r in results if r["settings"]["policy"] == policy]
    if len(runs) != 1:
        raise BadInput(f"expected one {policy} run at cache {CACHE}, found {len(runs)}")
    return runs[0]


def plot_split(report: dict, path: Path) -> None:
    """PPL against heavy share (as a ratio to sink), one panel per model: each policy over the choosing stream with
    its interval, and its chosen share over the report stream."""
    from matplotlib.ticker import FuncFormatter

    models = report["models"]
    fig, axes = new_figure(1, len(models), size=(5.2 * len(models), 3.8))
    axes = axes if len(models) > 1 else [axes]
    labels = ["0" if s == 0 else f"1/{CACHE // s}" for s in report["shares"]]
    for ax, model in zip(axes, models.values(), strict=True):
        for (policy, rows), color in zip(model["choose"]["policies"].items(), ("#4c72b0", "#dd8452"), strict=False):
            x = [report["shares"].index(row["heavy"]) for row in rows]
            ax.plot(x, [row["vs_sink"] for row in rows], "o-", color=color, label=f"{policy}, choosing books")
            spans = [row["interval"] for row in rows]
            if all(spans):
                ax.fill_between(x, [s[0] for s in spans], [s[1] for s in spans], color=color, alpha=0.15)
            held = model["report"]["policies"].get(policy)
            if held:
                at = report["shares"].index(held["heavy"])
                ax.plot([at], [held["vs_sink"]], "*", color=color, markersize=14, label=f"{policy} chosen, report")
                if held["half_share_ppl"] and held["heavy"] != CACHE // 2:
                    half = held["half_share_ppl"] / model["report"]["sink_ppl"]
                    ax.plot([len(labels) - 1], [half], "*", color=color, markersize=14, fillstyle="none",
                            label=f"{policy} at 1/2, report")  # fmt: skip
        ax.axhline(1.0, color="grey", linestyle="--", label="sink")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(f"heavy-hitter share of the cache ({CACHE})")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:.2f}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.set_ylabel("PPL / sink's PPL (log scale)")
        ax.set_title(model["model"], fontsize=8)
        ax.legend(fontsize=7)
    choose = report["choose"]
    save_figure(
        fig,
        path,
        f"heavy share chosen on books {choose['books']} (first {choose['book_tokens']:,} tokens each), "
        "reported on the leaderboard's stream",
    )


def split_section(res, page) -> list[str]:
    """docs/results.md's section on the heavy-hitter share (split/split.json; called by eval.results_page)."""

    report = res.get("split/split.json")
    if not report:
        return []
    choose = report["choose"]

    def ratio(value: float, interval: list[float] | None) -> str:
        return num(value, 3) + (f" ({num(interval[0], 3)}–{num(interval[1], 3)})" if interval else "")

    def share(heavy: int) -> str:
        return "0" if heavy == 0 else f"1/{report['cache_size'] // heavy} ({heavy})"

    lines = [
        "## The heavy-hitter share, chosen on some books and reported on others",
        "",
        f"h2o and h2o_sinks at cache {report['cache_size']} with a share of heavy-hitter slots from 0 to 1/2 (the "
        "rest recent; h2o_sinks keeps 4 sinks too), in fair chunks. The share is chosen on books "
        f"{choose['books']} (the first {choose['book_tokens']:,} tokens of each, {choose['tokens']:,} tokens in "
        "all) and reported on the leaderboard's stream, which reads the corpus from its first token: book 0, which the "
        "choosing books leave out, holds all of it here (docs/benchmarks.md). "
        f"Ratios to sink have 95% bootstrap intervals over windows of {choose['window']:,} tokens (choosing) and "
        "10,000 tokens (reported).",
        "",
    ]
    rows = []
    for model in report["models"].values():
        for policy, runs in model["choose"]["policies"].items():
            best = min(runs, key=lambda r: r["ppl"])["heavy"]
            rows += [
                [model["model"], policy, share(r["heavy"]) + (" **chosen**" if r["heavy"] == best else ""),
                 num(r["ppl"], 3), ratio(r["vs_sink"], r["interval"])]
                for r in runs
            ]  # fmt: skip
    lines += ["On the choosing books:", ""]
    lines += table(["model", "policy", "heavy share", "PPL", "vs sink"], rows, {3, 4})
    held = [
        [model["model"], policy, share(r["heavy"]), num(r["ppl"], 3), num(model["report"]["sink_ppl"], 3),
         ratio(r["vs_sink"], r["interval"]), num(r["vs_half_share"], 3)]
        for model in report["models"].values()
        for policy, r in model["report"]["policies"].items()
    ]  # fmt: skip
    if held:
        lines += ["On the report stream, the chosen share beside sink and the default share (1/2):", ""]
        lines += table(
            ["model", "policy", "chosen share", "PPL", "sink PPL", "vs sink", "vs share 1/2"], held, {3, 4, 5, 6}
        )
    lines += [source(res, "split/split.json"), ""]
    lines += res.figure("split/split.png", page, "PPL against heavy share")
    return lines
