#!/usr/bin/env bash
# The benchmark runs quoted in the README, as committed in eval/results. Timed benchmarks run alone (never two torch
# processes at once on 2 cores).
#
#     DATA=path/to/gutenberg_pre1919.jsonl bash eval/run_benchmarks.sh
#
# DATA is the corpus every run reads. The committed results were measured on a local corpus of 21 public-domain
# Project Gutenberg books published before 1919, one JSON line per book in PG-19's columns (short_book_title,
# publication_date, url, text); DATA=sample runs the same commands on the sample shipped with the package instead
# (a different text, so different numbers).
set -euo pipefail
if [[ -z "${DATA:-}" ]]; then
    echo "eval/run_benchmarks.sh: set DATA to the corpus to read, e.g." \
         "DATA=path/to/gutenberg_pre1919.jsonl bash eval/run_benchmarks.sh (the committed results used the local" \
         "21-book Gutenberg corpus; DATA=sample reads the sample shipped with the package)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
python eval/bench_exact.py --threads 2 --rounds 8 --out eval/results/bench_exact.json
python eval/bench_exact.py --threads 1 --rounds 8 --out eval/results/bench_exact_1thread.json
python eval/bench_threads.py --threads 2 --rounds 12 --out eval/results/bench_threads.json
python eval/bench_ppl.py --data "$DATA" --threads 2 --rounds 6 --out eval/results/bench_ppl.json
python eval/bench_gap.py --data "$DATA" --threads 1 --streams 4 --stream-tokens 5120 --out eval/results/bench_gap.json
python eval/gap_vs_chunk.py --data "$DATA" --exact-from eval/results/bench_gap.json --chunk-sizes 16,64 --matched 16,64
python eval/bench_ppl.py --data "$DATA" --threads 2 --rounds 6 --cache-size 193 --recent 128 --chunk-size 64 \
    --policies h2o --out eval/results/bench_ppl_span_matched.json
# Fair chunks vs exact mode, every policy (eval/results/fair_chunks.json): the exact runs take ~30 min per policy on
# one core, so they go two at a time (sink and window need none: their chunked mode is exact mode, tested); then the
# chunked runs at the default chunk (and at 64, 16 and 8 for comparison; tova's default is exact mode, roco's 8), then
# the side-by-side throughput measurement.
P=h2o,sink,window,tova,a2sf,h2o_sinks,sepllm,keydiff,roco
GAP=(--data "$DATA" --tokens 20000 --cache-size 256 --threads 1 --resume)
h2o-stream ppl --exact "${GAP[@]}" --policy tova,h2o,a2sf --out eval/results/fair_chunks/exact &
h2o-stream ppl --exact "${GAP[@]}" --policy sepllm,keydiff,h2o_sinks --out eval/results/fair_chunks/exact-2 &
wait
h2o-stream ppl --exact "${GAP[@]}" --policy roco --out eval/results/fair_chunks/exact-3  # added later, alone
h2o-stream ppl "${GAP[@]}" --policy "$P" --out eval/results/fair_chunks/chunked
h2o-stream ppl "${GAP[@]}" --policy tova,h2o,a2sf,h2o_sinks,sepllm,keydiff --chunk-size 64 \
    --out eval/results/fair_chunks/chunked-c64
h2o-stream ppl "${GAP[@]}" --policy tova,roco --chunk-size 8 --out eval/results/fair_chunks/chunked-c8
h2o-stream ppl "${GAP[@]}" --policy tova,roco --chunk-size 16 --out eval/results/fair_chunks/chunked-c16
python eval/fair_chunks.py --data "$DATA" --threads 2 --out eval/results/fair_chunks.json
python eval/fair_chunks.py --data "$DATA" --threads 2 --round-tokens 512 \
    --out eval/results/fair_chunks_session15.json  # a third run, the next session's machine (at df07ed0)
# each policy's forwards alternating one by one with its raw twin's: at 435b71a (written as fair_chunks_paired.json,
# renamed _before), then after the cut left to the next chunk (3fd8e66)
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 512 --alternate forwards \
    --out eval/results/fair_chunks_paired.json
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 512 --alternate forwards \
    --policies a2sf,h2o --out eval/results/fair_chunks_paired_a2sf.json  # after a2sf's product (91a5044)
h2o-stream ppl --data "$DATA" --tokens 20000 --cache-size 256 --threads 2 --policy a2sf \
    --out eval/results/fair_chunks/a2sf-after-product  # its PPL after that change (the checkpoint not kept)
# tova, the one policy past the 1% gap at 20k tokens, and h2o for comparison: exact and chunked over 60k (the gap's
# standard error). tova's runs are fresh; h2o's exact run was resumed at 20k and at 40,960 (resuming is exact).
for policy in tova h2o; do
    GAP60=(--data "$DATA" --tokens 60000 --cache-size 256 --threads 1 --resume --policy "$policy")
    h2o-stream ppl --exact "${GAP60[@]}" --out "eval/results/fair_chunks/$policy-60k/exact" &
    h2o-stream ppl "${GAP60[@]}" --out "eval/results/fair_chunks/$policy-60k/chunked" &
    wait
    runs="eval/results/fair_chunks/$policy-60k"
    python eval/fair_chunks.py --data "$DATA" --policies "$policy" --exact-dir "$runs/exact" \
        --chunked-dir "$runs/chunked" --throughput-from eval/results/fair_chunks.json \
        --out "eval/results/fair_chunks_${policy}_60k.json"
done
# Speed: scanned forwards, workers vs threads, runs as rows of one batch, a compiled forward (each measured alone)
python eval/bench_scan.py --data "$DATA" --policies h2o,tova,keydiff,sink
python eval/bench_workers.py --data "$DATA" --tokens 30000 --rounds 1
python eval/bench_rows.py --data "$DATA" --threads 1,2 --rounds 2 --tokens 2048
python eval/bench_compile.py
python eval/profile_ppl.py --before 1c91960^ --data "$DATA" --out eval/results/profile_ppl.json  # before scanning
# ppl today against ppl at d559c09 (main when the speed issue measured 272 tok/s) and the raw forwards, side by side
python eval/bench_vs_baseline.py --data "$DATA" --baseline d559c09 --tokens 4096 --rounds 3 --threads 1,2
python eval/bench_vs_baseline.py --data "$DATA" --baseline d559c09 --tokens 4096 --rounds 3 --threads 2 \
    --out eval/results/bench_vs_baseline_2threads_recheck.json  # run C: 2 threads again, right after
python eval/bench_vs_baseline.py --data "$DATA" --baseline d559c09 --tokens 4096 --rounds 3 --threads 1,2 \
    --out eval/results/bench_vs_baseline_run_d.json  # run D: after the NLL and sink-attention changes (at 4151aa9)
python eval/bench_vs_baseline.py --data "$DATA" --baseline d559c09 --tokens 4096 --rounds 3 --threads 1,2 \
    --out eval/results/inference_mode/bench_vs_baseline_run_e.json  # run E: with inference mode (at 921dcd6)
# ppl sink's chunk against the raw eager forward in one process, before/after those changes; the NLL alone
python eval/bench_sink_chunk.py --data "$DATA" --before 97bc2d2 --after 4151aa9 --threads 1,2 --chunks 16 --rounds 3
python eval/bench_nll.py --threads 1,2 --rounds 20
# exact mode and chat on the next session's machine, after the cut and rotation changes (at 4151aa9)
python eval/bench_exact.py --threads 2 --rounds 8 --out eval/results/decode_now/bench_exact_2threads.json
python eval/bench_exact.py --threads 1 --rounds 8 --out eval/results/decode_now/bench_exact_1thread.json
# after forwards with gradients off run in inference mode (f9fca72): the raw decode step timed both ways, and every
# fair policy against a raw twin with gradients off and one in inference mode (eval/results/inference_mode/)
for threads in 2 1; do
    python eval/bench_exact.py --threads "$threads" --block 4 --rounds 32 --policies h2o,sink,window,full,tova,chat \
        --out "eval/results/inference_mode/bench_exact_${threads}thread$([ "$threads" = 1 ] || echo s).json"
done
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 512 --alternate forwards \
    --out eval/results/inference_mode/fair_chunks_paired.json
# after keep_twice and no scores for policies that need none (8131c80): the same, with keydiff and roco in exact mode
# (eval/results/keep_twice/), and the chunked runs of roco, keydiff and sink again (eval/results/fair_chunks/rechecked/)
for threads in 2 1; do
    python eval/bench_exact.py --threads "$threads" --block 4 --rounds 32 \
        --policies h2o,sink,window,full,tova,keydiff,roco,chat \
        --out "eval/results/keep_twice/bench_exact_${threads}thread$([ "$threads" = 1 ] || echo s).json"
done
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 512 --alternate forwards \
    --out eval/results/keep_twice/fair_chunks_paired.json
python eval/fair_chunks.py --data "$DATA" --policies h2o,keydiff,roco --threads 2 --rounds 5 --round-tokens 512 \
    --alternate forwards --out eval/results/keep_twice/fair_chunks_paired_recheck.json
h2o-stream ppl --threads 1 --data "$DATA" --tokens 20000 --policy roco,keydiff,sink --cache-size 256 \
    --out eval/results/fair_chunks/rechecked
# the raw forward with the weights memory-mapped (as transformers loads them) or copied out (as load_model does)
python eval/bench_weights.py --data "$DATA" --rounds 3 --threads 1,2
# one layer's cache work per decode step before/after a change (here: the reverted in-place append)
python eval/bench_layer.py --before 4726b47^ --after 4726b47 --policies h2o,sink,tova --threads 1 --rounds 5
python eval/bench_layer.py --before 97bc2d2 --after 4151aa9 --policies h2o,sink,tova,keydiff --rounds 7 \
    --out eval/results/bench_layer_keep_top.json  # keep_top, memoised slot ranges and table rows, roll
# The leaderboard: every policy at 128/256/512 over 250k tokens, then the best two with h2o and sink at 256 over 1M.
# Rerunning continues: finished runs are kept from their result files (also on a fresh clone), an interrupted run
# resumes from its checkpoint where this machine has one.
h2o-stream leaderboard --data "$DATA" --tokens 250000 --workers 2 --out eval/results/leaderboard
# The long fair-chunk runs at 256 (eval/results/long_fair): the best two of the leaderboard (sink, sepllm) and h2o to
# 1,048,576 tokens, then h2o and sink on to the 4M headline. They were seeded with the leaderboard's 250k checkpoints
# (cp eval/results/leaderboard/runs/{sink,sepllm,h2o}-256.{ckpt,json} eval/results/long_fair/), which gives the same
# result as starting from zero: --resume continues exactly. A run's checkpoint stays in its --out directory; in
# eval/results/long_fair and long_4m checkpoints are not git-ignored: an unfinished run's checkpoint is committed at
# the end of a session (12 MB at cache 256), so that the next session, on whatever machine, continues it. Delete a
# run's checkpoint once its result covers the tokens asked for (its result file is all a later --resume needs).
LONG_FAIR=(--data "$DATA" --cache-size 256 --threads 1 --out eval/results/long_fair --resume)
h2o-stream ppl "${LONG_FAIR[@]}" --policy sink,sepllm,h2o --tokens 1048576 --workers 2
# 128 and 512 to 1M the same way, from the leaderboard's {sink,h2o}-{128,512} checkpoints
h2o-stream ppl "${LONG_FAIR[@]/256/128,512}" --policy sink,h2o --tokens 1048576 --workers 2
python eval/long_run_report.py eval/results/long_fair --window 100000
# The 4M headline (eval/results/long_4m): sink and h2o at 256 continue from their 1M checkpoints
# (cp eval/results/long_fair/{sink,h2o}-256.{ckpt,json} eval/results/long_4m/). A resumed process records where it
# began (process_starts in the result), so memory growth is read within the last process.
h2o-stream ppl "${LONG_FAIR[@]/long_fair/long_4m}" --policy sink,h2o --tokens 4000000 --workers 2
python eval/long_run_report.py eval/results/long_4m --window 200000
# The long runs below were made before fair chunks (chunk 256 with the whole cache visible, i.e. --wide-chunks; the
# 128 runs with a chunk wider than their cache, which ppl now refuses): the settings to reproduce them exactly.
# h2o and sink as one-thread processes side by side, checkpointed every 20k tokens.
# Committed: cache 256 to 1,048,576 tokens (LONG_256_TOKENS), cache 128 and 512 to 350,000 (LONG_OTHER_TOKENS).
LONG=(--data "$DATA" --chunk-size 256 --wide-chunks --threads 1 --checkpoint-every 20000 --out eval/results/pg19_long
      --resume)
long_run() {  # cache size, policy, tokens: in the background
    OMP_WAIT_POLICY=PASSIVE h2o-stream ppl "${LONG[@]}" --cache-size "$1" --policy "$2" --tokens "$3" &
}
for policy in h2o sink; do long_run 256 "$policy" "${LONG_256_TOKENS:-1048576}"; done
wait
for size in 128 512; do
    for policy in h2o sink; do long_run "$size" "$policy" "${LONG_OTHER_TOKENS:-350000}"; done
done
wait
h2o-stream ppl "${LONG[@]}" --cache-size 256 --policy h2o,sink --tokens "${LONG_256_TOKENS:-1048576}"
h2o-stream ppl "${LONG[@]}" --cache-size 128,512 --policy h2o,sink --tokens "${LONG_OTHER_TOKENS:-350000}"  # ppl.png
python eval/long_run_report.py eval/results/pg19_long --window 50000   # figure5.png + report.json over all six runs
# Exact mode compiled (engine/compiled.py, 2026-12-02), each measured alone: exact mode scanned and one token per
# forward, compiled and on tensor operations, against the raw forwards; decode and chat against the raw decode step;
# fair chunks forward by forward against their raw twins (tova and roco, exact mode by default: one token per
# forward against the raw decode step, shorter rounds)
python eval/bench_compiled.py --data "$DATA" --rounds 3 --out eval/results/compiled/bench_compiled.json
for threads in 2 1; do
    suffix=$([ "$threads" = 1 ] && echo 1thread || echo 2threads)
    python eval/bench_exact.py --threads "$threads" --block 4 --rounds 32 \
        --policies h2o,sink,window,full,tova,roco,chat --out "eval/results/compiled/bench_exact_$suffix.json"
done
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 96 --alternate forwards \
    --policies tova,roco --out eval/results/compiled/fair_chunks_paired_exact.json
python eval/fair_chunks.py --data "$DATA" --threads 2 --rounds 5 --round-tokens 512 --alternate forwards \
    --policies h2o,sink,window,a2sf,h2o_sinks,sepllm,keydiff --out eval/results/compiled/fair_chunks_paired_chunked.json
# roco's leaderboard runs again at its new default (exact mode); its chunk-8 runs moved to leaderboard/roco_chunk8/
h2o-stream leaderboard --data "$DATA" --tokens 250000 --workers 2 --out eval/results/leaderboard
python eval/needle.py --policies roco --lengths 1024,2048 --trials 3 --data "$DATA" \
    --out eval/results/needle_roco_exact  # roco in exact mode, its default since the compiled loop
python eval/bench_peak.py --out eval/results/compiled/bench_peak.json  # the fp32 products' ceiling on tok/s
