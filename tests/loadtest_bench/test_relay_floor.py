"""tools/bench/relay_floor.py: the byte-level splice relays whole streamed answers (real
processes: one simulated replica, the splice in its own process)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_splice_relays_every_event_and_reports_cpu() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "relay_floor.py"), "--relays", "splice", "--tokens", "16",
         "--requests", "6", "--concurrency", "2", "--time-scale", "100"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("splice"))
    answers, events = int(row[1]), float(row[2])
    assert answers == 6 and events >= 2  # each answer carried its SSE events ([DONE] included)
    assert "us" in row and "ms" in row
