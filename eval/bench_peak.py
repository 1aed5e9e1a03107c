"""What the CPU's fp32 matrix products reach, against what a forward of the default model needs: the ceiling on
`ppl`'s tokens per second that no cache work can lift.

Times torch.matmul at the default model's own shapes for a 256-token chunk (the projections, the MLP, the LM head),
alternating rounds, at each thread count; reports GFLOP/s per shape and overall (the model's products weighted as one
token needs them), and the tokens per second a forward made of nothing but those products would reach.

    python eval/bench_peak.py --out eval/results/compiled/bench_peak.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import environment, main_or_replot, new_figure, save_figure, write_json

from h2o_stream.loading.models import load_model


def model_products(config, chunk: int) -> dict[str, tuple[int, int, int, int]]:
    """name -> (rows, inner, columns, times per forward) of the matrix products of one forward of `chunk` tokens:
    per layer q, k, v, o and the MLP's gate, up and down; the LM head once. (The attention's own products, over
    the cache, are left out: their size depends on the cache.)"""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layers = config.num_hidden_layers
    return {"q, o": (chunk, hidden, heads * head_dim, 2 * layers), "k, v": (chunk, hidden, kv_heads * head_dim,
                                                                           2 * layers),
            "gate, up": (chunk, hidden, inter, 2 * layers), "down": (chunk, inter, hidden, layers),
            "lm head": (chunk, hidden, config.vocab_size, 1)}


@click.command()
@click.option("--chunk", default=256, show_default=True)
@click.option("--threads", default="1,2", show_default=True)
@click.option("--rounds", default=7, show_default=True)
@click.option("--out", default="eval/results/compiled/bench_peak.json", show_default=True)
def main(chunk, threads, rounds, out):
    loaded = load_model(None)
    config = loaded.model.config
    shapes = model_products(config, chunk)
    flops_per_token = sum(2 * m * k * n * times for m, k, n, times in shapes.values()) / chunk
    report = {"benchmark": "fp32 matrix products at the default model's shapes", "model": loaded.name,
              "chunk": chunk, "environment": environment(), "flops_per_token_in_products": flops_per_token,
              "threads": {}}
    generator = torch.Generator().manual_seed(0)
    operands = {name: (torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator))
                for name, (m, k, n, _) in shapes.items()}
    for count in [int(t) for t in threads.split(",")]:
        torch.set_num_threads(count)
        seconds = {name: [] for name in shapes}
        for _ in range(rounds):
            for name, (a, b) in operands.items():
                torch.matmul(a, b)  # warm
                started = time.perf_counter()
                torch.matmul(a, b)
                seconds[name].append(time.perf_counter() - started)
        rate = {name: 2 * m * k * n / statistics.median(seconds[name]) / 1e9
                for name, (m, k, n, _) in shapes.items()}
        forward = sum(statistics.median(seconds[name]) * shapes[name][3] for name in shapes)
        report["threads"][str(count)] = {
            "gflops_per_second": rate, "seconds_per_round": seconds,
            "products_of_one_forward_seconds": forward,
            "overall_gflops_per_second": flops_per_token * chunk / forward / 1e9,
            "tokens_per_second_if_only_products": chunk / forward}
        print(f"{count} thread(s): " + ", ".join(f"{n} {r:.0f}" for n, r in rate.items()) + " GFLOP/s; the "
              f"products of one forward {forward * 1000:.0f} ms = {chunk / forward:.0f} tok/s at most "
              f"({flops_per_token * chunk / forward / 1e9:.0f} GFLOP/s)", flush=True)
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    counts = list(report["threads"])
    fig, ax = new_figure(size=(6.5, 3.6))
    names = list(report["threads"][counts[0]]["gflops_per_second"])
    width = 0.8 / len(counts)
    for i, count in enumerate(counts):
        rate = report["threads"][count]["gflops_per_second"]
        ax.bar([j + i * width for j in range(len(names))], [rate[n] for n in names], width,
               label=f"{count} thread(s): at most {report['threads'][count]['tokens_per_second_if_only_products']:.0f}"
                     " tok/s")
    ax.set_xticks([j + width * (len(counts) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel("GFLOP/s (fp32)")
    ax.legend(fontsize=8)
    save_figure(fig, path, f"{report['model']}: matrix products of a {report['chunk']}-token forward")


if __name__ == "__main__":
    main_or_replot(main, plot)
