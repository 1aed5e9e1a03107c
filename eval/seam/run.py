"""`python -m eval seam`: every policy's per-token NLLs on a real model, in each path the engine has for it (exact
mode on the tensor operations, exact mode compiled, fair chunks), saved so that a change to the policy seam can be
checked against them: `seam record` writes the NLLs (.npz), `seam compare` runs again and writes, per policy and path,
whether the NLLs are bit-identical to the recorded ones and the largest difference (JSON + PNG).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from eval.common import (
    RESULTS,
    BadInput,
    command_line,
    corpus_record,
    data_option,
    environment,
    load_model,
    model_option,
    new_figure,
    save_figure,
    setup,
    write_result,
)
from eval.page import source, table

OUT = RESULTS / "quality" / "seam"
#: (path name, chunk size None = the policy's default fair chunk, whether the compiled loop may run)
PATHS = (("exact_tensor", 1, False), ("exact_compiled", 1, True), ("fair", None, True))


def per_token_nlls(model, tokenizer, stream, cache_size: int, tokens: int) -> dict[str, object]:
    """{'policy/path': per-token NLLs (float64 numpy)} for every registered policy and path of `PATHS`."""
    import torch

    from h2o_stream.apps.perplexity.run import PerplexityRun
    from h2o_stream.engine.policies import POLICIES, make_policy

    results = {}
    saved = os.environ.get("H2O_STREAM_COMPILED")
    try:
        for name in sorted(name for name, cls in POLICIES.items() if not cls.required_options):
            policy = make_policy(name, None if name == "full" else cache_size, tokenizer=tokenizer)
            for path, chunk, compiled in PATHS:
                os.environ["H2O_STREAM_COMPILED"] = "1" if compiled else "0"
                run = PerplexityRun(model, policy, chunk_size=chunk, record_tokens=True)
                run.run([(0, stream[:tokens])])
                results[f"{name}/{path}"] = torch.cat(run.token_nll).double().numpy()
                mean = results[f"{name}/{path}"].mean()
                click.echo(f"{name:10s} {path:15s} chunk {run.chunk_size:3d}  mean NLL {mean:.6f}", err=True)
    finally:
        if saved is None:
            os.environ.pop("H2O_STREAM_COMPILED", None)
        else:
            os.environ["H2O_STREAM_COMPILED"] = saved
    return results


def _common(func):
    for option in (
        model_option,
        data_option,
        click.option("--tokens", default=1500, show_default=True, help="Tokens of the corpus per run."),
        click.option("--cache-size", default=128, show_default=True),
        click.option("--threads", default=2, show_default=True),
    ):
        func = option(func)
    return func


def _measure(model_spec, data, tokens, cache_size, threads):
    from eval.common import corpus_tokens

    setup(threads)
    loaded = load_model(model_spec)
    stream = corpus_tokens(loaded.tokenizer, tokens, data)
    return loaded, per_token_nlls(loaded.model, loaded.tokenizer, stream, cache_size, tokens)


@click.group()
def seam():
    """Every policy's per-token NLLs in every path, recorded and compared (parts: record, compare)."""


@seam.command()
@_common
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=OUT / "reference.npz", show_default=True
)
def record(model_spec, data, tokens, cache_size, threads, out):
    """Record the NLLs (.npz) to compare a later engine against."""
    import numpy as np

    if out.exists():
        raise BadInput(f"{out} exists; remove it to record again")
    loaded, results = _measure(model_spec, data, tokens, cache_size, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": loaded.name, "tokens": tokens, "cache_size": cache_size, "data": corpus_record(data)["sha256"]}
    np.savez_compressed(
        out, **{key.replace("/", "__"): value for key, value in results.items()}, meta=np.array(repr(meta))
    )
    click.echo(f"wrote {out}", err=True)


@seam.command()
@_common
@click.option(
    "--against",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=OUT / "reference.npz",
    show_default=True,
    help="NLLs recorded by `seam record`.",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=OUT / "equality.json", show_default=True
)
def compare(model_spec, data, tokens, cache_size, threads, against, out):
    """Run again and compare with the recorded NLLs: bit-identical or the largest difference, per policy and path."""
    import ast

    import numpy as np

    recorded = np.load(against)
    meta = ast.literal_eval(str(recorded["meta"]))
    if (meta["tokens"], meta["cache_size"], meta["data"]) != (tokens, cache_size, corpus_record(data)["sha256"]):
        raise BadInput(
            f"{against} was recorded with {meta['tokens']} tokens at cache {meta['cache_size']} on "
            f"corpus {meta['data'][:12]}; run with the same --tokens, --cache-size and --data"
        )
    loaded, results = _measure(model_spec, data, tokens, cache_size, threads)
    rows = {}
    for key, now in results.items():
        stored = key.replace("/", "__")
        if stored not in recorded:
            rows[key] = {"recorded": False, "mean_nll": float(now.mean())}
            continue
        before = recorded[stored]
        rows[key] = {
            "recorded": True,
            "bit_identical": bool(np.array_equal(before, now)),
            "max_abs_diff": float(np.abs(before - now).max()),
            "mean_nll_before": float(before.mean()),
            "mean_nll_after": float(now.mean()),
        }
    report = {
        "benchmark": "per-token NLL of every policy and path against a recorded reference",
        "model": loaded.name,
        "data": corpus_record(data),
        "tokens": tokens,
        "cache_size": cache_size,
        "reference": str(against),
        "environment": environment(),
        "command": command_line(),
        "runs": rows,
    }
    write_result(out, report, _plot)


def _plot(report: dict, figure: Path) -> None:
    rows = report["runs"]
    keys = [k for k in rows if rows[k]["recorded"]]
    fig, ax = new_figure(1, size=(10, 0.25 * len(keys) + 1.5))
    diffs = [max(rows[k]["max_abs_diff"], 1e-17) for k in keys]
    ax.barh(range(len(keys)), diffs, color=["tab:green" if rows[k]["bit_identical"] else "tab:orange" for k in keys])
    ax.set_yticks(range(len(keys)), keys, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("largest per-token NLL difference (green: bit-identical, drawn at 1e-17)")
    save_figure(
        fig,
        figure,
        f"{report['model']}: every policy and path against the recorded reference "
        f"({report['tokens']} tokens, cache {report['cache_size']})",
    )


#: how the results page heads each path's column (a path of `PATHS`)
PATH_TITLES = {"exact_tensor": "exact, tensor ops", "exact_compiled": "exact, compiled", "fair": "fair chunks"}


def _cell(row: dict | None) -> str:
    if row is None:
        return "–"
    if not row["recorded"]:
        return f"new: {row['mean_nll']:.4f}"
    return "bit-identical" if row["bit_identical"] else f"max diff {row['max_abs_diff']:.1e}"


def seam_section(res, page) -> list[str]:
    """docs/results.md's section on quality/seam/equality.json (called by eval.results_page): every policy's per-token
    NLLs in each path against those recorded before, bit-identical or the largest difference."""
    report = res.get("quality/seam/equality.json")
    if not report:
        return []
    runs = report["runs"]
    policies = sorted({key.split("/")[0] for key in runs})
    recorded = [row for row in runs.values() if row["recorded"]]
    same = sum(row["bit_identical"] for row in recorded)
    lines = [
        "## Every policy's numbers against the recorded ones",
        "",
        f"Per-token NLLs of each policy on {report['model']} over {report['tokens']:,} tokens at cache "
        f"{report['cache_size']}, in each path, against those `python -m eval seam record` wrote to "
        f"`{Path(report['reference']).name}` (the NLLs themselves, compared number for number); a policy it has none "
        f"for shows its mean NLL. {same} of {len(recorded)} recorded runs are bit-identical.",
        "",
    ]
    lines += table(
        ["policy", *(PATH_TITLES[path] for path, _, _ in PATHS)],
        [[name, *(_cell(runs.get(f"{name}/{path}")) for path, _, _ in PATHS)] for name in policies],
    )
    lines += [source(res, "quality/seam/equality.json"), ""]
    return lines + res.figure("quality/seam/equality.png", page, "seam: every policy against the recorded NLLs")
