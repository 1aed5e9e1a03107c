"""The per-token NLL of one `ppl` chunk: `token_nll` (blocks of rows) against what `ppl` did before.

Before: the previous chunk's last logits were concatenated in front of the chunk's (a copy of all of them), then one
cross-entropy call over the whole (256, vocab) block. Now (`PerplexityRun.take_logits`): `token_nll` over the chunk's
own logits in blocks of `NLL_ROWS` rows and the pending row apart. Both give the same values bit for bit (checked here
and in tests/test_perplexity.py). Random logits of the default model's vocabulary; rounds alternate; medians.

    python eval/bench_nll.py --threads 1,2 --out eval/results/bench_nll.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import environment, main_or_replot, save_pairs_by_threads, write_json

from h2o_stream.apps.perplexity.run import NLL_ROWS, token_nll


def before(pending: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    predictors = torch.cat([pending.unsqueeze(0), logits[:-1]])
    return torch.nn.functional.cross_entropy(predictors, ids, reduction="none")


def after(pending: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([token_nll(pending.unsqueeze(0), ids[:1]), token_nll(logits[:-1], ids[1:])])


@click.command()
@click.option("--chunk", default=256, show_default=True)
@click.option("--vocab", default=49152, show_default=True, help="The default model's vocabulary.")
@click.option("--threads", "thread_counts", default="1,2", show_default=True)
@click.option("--rounds", default=20, show_default=True)
@click.option("--out", default="eval/results/bench_nll.json", show_default=True)
def main(chunk, vocab, thread_counts, rounds, out):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(chunk, vocab, generator=generator) * 3
    pending = torch.randn(vocab, generator=generator) * 3
    ids = torch.randint(0, vocab, (chunk,), generator=generator)
    if not torch.equal(before(pending, logits, ids), after(pending, logits, ids)):
        raise click.ClickException("token_nll and the single cross-entropy call disagree")
    samples = {}
    for threads in (int(t) for t in thread_counts.split(",")):
        torch.set_num_threads(threads)
        times = {"before": [], "after": []}
        for _ in range(rounds):
            for name, nll in (("before", before), ("after", after)):
                started = time.perf_counter()
                nll(pending, logits, ids)
                times[name].append(time.perf_counter() - started)
        samples[str(threads)] = times
    medians = {t: {w: 1000 * statistics.median(v) for w, v in by.items()} for t, by in samples.items()}
    report = {"benchmark": "per-token NLL of one ppl chunk, before/after token_nll", "chunk": chunk, "vocab": vocab,
              "nll_rows": NLL_ROWS, "rounds": rounds, "environment": environment(), "seconds": samples,
              "median_milliseconds": medians,
              "after_over_before": {t: m["after"] / m["before"] for t, m in medians.items()}}
    for t, m in medians.items():
        click.echo(f"{t} thread(s): before {m['before']:.1f} ms, after {m['after']:.1f} ms per chunk")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    save_pairs_by_threads(report["median_milliseconds"], ("before", "after"), "ms per chunk (median)", path,
                          f"per-token NLL of a {report['chunk']}-token chunk, vocabulary {report['vocab']:,}")


if __name__ == "__main__":
    main_or_replot(main, plot)
