"""tools/bench/index_record.py: every tier configuration measured, against a git revision too."""
from __future__ import annotations

from tests.support.procs import bench_tool


def test_tiers_measured_and_compared_with_a_revision() -> None:
    out = bench_tool("index_record.py", "--tiers", "60/60,400/400", "--sessions", "3", "--blocks", "40",
                     "--turns", "6", "--against", "HEAD")
    rows = [line for line in out.splitlines() if "record p50" in line]
    assert len(rows) == 4 and sum("working tree" in r for r in rows) == 2 and sum("HEAD:" in r for r in rows) == 2
    assert out.count("working tree / HEAD:") == 2 and "12 records counted each" in out
