#!/usr/bin/env bash
# The virtual-time sweep behind the cache-aware defaults (docs/benchmarks.md, section 1.3):
# the bench-peers setting (8 replicas, KV x0.25, think capped at 30 s, 300 simulated s)
# on three disjoint slices of the Claude Code sessions, 32/64/128 concurrent and
# think x0.1, without and with a 60 s ramp. One JSON per run in OUT (default
# /tmp/kvgate-sweep-moves); `python scripts/sweep_moves_table.py OUT` prints the table.
# Extra arguments go to every `kvgate simulate` (e.g. --policy-params '{...}').
set -euo pipefail
out=${OUT:-/tmp/kvgate-sweep-moves}
policies=${POLICIES:-cache-aware,sglang-cache-aware}
trace=${TRACE:-$(dirname "$0")/../../shared/traces/claude-code}
mkdir -p "$out"
for ramp in 0 60; do
  for skip in 0 120 232; do
    for run in c32:32:1 c64:64:1 c128:128:1 c64-think0.1:64:0.1; do
      IFS=: read -r name conc think <<<"$run"
      kvgate simulate --trace "$trace" --skip-sessions "$skip" --limit-sessions 128 \
        --replicas 8 --kv-scale 0.25 --policy "$policies" --sessions-concurrent "$conc" \
        --think-scale "$think" --max-think-s 30 --ramp-s "$ramp" --sim-duration-s 300 \
        --quiet --json "$out/$name-skip$skip-ramp$ramp.json" "$@"
    done
  done
done
