#!/bin/bash
# Keep the long runs' checkpoints out of main's history but in the repository: replace branch long-run-checkpoints
# with one parentless commit holding every *.ckpt and run result of eval/results/{long_fair,long_4m} and the
# leaderboard's unfinished runs (eval/results/leaderboard/runs/*.ckpt) found in the given checkouts, each at its path
# in the repository. Usage (from a checkout of main): eval/save_checkpoints.sh CHECKOUT... (default: this one).
# Restore into a clone of main with: git archive long-run-checkpoints | tar -x
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
index=$(mktemp)
trap 'rm -f "$index"' EXIT
export GIT_INDEX_FILE=$index
git -C "$repo" read-tree --empty
names=""
for checkout in "${@:-$repo}"; do
  for dir in eval/results/long_fair eval/results/long_4m eval/results/leaderboard/runs; do
    for f in "$checkout/$dir"/*-*.ckpt "$checkout/$dir"/*-*.json; do
      [ -e "$f" ] || continue
      path=$dir/$(basename "$f")
      case $path in
        eval/results/long_fair/*-256.ckpt) continue;;  # finished at 1M; their continuation is long_4m's
        eval/results/leaderboard/runs/*.json) continue;;  # finished leaderboard runs are committed on main
      esac
      blob=$(git -C "$repo" hash-object -w "$f")
      git -C "$repo" update-index --add --cacheinfo "100644,$blob,$path"
      case $f in *.ckpt) names="$names $path";; esac
    done
  done
done
tree=$(git -C "$repo" write-tree)
commit=$(echo "long-run checkpoints:$names (restore into a clone of main: git archive long-run-checkpoints | tar -x)" |
         git -C "$repo" commit-tree "$tree")
git -C "$repo" update-ref refs/heads/long-run-checkpoints "$commit"
git -C "$repo" ls-tree -r --long long-run-checkpoints | awk '{print $4, $5}'
