#!/usr/bin/env bash
# The benchmark runs quoted in the README. Timed benchmarks run alone (never two torch processes at once on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
python eval/bench_exact.py --threads 2 --rounds 8 --out eval/results/bench_exact.json
python eval/bench_ppl.py --threads 2 --rounds 6 --out eval/results/bench_ppl.json
python eval/bench_gap.py --threads 1 --streams 4 --stream-tokens 5120 --out eval/results/bench_gap.json
python eval/gap_vs_chunk.py --exact-from eval/results/bench_gap.json --chunk-sizes 16,64 --matched 16,64
# The long run: h2o and sink at cache 256 as two one-thread processes side by side (on 2 cores that beats one
# two-thread process), checkpointed every 20k tokens; rerun with rerunning continues from the checkpoints; LONG_TOKENS extends.
LONG=(--data ../shared/data/gutenberg_pre1919.jsonl --cache-size 256 --chunk-size 256 --threads 1
      --checkpoint-every 20000 --out eval/results/pg19_long --resume)
for policy in h2o sink; do
    OMP_WAIT_POLICY=PASSIVE h2o-stream ppl "${LONG[@]}" --policy "$policy" --tokens "${LONG_TOKENS:-1000000}" &
done
wait
h2o-stream ppl "${LONG[@]}" --policy h2o,sink --tokens "${LONG_TOKENS:-1000000}"   # both runs into one plot + table
python eval/long_run_report.py eval/results/pg19_long --window 50000
