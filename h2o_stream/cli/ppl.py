"""`h2o-stream ppl`: streaming perplexity for several policies × cache sizes, resumable, with plot and table."""

from __future__ import annotations

import sys
import platform
from pathlib import Path

import click
import torch
import transformers
from tqdm import tqdm

from .options import cache_options, model_options, parse_list
from h2o_stream.errors import H2OStreamError
from h2o_stream.apps.perplexity.run import PerplexityRun, skip_tokens_of
from h2o_stream.engine.policies import make_policy, policy_class
from h2o_stream.apps.perplexity.report import plot_curves, summary_table, write_json


@click.command()
@model_options
@cache_options("h2o,sink", 256, multiple=True)
@click.option("--chunk-size", type=int, default=256, show_default=True, help="Tokens per forward pass (fast mode).")
@click.option("--exact", is_flag=True, help="Token-by-token reference mode (chunk size 1).")
@click.option("--tokens", type=int, default=100_000, show_default=True, help="Stream tokens to evaluate per run.")
@click.option("--data", type=click.Path(), default=None,
              help="Local corpus: .jsonl/.parquet (PG-19 columns) or .txt, or a directory. Default: PG-19 test "
                   "split from the Hugging Face Hub.")
@click.option("--skip-tokens", type=click.IntRange(min=0), default=0, help="Start this far into the stream.")
@click.option("--reset-per-book", is_flag=True, help="Empty the cache at each book instead of carrying it over.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="h2o-stream-ppl", show_default=True,
              help="Directory for results JSON, checkpoints and the plot.")
@click.option("--resume", is_flag=True,
              help="Continue the runs checkpointed in --out (settings must match); finished runs can be extended "
                   "with a larger --tokens and give the same result as one uninterrupted run.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Tokens between checkpoints.")
@click.option("--curve-every", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Tokens between points of the running-PPL curve.")
def ppl(model_spec, dtype, device, threads, policy, cache_size, heavy, recent, sinks, no_rolling, chunk_size, exact,
        tokens, data, skip_tokens, reset_per_book, out_dir, resume, checkpoint_every, curve_every):
    """Perplexity over a long token stream with a fixed-size cache, e.g. H2O against StreamingLLM sinks.

    Every policy × cache size is one run; the budget split of each is printed. Results go to --out: one JSON per
    run, a checkpoint per run (for --resume), ppl.png and summary.json.
    """
    from h2o_stream.loading.corpus import book_token_ids, describe_source, iter_books
    from h2o_stream.loading.models import load_model

    if tokens < 1:
        raise H2OStreamError(f"--tokens must be at least 1, got {tokens}")
    if exact:
        if click.get_current_context().get_parameter_source("chunk_size").name != "DEFAULT" and chunk_size != 1:
            raise H2OStreamError("--exact runs token by token; drop --chunk-size or --exact")
        chunk_size = 1
    if chunk_size < 1:
        raise H2OStreamError(f"--chunk-size must be at least 1, got {chunk_size}")
    policies = parse_list(policy, str, "--policy")
    sizes = parse_list(cache_size, int, "--cache-size")
    specs = _run_specs(policies, sizes, heavy, recent, sinks)

    out = Path(out_dir)
    existing = sorted(out.glob("*.ckpt")) + sorted(out.glob("*.json")) if out.exists() else []
    if existing and not resume:
        raise H2OStreamError(f"{out} already holds results ({existing[0].name}, ...); pass --resume to continue "
                             "those runs or choose another --out")
    if next(iter_books(data), None) is None:  # fail on a bad corpus before spending time on the model
        raise H2OStreamError(f"{describe_source(data)} holds no books")

    loaded = load_model(model_spec, dtype=dtype, device=device, threads=threads)
    out.mkdir(parents=True, exist_ok=True)
    base = {"model": loaded.name, "data": describe_source(data), "skip_tokens": skip_tokens}
    results = []
    for name, run_policy in specs:
        click.echo(f"== {name}: {run_policy.describe()}, chunk {chunk_size}, "
                   f"{'rolling' if not no_rolling else 'no rolling'}", err=True)
        run = PerplexityRun(loaded.model, run_policy, chunk_size=chunk_size, rolling=not no_rolling,
                            curve_every=curve_every, reset_per_book=reset_per_book, settings=base)
        checkpoint_path, result_path = out / f"{name}.ckpt", out / f"{name}.json"
        if resume and checkpoint_path.exists():
            run.load(checkpoint_path)
            click.echo(f"   resumed at token {run.position:,}", err=True)
        pieces = ((i, torch.tensor(book_token_ids(b, loaded.tokenizer))) for i, b in enumerate(iter_books(data)))
        _execute(run, skip_tokens_of(pieces, skip_tokens), tokens, checkpoint_path, checkpoint_every)
        result = run.result().to_json()
        result["requested_tokens"] = tokens
        result["corpus_exhausted"] = run.position < tokens
        result["versions"] = _versions()
        result["command"] = "h2o-stream " + " ".join(sys.argv[1:])
        if result["corpus_exhausted"]:
            click.echo(f"   the corpus has only {run.position:,} tokens after --skip-tokens; evaluated those",
                       err=True)
        write_json(result_path, result)
        results.append(result)

    plot_curves(results, out / "ppl.png", f"{loaded.name} · {base['data']}")
    write_json(out / "summary.json", [{k: v for k, v in r.items() if k != "curve"} for r in results])
    click.echo(summary_table(results))
    click.echo(f"results: {out}/ (ppl.png, summary.json, one JSON per run)", err=True)


def _run_specs(policies, sizes, heavy, recent, sinks):
    specs = []
    for name in dict.fromkeys(policies):
        if name == "full":
            specs.append(("full", make_policy("full")))
            continue
        for size in dict.fromkeys(sizes):
            given = {"heavy": heavy, "recent": recent, "sinks": sinks}
            kwargs = {k: v for k, v in given.items() if v is not None and k in policy_class(name).parts}
            specs.append((f"{name}-{size}", make_policy(name, size, **kwargs)))
    return specs


def _execute(run: PerplexityRun, pieces, tokens: int, checkpoint_path: Path, checkpoint_every: int) -> None:
    last_checkpoint = run.position
    bar = tqdm(total=tokens, initial=min(run.position, tokens), unit="tok", unit_scale=True, dynamic_ncols=True,
               disable=None)

    def progress(r: PerplexityRun, fed: int) -> None:
        bar.update(fed)
        if r.predicted:
            bar.set_postfix(ppl=f"{r.running_ppl:.2f}", refresh=False)

    def checkpoint(r: PerplexityRun) -> None:
        nonlocal last_checkpoint
        if r.position - last_checkpoint >= checkpoint_every:
            r.save(checkpoint_path)
            last_checkpoint = r.position

    cut_short = False

    def save_before_cut(r: PerplexityRun) -> None:
        # The last chunk is cut short by --tokens: checkpoint before it, so that a later --resume with more --tokens
        # feeds it whole and equals an uninterrupted run.
        nonlocal cut_short
        r.save(checkpoint_path)
        cut_short = True

    try:
        run.run(pieces, limit=tokens, on_progress=progress, checkpoint=checkpoint, before_cut_short=save_before_cut)
    finally:
        bar.close()
    if not cut_short:
        run.save(checkpoint_path)


def _versions() -> dict:
    import h2o_stream

    return {"h2o_stream": getattr(h2o_stream, "__version__", "0.1.0"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads()}
