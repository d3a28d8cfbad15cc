"""loadtest.peers.wakeups: context switches per streamed chunk, counted on real processes."""
from __future__ import annotations

import os
from pathlib import Path

import orjson

from loadtest.peers.wakeups import main, sleeps_by_thread


def test_sleeps_are_read_for_every_thread() -> None:
    mine = sleeps_by_thread(os.getpid())
    assert str(os.getpid()) in mine and all(count >= 0 for _, count in mine.values())


def test_tiny_run_counts_switches_per_chunk(tmp_path: Path) -> None:
    out = tmp_path / "wakeups.json"
    assert main(["--targets", "kvgate,python-floor", "--streams", "2", "--tokens", "20", "--json", str(out)]) == 0
    rows = orjson.loads(out.read_bytes())["rows"]
    assert [r["target"] for r in rows] == ["kvgate", "python-floor"]
    for row in rows:
        assert row["chunks"] >= 2  # at least one chunk of content per stream, and its end
        assert row["switches_per_chunk"] > 0 and abs(sum(row["by_thread"].values()) - row["switches_per_chunk"]) < 1e-9
