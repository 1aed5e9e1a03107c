"""`python -m eval calibration`: head_hybrid's head classifications for the leaderboards' models and cache sizes
(parts: run, figure).

`run` calls `h2o-stream calibrate` once per cache size of the leaderboards (128, 256, 512) on books `BOOKS` of the
corpus, never on the stream the leaderboards report (gutenberg_pre1919.jsonl: book 0 holds all of it), and writes
eval/results/calibration/MODEL-SIZE.json (a file that is there already is kept). `figure` draws
eval/results/calibration/calibration.png from those files (no model): per model, at cache 256, each KV head's
attention mass beyond the streaming window, layer by layer, the retrieval heads marked. The leaderboard rows of
head_hybrid run with these files (`--retrieval-heads`, docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from eval.common import RESULTS, new_figure, run_commands, save_figure
from eval.page import num, table

OUT = RESULTS / "calibration"
SIZES = (128, 256, 512)
#: the books the classification is chosen on: the leaderboards' streams read book 0 alone
BOOKS = "1-20"
#: model name (the files' prefix) -> its --model
MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}
FIGURE_SIZE = 256


@click.group()
def calibration():
    """head_hybrid's head classifications per model and cache size (parts: run, figure)."""


@calibration.command()
@click.option("--data", required=True, help="The corpus (the committed files: gutenberg_pre1919.jsonl).")
@click.option("--model", "model_name", type=click.Choice(list(MODELS)), default="smollm2", show_default=True)
@click.option("--dry-run", is_flag=True, help="Print the commands only.")
def run(data, model_name, dry_run):
    """`h2o-stream calibrate` at every leaderboard size, on books 1-20, into eval/results/calibration/."""
    model = ["--model", MODELS[model_name]] if MODELS[model_name] else []
    commands = [
        ["h2o-stream", "calibrate", "--data", data, *model, "--books", BOOKS, "--cache-size", str(size)]
        + ["--threads", "1", "--out", str(path)]
        for size in SIZES
        if not (path := OUT / f"{model_name}-{size}.json").exists()
    ]
    run_commands(commands, dry_run)


@calibration.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=OUT / "calibration.png")
def figure(out):
    """calibration.png from the classification files (no model)."""
    files = {name: OUT / f"{name}-{FIGURE_SIZE}.json" for name in MODELS}
    found = {name: json.loads(path.read_text()) for name, path in files.items() if path.exists()}
    if not found:
        raise click.ClickException(f"no classification at cache {FIGURE_SIZE} in {OUT}: run `calibration run` first")
    plot(found, out)
    click.echo(f"wrote {out}", err=True)


def retrieval_pairs(classification: dict) -> set[tuple[int, int]]:
    """The (layer, KV head) pairs a file classes retrieval."""
    text = classification["retrieval_heads"]
    return set() if text == "none" else {tuple(int(i) for i in pair.split(".")) for pair in text.split(",")}


def plot(classifications: dict[str, dict], path: Path) -> None:
    """Per model, the older mass of every KV head by layer (dots), retrieval heads filled, streaming heads hollow."""
    fig, axes = new_figure(1, len(classifications), size=(5.5 * len(classifications), 3.8))
    axes = axes if len(classifications) > 1 else [axes]
    for ax, data in zip(axes, classifications.values(), strict=True):
        retrieval = retrieval_pairs(data)
        heads = [(layer, head) for layer in data["policy_layers"] for head in range(len(data["older_mass"][layer]))]
        for label, chosen in (("retrieval", True), ("streaming", False)):
            pairs = [pair for pair in heads if (pair in retrieval) == chosen]
            ax.scatter(
                [layer for layer, _ in pairs],
                [data["older_mass"][layer][head] for layer, head in pairs],
                s=22,
                facecolors="#c44e52" if chosen else "none",
                edgecolors="#c44e52" if chosen else "#4c72b0",
                label=label,
            )
        ax.set_title(f"{data['model'].split(' (')[0]}: {len(retrieval)} retrieval heads", fontsize=9)
        ax.set_xlabel("layer (those running the policy)")
        ax.legend(fontsize=8)
    settings = next(iter(classifications.values()))["settings"]
    axes[0].set_ylabel("attention beyond the streaming window")
    save_figure(
        fig,
        path,
        f"Attention each KV head puts beyond sink's window at cache {FIGURE_SIZE} (books {BOOKS}, "
        f"{settings['windows']} windows of {settings['length']:,} tokens)",
    )


def calibration_section(res, page) -> list[str]:
    """docs/results.md's section on head_hybrid's classifications (calibration/*.json; eval.results_page)."""

    names = [f"calibration/{name}-{size}.json" for name in MODELS for size in SIZES]
    found = {name: res.get(name) for name in names if res.get(name)}
    if not found:
        return []
    lines = [
        "## head_hybrid's head classes",
        "",
        f"`h2o-stream calibrate` on books {BOOKS} of the corpus (the leaderboards report book 0): per KV head the "
        "attention mass its queries put beyond a streaming head's window (neither the first 4 tokens nor the last "
        "cache size − 3), the half with the most of it retrieval heads. The leaderboards' head_hybrid rows run these "
        "files.",
        "",
    ]
    rows = []
    for name, data in found.items():
        retrieval = retrieval_pairs(data)
        heads = [(layer, head) for layer in data["policy_layers"] for head in range(len(data["older_mass"][layer]))]
        kept = [data["older_mass"][layer][head] for layer, head in heads if (layer, head) in retrieval]
        rest = [data["older_mass"][layer][head] for layer, head in heads if (layer, head) not in retrieval]
        layers = sorted({layer for layer, _ in retrieval})
        rows.append(
            [
                data["model"].split(" (")[0],
                str(data["settings"]["cache_size"]),
                f"{len(retrieval)} of {len(heads)}",
                num(100 * sum(kept) / max(len(kept), 1), 1) + "%",
                num(100 * sum(rest) / max(len(rest), 1), 1) + "%",
                ", ".join(map(str, layers)),
                f"`{name}`",
            ]
        )
    lines += table(
        ["model", "cache", "retrieval heads", "their mass beyond", "streaming heads' mass", "layers", "file"],
        rows,
        {1, 3, 4},
    )
    lines += res.figure("calibration/calibration.png", page, "attention beyond the window per KV head")
    return lines
