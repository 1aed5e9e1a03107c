"""Fair chunked mode against exact mode, every policy, on the default model: the perplexity gap and the throughput.

1. gap: `h2o-stream ppl` results of the same stream in exact mode and in (fair, default-chunk) chunked mode, one JSON
   per policy in two directories; the relative PPL gap per policy (target: within 1%) and the keys each query saw.
2. throughput, measured here side by side: each policy's chunked forward (cache B, its default chunk C) against the
   model's raw chunked forward doing the same matrix work (a DynamicCache holding as many entries as ours before a
   chunk: B + 1 - C for a fair chunk, B for a band policy; C new tokens; cropped back after each chunk). Rounds
   alternate between contenders so that machine noise hits all alike (target: >= 0.85x); with `--alternate
   forwards`, each policy's forwards alternate one by one with its raw twin's instead, so that the machine's slow
   drifts (a round of every contender took over a minute) cancel within each pair, and with a second raw twin run
   under `torch.inference_mode`, as h2o-stream runs its own forwards when gradients are off (like for like).

The `ppl` runs it reads are in eval/run_benchmarks.sh: two exact-mode runs side by side into fair_chunks/exact and
fair_chunks/exact-2 (roco, added later, into fair_chunks/exact-3), the chunked runs into fair_chunks/chunked; then

    python eval/fair_chunks.py --data path/to/gutenberg_pre1919.jsonl --threads 2 --out eval/results/fair_chunks.json
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import statistics
import time
from pathlib import Path

import click
import torch
from common import (corpus_tokens, data_option, environment, main_or_replot, new_figure, save_figure, setup,
                    time_chunks, write_json)
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.apps.perplexity.report import results_in
from h2o_stream.engine import default_chunk_size
from h2o_stream.loading.models import load_model

GAP_TARGET, SPEED_TARGET = 0.01, 0.85


def gap_standard_error(exact: dict, chunked: dict) -> float | None:
    """Standard error of the relative gap: the spread of the log-PPL difference between the two runs over the
    intervals between the points of their running-PPL curves (every ~curve_every predictions), over the square root
    of the number of intervals. A chunked run's points fall at forward boundaries, up to a chunk past the exact
    run's, so the i-th intervals are paired (the last, partial one left out). None with fewer than 3 intervals."""
    pairs = list(zip(_intervals(exact["curve"]), _intervals(chunked["curve"])))[:-1]
    differences = [c - e for e, c in pairs]
    if len(differences) < 3:
        return None
    return statistics.stdev(differences) / math.sqrt(len(differences))


def ppl_results(directory: Path) -> dict[str, dict]:
    """policy name -> its `h2o-stream ppl` result in `directory` (one run per policy there)."""
    return {result["settings"]["policy"]: result for result in results_in(directory)}


def gaps(exact_dirs: list[Path], chunked_dir: Path) -> dict[str, dict]:
    """Per policy found in both: exact and chunked PPL over the same tokens, the relative gap, the keys seen."""
    exact = {name: result for directory in exact_dirs for name, result in ppl_results(directory).items()}
    chunked = ppl_results(chunked_dir)
    rows = {}
    for name in exact.keys() & chunked.keys():
        e, c = exact[name], chunked[name]
        if e["stream_sha256"] != c["stream_sha256"]:
            raise click.ClickException(f"{name}: the exact and chunked runs read different streams")
        rows[name] = {"tokens": c["predicted_tokens"], "exact_ppl": e["ppl"], "chunked_ppl": c["ppl"],
                      "relative_gap": c["ppl"] / e["ppl"] - 1, "gap_standard_error": gap_standard_error(e, c),
                      "chunk_size": c["settings"]["chunk_size"],
                      "wide_chunks": c["settings"].get("wide_chunks", True),
                      "max_keys_seen_chunked": c.get("max_keys_seen"), "max_keys_seen_exact": e.get("max_keys_seen"),
                      "exact_tokens_per_second": e["tokens_per_second"],
                      "chunked_tokens_per_second_in_run": c["tokens_per_second"]}
    return dict(sorted(rows.items()))


def _intervals(curve: list) -> list[float]:
    """Mean NLL between consecutive points of a running-PPL curve [(predictions, running PPL), ...]."""
    totals = [(0, 0.0)] + [(n, n * math.log(ppl)) for n, ppl in curve]
    return [(b - a) / (m - n) for (n, a), (m, b) in zip(totals, totals[1:])]


def throughput(loaded, policies: list[str], cache_size: int, data: str, rounds: int, round_tokens: int,
               alternate: str = "rounds") -> dict:
    model = loaded.model
    stream = corpus_tokens(loaded.tokenizer, cache_size + rounds * round_tokens, data)
    prefix, timed = stream[:cache_size], stream[cache_size:]
    contenders = {}  # name -> (cache, chunk, raw crop length or None)
    raw_of = {}  # policy -> the raw contender doing its matrix work
    for name in policies:
        policy = make_policy(name, cache_size, tokenizer=loaded.tokenizer)
        chunk = default_chunk_size(policy)
        contenders[name] = (StreamingCache(model, policy), chunk, None)
        held = cache_size if policy.band() is not None else cache_size + 1 - chunk
        raw_of[name] = f"raw {held}+{chunk}"
        if raw_of[name] not in contenders:
            contenders[raw_of[name]] = (DynamicCache(config=model.config), chunk, held)
    with torch.no_grad():
        for cache, chunk, keep in contenders.values():
            for start in range(0, cache_size, chunk):
                model(prefix[start:start + chunk].unsqueeze(0), cache=cache)
            if keep is not None:
                cache.crop(keep - cache_size)  # negative: drop the newest cache_size - keep entries
    if alternate == "forwards":
        return _paired_forwards(model, contenders, raw_of, policies, timed, rounds, round_tokens)
    per_token = {name: [] for name in contenders}
    for r in range(rounds):
        block = timed[r * round_tokens:(r + 1) * round_tokens]
        for name, (cache, chunk, keep) in contenders.items():
            per_token[name].append(time_chunks(model, cache, block, chunk, crop=keep is not None))
    speed = {name: 1 / statistics.median(v) for name, v in per_token.items()}
    rows = {}
    for name in policies:
        chunk, raw = contenders[name][1], raw_of[name]
        rows[name] = {"chunk_size": chunk, "tokens_per_second": speed[name], "raw_forward": raw,
                      "raw_tokens_per_second": speed[raw], "ratio_vs_raw_forward": speed[name] / speed[raw]}
    return rows


ORDERS = (("policy", "raw", "raw_inference"), ("raw", "raw_inference", "policy"), ("raw_inference", "policy", "raw"))


@torch.no_grad()
def _paired_forwards(model, contenders: dict, raw_of: dict, policies: list[str], timed: torch.Tensor, rounds: int,
                     round_tokens: int) -> dict:
    """Each policy against its raw twin, forward by forward: the policy's chunk and the same chunk through the raw
    twin (cropped back) follow each other, so that noise slower than one forward hits both alike. Every forward runs
    with gradients off, as `model.generate` runs them; h2o-stream's hooks then run the policy's under
    `torch.inference_mode`, so a second raw twin runs under inference mode too (like for like). Which of the three
    goes first rotates. Per round: tokens over the summed seconds of each; speeds and ratios are medians over the
    rounds (the ratio of each round's own pair)."""
    rows = {}
    for name in policies:
        (cache, chunk, _), raw = contenders[name], raw_of[name]
        caches = {"policy": cache, "raw": contenders[raw][0], "raw_inference": copy.deepcopy(contenders[raw][0])}
        speeds = {who: [] for who in caches}
        ratios = {"raw": [], "raw_inference": []}
        for r in range(rounds):
            block = timed[r * round_tokens:(r + 1) * round_tokens]
            seconds = dict.fromkeys(caches, 0.0)
            for i, start in enumerate(range(0, block.numel(), chunk)):
                piece = block[start:start + chunk].unsqueeze(0)
                for who in ORDERS[i % len(ORDERS)]:
                    with torch.inference_mode() if who == "raw_inference" else contextlib.nullcontext():
                        started = time.perf_counter()
                        model(piece, cache=caches[who])
                        seconds[who] += time.perf_counter() - started
                    if who != "policy":
                        caches[who].crop(-piece.shape[-1])
            for who in caches:
                speeds[who].append(block.numel() / seconds[who])
            for who in ratios:
                ratios[who].append(seconds[who] / seconds["policy"])
        rows[name] = {"chunk_size": chunk, "tokens_per_second": statistics.median(speeds["policy"]),
                      "raw_forward": raw, "raw_tokens_per_second": statistics.median(speeds["raw"]),
                      "ratio_vs_raw_forward": statistics.median(ratios["raw"]), "ratio_per_round": ratios["raw"],
                      "raw_inference_mode_tokens_per_second": statistics.median(speeds["raw_inference"]),
                      "ratio_vs_raw_forward_in_inference_mode": statistics.median(ratios["raw_inference"]),
                      "ratio_in_inference_mode_per_round": ratios["raw_inference"]}
    return rows


@click.command()
@click.option("--exact-dir", "exact_dirs", multiple=True, type=click.Path(), show_default=True,
              default=["eval/results/fair_chunks/exact", "eval/results/fair_chunks/exact-2",
                       "eval/results/fair_chunks/exact-3"])
@click.option("--chunked-dir", default="eval/results/fair_chunks/chunked", show_default=True, type=click.Path())
@click.option("--policies", default="h2o,sink,window,tova,a2sf,h2o_sinks,sepllm,keydiff,roco", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--round-tokens", default=1024, show_default=True, help="Tokens per timed round and contender.")
@click.option("--alternate", type=click.Choice(["rounds", "forwards"]), default="rounds", show_default=True,
              help="rounds: every contender takes a round's tokens in turn; forwards: each policy's forwards "
                   "alternate one by one with its raw twin's (less exposed to slow drifts of the machine).")
@data_option
@click.option("--threads", default=2, show_default=True)
@click.option("--throughput-from", type=click.Path(exists=True), default=None,
              help="Take the throughput table from this earlier report instead of measuring (the gap is re-read).")
@click.option("--out", default="eval/results/fair_chunks.json", show_default=True)
def main(exact_dirs, chunked_dir, policies, cache_size, rounds, round_tokens, alternate, data, threads, throughput_from,
         out):
    setup(threads)
    loaded = load_model(None)
    policies = policies.split(",")
    if throughput_from:
        earlier = json.loads(Path(throughput_from).read_text())
        missing = [name for name in policies if name not in earlier["throughput"]]
        if missing:
            raise click.ClickException(f"{throughput_from} has no throughput for {', '.join(missing)}")
        speed = {name: earlier["throughput"][name] for name in policies}  # only this report's policies
        measured = earlier["environment"]
    else:
        speed = throughput(loaded, policies, cache_size, data, rounds, round_tokens, alternate)
        measured = {**environment(), "alternate": alternate, "rounds": rounds, "round_tokens": round_tokens}
    gap = gaps([Path(d) for d in exact_dirs], Path(chunked_dir))
    report = {"benchmark": "fair chunked mode vs exact mode and vs the raw chunked forward",
              "model": loaded.name, "data": data, "cache_size": cache_size, "environment": environment(),
              "targets": {"abs_relative_gap": GAP_TARGET, "ratio_vs_raw_forward": SPEED_TARGET},
              "gap": gap, "throughput": speed, "throughput_measured_with": measured,
              "gap_note": "exact and chunked runs read the same stream (stream_sha256 checked); their tok/s were "
                          "taken while other runs shared the machine, the throughput table was measured alone"}
    for name in policies:
        g = gap.get(name)
        text = (f"gap {g['relative_gap']:+.2%} (standard error {g['gap_standard_error'] or math.nan:.2%}) over "
                f"{g['tokens']:,} tokens" if g else "gap: no runs")
        s = speed[name]
        like = s.get("ratio_vs_raw_forward_in_inference_mode")
        like = f" ({like:.3f}x it in inference mode)" if like is not None else ""
        print(f"{name:10s} C={s['chunk_size']:3d} {s['tokens_per_second']:6.1f} tok/s = "
              f"{s['ratio_vs_raw_forward']:.3f}x {s['raw_forward']}{like}; {text}")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    fig, axes = new_figure(1, 2, size=(9, 3.6))
    names = list(report["throughput"])
    gap = report["gap"]
    axes[0].bar(names, [100 * gap[n]["relative_gap"] if n in gap else 0 for n in names], color="#4c72b0",
                yerr=[100 * (gap.get(n, {}).get("gap_standard_error") or 0) for n in names], capsize=3)
    for sign in (1, -1):
        axes[0].axhline(sign * 100 * report["targets"]["abs_relative_gap"], color="red", linestyle="--")
    axes[0].set_title("chunked PPL / exact PPL - 1 (%), ± standard error", fontsize=9)
    speed = report["throughput"]
    like = [speed[n].get("ratio_vs_raw_forward_in_inference_mode") for n in names]
    if any(v is None for v in like):  # reports from before the second raw twin
        axes[1].bar(names, [speed[n]["ratio_vs_raw_forward"] for n in names], color="#55a868")
    else:
        places = range(len(names))
        axes[1].bar([i - 0.2 for i in places], [speed[n]["ratio_vs_raw_forward"] for n in names], width=0.4,
                    color="#55a868", label="raw forward with gradients off")
        axes[1].bar([i + 0.2 for i in places], like, width=0.4, color="#8172b2", label="the same in inference mode")
        axes[1].set_xticks(list(places), names)
        axes[1].legend(fontsize=7)
    axes[1].axhline(report["targets"]["ratio_vs_raw_forward"], color="red", linestyle="--")
    axes[1].set_title("chunked tok/s / raw forward tok/s (same work)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, fair chunks at the default size")


if __name__ == "__main__":
    main_or_replot(main, plot)
