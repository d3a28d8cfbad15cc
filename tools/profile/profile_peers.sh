#!/usr/bin/env bash
# Profile `kvgate serve` inside `kvgate bench peers` (8 simulated replicas, KV x0.25, 64
# Claude Code sessions, time scale 5: the streamed workload whose router CPU per request
# issue 15 compares): py-spy attaches to the gateway 20 s into the run for 30 s, writing
# a flame graph and the top frames (self and inclusive, shares of non-idle samples).
#
#   tools/profile/profile_peers.sh OUT_DIR [extra bench peers args, e.g. --gateway-arg=...]
#   TARGET=python-floor NATIVE=1 tools/profile/profile_peers.sh OUT_DIR
#
# OUT_DIR gets peers-64.svg, peers-64.txt and the bench's own table (peers-64.log).
# TARGET: the process profiled (default kvgate; a floor of loadtest/peers/targets.py).
# NATIVE=1: py-spy --native (C frames too; it pauses the process to sample, so the
# bench's own figures are not comparable with an unprofiled run).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$1"; shift
mkdir -p "$OUT"
PY_SPY="$ROOT/.venv-tools/bin/py-spy"
[ -x "$PY_SPY" ] || "$ROOT/tools/profile/setup.sh"
cd "$ROOT"
python -m gateway.cli bench peers --trace ../shared/traces/claude-code --replicas 8 \
  --profile kimi-k2.6-b200-tp8 --kv-scale 0.25 --time-scale 5 --sessions-concurrent 64 \
  --limit-sessions 128 --duration-s 60 --max-think-s 30 --targets "${TARGET:-kvgate}" "$@" \
  > "$OUT/peers-64.log" 2>&1 &
BENCH=$!
case "${TARGET:-kvgate}" in
  python-floor) PATTERN="loadtest.peers.python_floor" ;;
  python-floor-protocol*) PATTERN="loadtest.peers.protocol_floor" ;;
  *) PATTERN="gateway.cli serve" ;;
esac
PID=""
for _ in $(seq 1 180); do
  sleep 1
  PID="$(pgrep -f "$PATTERN" | head -1 || true)"
  [ -n "$PID" ] && break
done
[ -n "$PID" ] || { echo "no gateway process found" >&2; kill "$BENCH"; exit 1; }
sleep 20  # past the start-up burst
RAW="$(mktemp)"
MODE=(--nonblocking)
[ -n "${NATIVE:-}" ] && MODE=(--native)
"$PY_SPY" record --pid "$PID" --duration 30 --rate 200 --format flamegraph --output "$OUT/peers-64.svg" \
  "${MODE[@]}" >/dev/null 2>&1 &
SVG=$!
"$PY_SPY" record --pid "$PID" --duration 30 --rate 200 --format raw --output "$RAW" "${MODE[@]}" >/dev/null 2>&1
wait "$SVG"
wait "$BENCH"
python - "$RAW" "$OUT/peers-64.txt" "$OUT/peers-64.log" <<'EOF'
import os, sys
sys.path.insert(0, "tools/profile")
from profile_serve import top_frames
raw, out, log = sys.argv[1:4]
total, selfs, incl = top_frames(open(raw).read(), 40)
row = [line for line in open(log) if line.startswith("│ ")]
lines = [f"# {os.environ.get('TARGET', 'kvgate')} in bench peers (64 sessions): {total} non-idle samples in 30 s, load average "
         + " ".join(f"{x:.2f}" for x in os.getloadavg()), "", "bench row: " + (row[-1].strip() if row else "-"),
         "", "## self (top frames)"]
lines += [f"{p:6.2f}%  {f}" for f, p in selfs] + ["", "## inclusive"] + [f"{p:6.2f}%  {f}" for f, p in incl]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines[:30]))
EOF
rm -f "$RAW"
