"""`h2o-stream calibrate --data TEXT --out FILE`: classify a model's KV heads as retrieval or streaming heads for
the head_hybrid policy (`--policy head_hybrid --retrieval-heads FILE`)."""

from __future__ import annotations

import click

from h2o_stream.errors import H2OStreamError

from .options import BooksType, at_least, command_argv, data_option, loading_note, model_options, sliding_option


@click.command("calibrate")
@model_options
@data_option
@click.option(
    "--books",
    type=BooksType(),
    default=None,
    help="Read only these books of --data, by index from 0 (e.g. 1-20): calibrate on text you do not report on.",
)
@click.option(
    "--cache-size",
    type=int,
    default=256,
    callback=at_least(1),
    show_default=True,
    help="The cache size the classification is for: a streaming head keeps the sinks and its newest entries.",
)
@click.option(
    "--sinks",
    type=int,
    default=4,
    show_default=True,
    callback=at_least(0),
    help="The stream's first tokens every head keeps.",
)
@click.option(
    "--retrieval-share",
    type=float,
    callback=lambda ctx, param, share: _check_share(share),
    default=0.5,
    show_default=True,
    help="The share of the heads (of the layers that run the policy) classed retrieval: those with the most "
    "attention beyond the streaming window.",
)
@click.option(
    "--windows",
    type=int,
    default=8,
    show_default=True,
    callback=at_least(1),
    help="Windows of the text the model reads.",
)
@click.option("--length", type=int, default=1024, show_default=True, callback=at_least(2), help="Tokens per window.")
@sliding_option
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The classification file to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def calibrate(
    model_spec, dtype, device, threads, data, books, cache_size, sinks, retrieval_share, windows, length, sliding, out,
    force,
):  # fmt: skip
    """Classify the model's KV heads for head_hybrid: on held-out text, the heads that put the most attention beyond
    the streaming window (neither the first --sinks tokens nor the last --cache-size - --sinks + 1) are retrieval
    heads, the others streaming. Writes --out (JSON: the masses, the classes, the model's signature); run
    `h2o-stream ppl --policy head_hybrid --retrieval-heads FILE` with it."""
    import os

    from h2o_stream.apps.calibrate import calibrate as classify_heads
    from h2o_stream.apps.calibrate import check_calibration, check_writable, write_classification
    from h2o_stream.apps.progress import Bars
    from h2o_stream.loading.models import load_model

    check_calibration(cache_size, sinks, retrieval_share, windows, length, None)  # before the model loads
    if os.path.exists(out) and not force:
        raise H2OStreamError(f"{out!r} exists; choose another --out or pass --force to replace it")
    check_writable(out)
    bars = Bars(leave=False)  # a bad H2O_STREAM_PROGRESS_EVERY fails here, before the model loads
    loading_note(model_spec)
    loaded = load_model(model_spec, dtype=dtype, device=device, threads=threads)
    classification = classify_heads(
        loaded,
        data,
        cache_size=cache_size,
        sinks=sinks,
        share=retrieval_share,
        windows=windows,
        length=length,
        books=books,
        sliding=sliding,
        on_progress=lambda done, total: bars.update("calibrating", done, total),
    )
    bars.finish("calibrating")
    classification["command"] = recorded_command(command_argv())  # how to make it again
    write_classification(out, classification, overwrite=force)
    layers = classification["policy_layers"]
    heads = sum(len(classification["older_mass"][layer]) for layer in layers)
    chosen = classification["retrieval_heads"]
    count = 0 if chosen == "none" else len(chosen.split(","))
    click.echo(f"{count} of {heads} KV heads retrieval ({chosen}); wrote {out}")


def _check_share(share: float) -> float:
    """--retrieval-share, a share of the heads, refused outside [0, 1] while the command line is parsed."""
    if not 0 <= share <= 1:
        raise H2OStreamError(f"--retrieval-share must lie in [0, 1], got {share}")
    return share


def recorded_command(argv: list[str]) -> str:
    """The command line as the file records it: the text read named by its file name, not where it lay."""
    from pathlib import Path

    words = list(argv)
    for i, word in enumerate(words[:-1]):
        if word == "--data" and words[i + 1] != "sample":
            words[i + 1] = Path(words[i + 1]).name
    return " ".join(words)
