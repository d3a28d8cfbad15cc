"""Summary numbers, results JSON, the rich table and the PNG charts."""
from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from loadtest import charts, report
from loadtest.results import RequestRecord, RunResult, read_json, summarize, write_json


def _rec(i: int, replica: str, prompt: int, cached: int, ttft: float, status: int = 200) -> RequestRecord:
    return RequestRecord(session=f"s{i % 3}", turn=i, t_start_s=float(i), status=status, ttft_s=ttft,
                         e2e_s=2.0, output_tokens=100, output_tps=50.0 + i, prompt_tokens=prompt,
                         cached_tokens=cached, replica=replica, rejected=status in (429, 503),
                         error=None if status == 200 else "busy")


RECORDS = [_rec(0, "a", 1000, 0, 1.0), _rec(1, "a", 1000, 900, 0.1), _rec(2, "b", 2000, 1500, 0.2),
           _rec(3, "a", 500, 0, 0.3, status=503)]


def test_summary() -> None:
    s = summarize(RECORDS, gpus_per_replica=8)
    assert (s.requests, s.ok, s.rejected, s.errors) == (4, 3, 1, 0)
    assert s.cache_hit_rate == pytest.approx(2400 / 4000)
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.gpus == 16 and s.replicas == {"a": 2, "b": 1}
    assert s.imbalance == pytest.approx(2 / 1.5)
    assert s.makespan_s == pytest.approx(5.0)  # 0 .. 3 + 2
    assert s.throughput_tokens_per_s_per_gpu == pytest.approx(300 / 5.0 / 16)
    assert summarize([], replicas=2).cache_hit_rate is None


def _runs() -> list[RunResult]:
    return [RunResult(f"{p} c={c}", {"policy": p, "sessions_concurrent": c}, tuple(RECORDS),
                      summarize(RECORDS)) for p in ("cache-aware", "round-robin") for c in (4, 8)]


def test_json_round_trip(tmp_path: Path) -> None:
    write_json(tmp_path / "r.json", _runs())
    back = read_json(tmp_path / "r.json")
    assert back[0].records == tuple(RECORDS) and back[1].summary == _runs()[1].summary


def test_tables_render() -> None:
    console = Console(record=True, width=200)
    console.print(report.summary_table(_runs()[:2]))
    console.print(report.sweep_table(_runs()))
    text = console.export_text()
    assert "cache hit rate" in text and "60.0%" in text and "round-robin c=8" in text


def test_charts_png(tmp_path: Path) -> None:
    out = charts.write_charts(tmp_path / "c.png", _runs())
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
