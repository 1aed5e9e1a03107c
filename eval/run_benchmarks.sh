#!/usr/bin/env bash
# The benchmark runs quoted in the README, one after another (never two torch processes at once on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
python eval/bench_exact.py --threads 2 --rounds 8 --out eval/results/bench_exact.json
python eval/bench_ppl.py --threads 2 --rounds 4 --out eval/results/bench_ppl.json
python eval/bench_gap.py --threads 1 --streams 4 --stream-tokens 5120 --out eval/results/bench_gap.json
h2o-stream ppl --data ../shared/data/gutenberg_pre1919.jsonl --policy h2o,sink --cache-size 128,256,512 \
    --tokens "${LONG_TOKENS:-30000}" --chunk-size 256 --threads 2 --checkpoint-every 10000 \
    --out eval/results/pg19_long ${RESUME:+--resume}
