"""`python -m eval attention`: where each layer's queries put their attention, by distance, on the model alone.

The leaderboards rank policies by what they keep; this measures what the model reads. Windows of `--length` tokens
of the corpus go through the model's own forward (no cache, eager attention, so the probabilities are returned;
sliding-window layers with their own masks). For every query at least `--sinks + --recent` tokens into its window,
per layer (mean over its query heads and those queries), the attention mass on three groups of keys: the window's
first `--sinks` tokens (what sink keeps for good), the last `--recent` keys (the query's own included: sink's recent
window), and the older keys between them (the only ones a heavy-hitter policy can add). A layer whose older share is
small gains little from keeping older entries however well they are chosen. Also the mass by distance (powers of two)
over all layers. Writes OUT.json and OUT.png, one run per --model (several: comma-separated, one model at a time).
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from eval.common import (
    RESULTS,
    corpus_record,
    corpus_tokens,
    data_option,
    environment,
    load_model,
    new_figure,
    save_figure,
    setup,
    write_result,
)
from eval.page import num, source, table

GROUPS = ("sinks", "recent", "older")


@click.command()
@click.option(
    "--model",
    "models",
    default="default,gemma3-270m,qwen2.5-coder-1.5b",
    show_default=True,
    help="Models, comma-separated ('default': SmolLM2-135M-Instruct).",
)
@click.option(
    "--windows",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Windows of the corpus, one after another from its start.",
)
@click.option("--length", type=click.IntRange(min=2), default=1024, show_default=True, help="Tokens per window.")
@click.option("--sinks", type=click.IntRange(min=0), default=4, show_default=True)
@click.option(
    "--recent",
    type=click.IntRange(min=1),
    default=252,
    show_default=True,
    help="Recent keys (sink at cache 256 keeps 4 sinks + 252 recent).",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@data_option
@click.option(
    "--out",
    default=str(RESULTS / "models" / "attention_by_distance"),
    show_default=True,
    help="Writes OUT.json and OUT.png.",
)
def attention(models, windows, length, sinks, recent, threads, data, out) -> None:
    """Attention mass on sinks, the recent window and older keys, per layer, per model."""
    if sinks + recent >= length:
        raise click.BadParameter(
            f"--sinks + --recent ({sinks + recent}) must be below --length ({length}): no query would be far enough in",
            param_hint="--length",
        )
    setup(threads)
    report = {
        "benchmark": "attention mass by key distance, the model's own forward (no cache)",
        "data": corpus_record(data),
        "windows": windows,
        "length": length,
        "sinks": sinks,
        "recent": recent,
        "models": {},
        "environment": environment(),
    }
    for spec in [m.strip() for m in models.split(",") if m.strip()]:
        loaded = load_model(None if spec == "default" else spec)
        report["models"][loaded.name] = measure(loaded, data, windows, length, sinks, recent)
    write_result(Path(out).with_suffix(".json"), report, plot)


def measure(loaded, data: str, windows: int, length: int, sinks: int, recent: int) -> dict:
    """Per layer the mean mass on each group (GROUPS), and the mass by distance bucket over all layers."""
    import torch

    model = loaded.model
    model.set_attn_implementation("eager")  # the probabilities themselves (the fused kernels do not return them)
    ids = corpus_tokens(loaded.tokenizer, windows * length, data).view(windows, length)
    queries = torch.arange(sinks + recent, length)
    keys = torch.arange(length)
    distance = queries[:, None] - keys[None, :]  # >= 0 where a query may look
    visible = distance >= 0
    group_of = {
        "sinks": (keys < sinks)[None, :].expand_as(distance),
        "recent": visible & (distance < recent),
        "older": (keys >= sinks)[None, :] & (distance >= recent),
    }
    buckets = int(math.log2(length)) + 1
    # distance 0 is bucket 0, distances 2^(b-1) .. 2^b - 1 bucket b
    bucket = torch.where(distance > 0, torch.log2(distance.clamp(min=1).float()).floor().long() + 1, 0)[visible]
    layers: list[dict[str, float]] = []
    by_distance = torch.zeros(buckets + 1, dtype=torch.float64)
    with torch.no_grad():
        for window in ids:
            attentions = model(window[None], output_attentions=True, use_cache=False).attentions
            for index, layer in enumerate(attentions):
                probs = layer[0, :, queries].double().mean(0)  # (queries, keys), mean over query heads
                if len(layers) <= index:
                    layers.append(dict.fromkeys(GROUPS, 0.0))
                for name, mask in group_of.items():
                    layers[index][name] += float((probs * mask).sum(1).mean()) / len(ids)
                by_distance.index_add_(0, bucket, probs[visible] / (len(queries) * len(attentions) * len(ids)))
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    return {
        "layers": [{**layer, "type": types[i] if types else "full_attention"} for i, layer in enumerate(layers)],
        "mean": {name: sum(layer[name] for layer in layers) / len(layers) for name in GROUPS},
        "by_distance": {
            ("0" if b == 0 else f"{2 ** (b - 1)}-{2**b - 1}"): float(by_distance[b])
            for b in range(buckets + 1)
            if 2 ** max(b - 1, 0) < length
        },
    }


def plot(report: dict, path: Path) -> None:
    """One panel per model: stacked bars per layer (sinks, recent, older)."""
    runs = report["models"]
    fig, axes = new_figure(1, len(runs), size=(5.5 * len(runs), 4))
    axes = axes if len(runs) > 1 else [axes]
    colors = {"sinks": "#4c72b0", "recent": "#55a868", "older": "#c44e52"}
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        layers = run["layers"]
        bottom = [0.0] * len(layers)
        for group in GROUPS:
            values = [layer[group] for layer in layers]
            ax.bar(range(len(layers)), values, bottom=bottom, color=colors[group], label=group)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for i, layer in enumerate(layers):
            if layer["type"] != "full_attention":
                ax.text(i, 1.01, "s", ha="center", fontsize=6)
        ax.set_title(f"{name.split(' (')[0]} (older: {run['mean']['older']:.1%} on average)", fontsize=9)
        ax.set_xlabel("layer (s: sliding window)")
        ax.set_ylim(0, 1.06)
    axes[0].set_ylabel(f"attention mass (queries >= {report['sinks'] + report['recent']} into a window)")
    axes[0].legend(fontsize=8, loc="lower right")
    save_figure(
        fig,
        path,
        f"Attention on the first {report['sinks']} keys, the last {report['recent']} and older "
        f"ones: {report['data']['name']}, {report['windows']} windows of {report['length']} tokens",
    )


def models_section(res, page) -> list[str]:
    """docs/results.md's section on the models themselves (called by eval.results_page): where their attention goes
    (models/attention_by_distance.json) and each real model streamed against its own forward
    (models/*_equivalence.json)."""

    lines = []
    attention = res.get("models/attention_by_distance.json")
    if attention:
        lines += [
            "## Where the models' attention goes",
            "",
            f"Per layer, the attention mass queries put on the window's first {attention['sinks']} keys (what "
            f"sink keeps for good), the last {attention['recent']} (sink's recent window, the query's own "
            "included) and the older keys between them (the only ones a heavy-hitter policy can add), on the "
            f"model's own forward over {attention['windows']} windows of {attention['length']:,} tokens; the "
            "mean over layers here, each layer in the figure.",
            "",
        ]
        rows = [
            [model, *(num(100 * values["mean"][group], 1) + "%" for group in GROUPS), str(len(values["layers"]))]
            for model, values in attention["models"].items()
        ]
        lines += table(["model", *GROUPS, "layers"], rows, {1, 2, 3, 4})
        lines += [source(res, "models/attention_by_distance.json"), ""]
        lines += res.figure("models/attention_by_distance.png", page, "attention mass by distance")
    for name in res.names("models/*_equivalence.json"):
        lines += equivalence_lines(res, page, name)
    return lines


def equivalence_lines(res, page, name: str) -> list[str]:
    """The section of one model's equivalence result (`python -m eval quality equivalence`): a full cache in chunks
    against the model's own forward, chunked sink against exact sink, each against the target."""
    equivalence = res.get(name)
    target = equivalence["targets"]["nll"]
    full, sink = equivalence["full_vs_forward"], equivalence["sink_chunked_vs_exact"]
    lines = [
        f"## {equivalence['model']} streamed against its own forward",
        "",
        f"{equivalence['tokens']:,} tokens in forwards of {equivalence['chunk']}; the target: within {target:g} nats.",
        "",
    ]
    lines += table(
        ["comparison", "mean NLL difference", "largest per-token difference", "within target"],
        [
            [
                "full cache in chunks vs the model's forward",
                f"{full['mean_nll_difference']:.1e}",
                f"{full['max_token_difference']:.1e}",
                "yes" if abs(full["mean_nll_difference"]) <= target else "NO",
            ],
            [
                f"chunked sink vs exact sink, cache {equivalence['cache_size']}",
                f"{sink['mean_nll_difference']:.1e}",
                f"{sink['max_token_difference']:.1e}",
                "yes" if sink["max_token_difference"] <= target else "NO (per token)",
            ],
        ],
        {1, 2},
    )
    lines += [source(res, name), ""]
    lines += res.figure(name.removesuffix(".json") + ".png", page, f"{equivalence['model']} equivalence")
    return lines
