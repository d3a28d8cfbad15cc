"""tools/bench/relay_floor.py: the byte-level splice and the pass-through proxy relay whole
streamed answers (real processes: one simulated replica, each relay in its own process)."""
from __future__ import annotations

from tests.support.procs import bench_tool


def test_splice_and_python_floor_relay_every_event_and_report_cpu() -> None:
    # exit 1 also when the relays' event counts differ; at time scale 1 the replica never merges tokens
    relays = ("splice", "python-floor")
    out = bench_tool("relay_floor.py", "--relays", ",".join(relays), "--tokens", "16", "--requests", "6",
                     "--concurrency", "2", "--time-scale", "1")
    for relay in relays:
        row = next(line.split() for line in out.splitlines() if line.startswith(relay + " "))
        answers, events = int(row[1]), float(row[2])
        assert answers == 6 and events >= 2  # each answer carried its SSE events ([DONE] included)
        assert "us" in row and "ms" in row
