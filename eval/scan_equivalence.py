"""Scanned forwards on the real default model: per-token NLL with the cache's decisions taken inside 256-token
forwards vs one forward per decision (tests/test_scan.py proves equality in float64 on tiny models; this measures the
float32 rounding left on SmolLM2).

    python eval/scan_equivalence.py --data /path/to/corpus.jsonl --out eval/results/scan_equivalence.json
"""

from __future__ import annotations

import click
import torch
from common import corpus_tokens, data_option, environment, setup, write_json

from h2o_stream import make_policy
from h2o_stream.apps.perplexity.run import PerplexityRun
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--runs", default="h2o:1,tova:16", show_default=True, help="POLICY:CHUNK pairs (chunk 1: exact mode).")
@click.option("--cache-size", default=256, show_default=True)
@click.option("--skip", default=8000, show_default=True, help="Corpus tokens to skip (the first book opens with a "
                                                              "table of contents).")
@click.option("--tokens", default=1200, show_default=True)
@click.option("--span", default=256, show_default=True)
@click.option("--threads", default=1, show_default=True)
@data_option
@click.option("--out", default="eval/results/scan_equivalence.json", show_default=True)
def main(runs, cache_size, skip, tokens, span, threads, data, out):
    setup(threads)
    loaded = load_model(None)
    ids = corpus_tokens(loaded.tokenizer, skip + tokens, data)[skip:]
    report = {"benchmark": "scanned forwards vs one forward per decision, per-token NLL", "model": loaded.name,
              "data": data, "skip": skip, "tokens": tokens, "cache_size": cache_size, "span": span,
              "environment": environment(), "runs": {}}
    for pair in runs.split(","):
        name, chunk = pair.split(":")
        nll = {}
        for width in (int(chunk), span):
            run = PerplexityRun(loaded.model, make_policy(name, cache_size), chunk_size=int(chunk), span=width,
                                record_tokens=True)
            run.run([(0, ids)])
            nll[width] = torch.cat(run.token_nll).double()
        difference = (nll[int(chunk)] - nll[span]).abs()
        report["runs"][pair] = {"mean_abs_nll_difference": difference.mean().item(),
                                "max_abs_nll_difference": difference.max().item(),
                                "ppl_one_forward_per_decision": nll[int(chunk)].mean().exp().item(),
                                "ppl_scanned": nll[span].mean().exp().item()}
        print(pair, report["runs"][pair], flush=True)
    write_json(out, report)


if __name__ == "__main__":
    main()
