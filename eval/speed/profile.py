"""`python -m eval profile`: where a policy's fair chunks spend the time their raw twin does not, operator by operator.

`speed fair` says how fast a policy's fair chunks run against their raw twin (a DynamicCache holding as many keys,
`speed.twin_caches`); this says where the difference goes. For each policy, in `--rounds` alternating rounds, torch's
profiler records `--round-tokens` tokens of the policy's forwards, then as many of the twin's, over the same text.
Per operator, the self CPU time per 1,000 tokens of each and their difference; the operators that add the most are
kept, the rest summed as "other added" and, negative, "the twin's own" (what the twin spends more on: its fused
attention kernel, mostly). The profiler's own cost per operator call falls more on the side that makes more
small calls (the policy's): the difference here is an upper bound on what the policy's operators cost, and the
shares, not the absolute times, are what to read. Writes OUT.json and OUT.png.
"""

from __future__ import annotations

import collections
from pathlib import Path

import click

from eval.common import (
    RESULTS,
    corpus_record,
    corpus_tokens,
    data_option,
    environment,
    load_model,
    model_option,
    new_figure,
    save_figure,
    setup,
    write_result,
)
from eval.page import num, source, table

#: operators shown per policy (the rest of the difference is summed: "other added", "the twin's own")
SHOWN = 8


@click.command()
@click.option("--policies", default="sink,cam,snapkv,pyramid,keyformer,scissorhands", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--round-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@data_option
@model_option
@click.option(
    "--out",
    default=str(RESULTS / "speed" / "profile_fair"),
    show_default=True,
    help="Writes OUT.json and OUT.png.",
)
def profile(policies, cache_size, rounds, round_tokens, threads, data, model_spec, out):
    """Per policy, the operators that make its fair chunks slower than their raw twin (torch's profiler)."""
    from h2o_stream import make_policy

    setup(threads)
    loaded = load_model(model_spec)
    from eval.speed.fair import twin_prefix

    prefix = twin_prefix(loaded.model, make_policy("sink", cache_size))
    stream = corpus_tokens(loaded.tokenizer, prefix + rounds * round_tokens, data)
    rows = {}
    for name in policies.split(","):
        policy = make_policy(name, cache_size, tokenizer=loaded.tokenizer)
        rows[name] = profile_row(loaded.model, policy, stream, rounds, round_tokens)
        top = ", ".join(f"{op} {ms:+.0f}" for op, ms in list(rows[name]["extra_ms_per_1k_tokens"].items())[:3])
        click.echo(f"{name:10s} {rows[name]['ms_per_1k_tokens']['policy']:7.0f} ms/1k tokens, twin "
                   f"{rows[name]['ms_per_1k_tokens']['raw']:7.0f}; most added: {top}")  # fmt: skip
    report = {
        "benchmark": "profile of fair chunks against their raw twin (torch profiler, self CPU time per operator)",
        "model": loaded.name,
        "data": corpus_record(data),
        "cache_size": cache_size,
        "rounds": rounds,
        "round_tokens": round_tokens,
        "environment": environment(),
        "policies": rows,
    }
    write_result(Path(out).with_suffix(".json"), report, plot_profile)


def profile_row(model, policy, stream, rounds: int, tokens: int) -> dict:
    """One policy against its twin: self CPU milliseconds per 1,000 tokens, in all and per operator, and the operators
    that add the most to the policy's time (policy minus twin), largest first, the rest as "other"."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from eval.speed.fair import twin_caches, twin_prefix  # torch, transformers: not imported to render the page

    caches, chunk, held = twin_caches(model, policy, stream)
    timed = stream[twin_prefix(model, policy) :]
    per_op = {who: collections.Counter() for who in caches}
    for r in range(rounds):
        for who, cache in caches.items():
            with torch.no_grad(), profiler(activities=[ProfilerActivity.CPU]) as recorded:
                for start in range(r * tokens, (r + 1) * tokens, chunk):
                    piece = timed[start : min(start + chunk, (r + 1) * tokens)].unsqueeze(0)
                    model(piece, cache=cache)
                    if who == "raw":
                        cache.crop(-piece.shape[-1])
            for event in recorded.key_averages():
                per_op[who][event.key] += event.self_cpu_time_total / 1000  # microseconds -> ms
    scale = 1000 / (rounds * tokens)
    ms = {who: {op: t * scale for op, t in ops.items()} for who, ops in per_op.items()}
    extra = {op: ms["policy"].get(op, 0.0) - ms["raw"].get(op, 0.0) for op in set(ms["policy"]) | set(ms["raw"])}
    ranked = sorted(extra.items(), key=lambda item: -item[1])
    shown = {op: value for op, value in ranked[:SHOWN] if value > 0}
    rest = [value for op, value in ranked if op not in shown]
    shown["other added"] = sum(value for value in rest if value > 0)
    # what the twin spends more on (its fused attention kernel, mostly), as one negative sum
    shown["the twin's own"] = sum(value for value in rest if value <= 0)
    return {
        "chunk_size": chunk,
        "raw_forward": f"raw {held}+{chunk}",
        "ms_per_1k_tokens": {who: sum(values.values()) for who, values in ms.items()},
        "extra_ms_per_1k_tokens": shown,
        "policy_ms_per_1k_tokens": {op: ms["policy"].get(op, 0.0) for op in shown if op in extra},
        "raw_ms_per_1k_tokens": {op: ms["raw"].get(op, 0.0) for op in shown if op in extra},
        "twin_ms_per_1k_tokens_most": dict(sorted(ms["raw"].items(), key=lambda item: -item[1])[:3]),
    }


def plot_profile(report: dict, path: Path) -> None:
    rows = report["policies"]
    fig, axes = new_figure(1, len(rows), size=(3.4 * len(rows), 3.8))
    axes = axes if len(rows) > 1 else [axes]
    for ax, (name, row) in zip(axes, rows.items(), strict=True):
        extra = row["extra_ms_per_1k_tokens"]
        ax.barh(list(extra), list(extra.values()), color="#c44e52")
        ax.invert_yaxis()
        ax.axvline(0, color="grey", linewidth=0.8)
        total = row["ms_per_1k_tokens"]
        ax.set_title(f"{name} (C={row['chunk_size']}): {total['policy']:.0f} vs {total['raw']:.0f} ms", fontsize=8)
        ax.set_xlabel("ms per 1k tokens over the twin", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(
        fig,
        path,
        f"{report['model']}, cache {report['cache_size']}, {report['environment']['threads']} thread(s): what fair "
        "chunks add to their raw twin, per operator (torch profiler, self CPU time)",
    )


#: the committed profiles, and the fair-chunk speed of sink on the other models at 1 and 2 threads (`speed fair`
#: --out-dir eval/results/models/fair_MODEL_1thread, ..._2threads)
PROFILES = ("speed/profile_fair.json", "speed/profile_fair_gemma3.json")
#: what sink's fair chunks aim at on the other models: a band policy's chunks equal exact mode, no cut inside them
SINK_TARGET = 0.95
MODEL_FAIR = "models/fair_*/fair_chunks_chunked.json"


def profile_section(res, page) -> list[str]:
    """docs/results.md's section on where fair chunks spend their time (called by eval.results_page): sink's fair
    chunks on each other model (Gemma 3 270M, ...) against their raw twin at 1 and 2 threads, then each committed
    profile."""

    lines = []
    by_model: dict[str, list[tuple[str, dict]]] = {}
    for name in res.names(MODEL_FAIR):
        report = res.get(name)
        by_model.setdefault(report["model"], []).append((name, report))
    for model, speeds in by_model.items():
        speeds.sort(key=lambda item: item[1]["environment"]["threads"])
        target = speeds[0][1]["targets"]["ratio_vs_raw_forward"]
        targets = f"Targets: {SINK_TARGET:g}x for sink, {target:g}x for the other policies."
        lines += [
            f"## Fair chunks on {model} against their raw twin",
            "",
            "The same measurement as `speed fair` (forward by forward, alternating rounds), on another model than "
            "the default; sliding-window layers, where a model has them, keep their window and the policy runs on "
            "the global layers.",
            "",
        ]
        rows = [
            [policy, r["environment"]["threads"], row["chunk_size"], num(row["tokens_per_second"], 1),
             num(row["raw_tokens_per_second"], 1), num(row["ratio_vs_raw_forward"], 3),
             num(row["ratio_vs_raw_forward_in_inference_mode"], 3)]
            for _, r in speeds
            for policy, row in r["throughput"].items()
        ]  # fmt: skip
        lines += table(
            ["policy", "threads", "chunk", "tok/s", "raw twin tok/s", "ratio", "ratio, twin in inference mode"],
            rows,
            {1, 2, 3, 4, 5, 6},
        )
        lines += [targets + " " + " ".join(source(res, name) for name, _ in speeds), ""]
    for name in PROFILES:
        report = res.get(name)
        if not report:
            continue
        lines += [
            f"## Where fair chunks spend it: {report['model']}, {report['environment']['threads']} thread(s)",
            "",
            "Self CPU time per 1,000 tokens under torch's profiler, the policy's fair chunks and their raw twin over "
            f"the same text ({report['rounds']} alternating rounds of {report['round_tokens']} tokens, cache "
            f"{report['cache_size']}); the operators that add the most (ms per 1,000 tokens over the twin). The "
            "profiler's cost per call weighs more on the side making more small calls: read the shares. The "
            "engine's compiled parts (numba: scissorhands' counts, cam's merges, snapkv's and pyramid's cuts) are not "
            "torch operators and are not counted here; their policies' speed is the fair-chunk measurement's.",
            "",
        ]
        rows = []
        for policy, row in report["policies"].items():
            total, extra = row["ms_per_1k_tokens"], row["extra_ms_per_1k_tokens"]
            named = [f"{op.removeprefix('aten::')} {value:+.0f}" for op, value in extra.items()]
            rows.append(
                [policy, row["chunk_size"], num(total["policy"], 0), num(total["raw"], 0),
                 num(total["raw"] / total["policy"], 3), ", ".join(named)]
            )  # fmt: skip
        lines += table(
            ["policy", "chunk", "ms / 1k tokens", "twin", "twin ÷ policy", "added, by operator"], rows, {1, 2, 3, 4}
        )
        lines += [source(res, name), ""]
        lines += res.figure(name.replace(".json", ".png"), page, "profile of fair chunks")
    return lines
