"""Rich presentation: summary tables (one column per run, so policies/targets read side
by side), the sweep table, and a progress bar around a driver run."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtest.driver import DriverConfig, drive
from loadtest.results import RequestRecord, RunResult, Summary, summarize
from loadtest.workload import Workload


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


ROWS: tuple[tuple[str, Callable[[Summary], str]], ...] = (
    ("requests", lambda s: f"{s.requests:,}"),
    ("rejected (429/503)", lambda s: f"{s.rejected:,}"),
    ("errors", lambda s: f"{s.errors:,}"),
    ("cache hit rate", lambda s: _pct(s.cache_hit_rate)),
    ("TTFT p50", lambda s: _secs(s.ttft_p50_s)),
    ("TTFT p90", lambda s: _secs(s.ttft_p90_s)),
    ("TTFT p99", lambda s: _secs(s.ttft_p99_s)),
    ("output tok/s per user p50", lambda s: _num(s.output_tps_per_user_p50)),
    ("output tok/s per GPU", lambda s: _num(s.throughput_tokens_per_s_per_gpu)),
    ("imbalance (max/mean req)", lambda s: _ratio(s.imbalance)),
    ("prompt tokens", lambda s: f"{s.prompt_tokens:,}"),
    ("output tokens", lambda s: f"{s.output_tokens:,}"),
)


def summary_table(runs: Sequence[RunResult], title: str = "kvgate load test") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric", style="bold")
    for run in runs:
        table.add_column(run.label, justify="right")
    for name, fmt in ROWS:
        table.add_row(name, *(fmt(run.summary) for run in runs))
    return table


def sweep_table(runs: Sequence[RunResult], title: str = "kvgate load-test sweep") -> Table:
    """One row per run (policy x concurrency): the throughput/interactivity trade-off."""
    table = Table(title=title, title_justify="left")
    for col in ("run", "conc.", "requests", "errors", "hit rate", "TTFT p50", "TTFT p99",
                "tok/s/user p50", "tok/s/GPU", "imbalance"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for run in runs:
        s = run.summary
        table.add_row(run.label, str(run.config.get("sessions_concurrent", "-")), f"{s.requests:,}",
                      f"{s.errors + s.rejected:,}", _pct(s.cache_hit_rate), _secs(s.ttft_p50_s),
                      _secs(s.ttft_p99_s), _num(s.output_tps_per_user_p50),
                      _num(s.throughput_tokens_per_s_per_gpu), _ratio(s.imbalance))
    return table


def print_summary(runs: Sequence[RunResult], console: Console | None = None, title: str = "kvgate load test") -> None:
    (console or Console()).print(summary_table(runs, title))


def run_with_progress(workload: Workload, config: DriverConfig, label: str,
                      console: Console | None = None, run_config: Mapping[str, Any] | None = None,
                      replicas: int | None = None, gpus_per_replica: int = 8) -> RunResult:
    """Drive ``workload`` with a rich progress bar; returns the run with its summary."""
    total = workload.request_count()
    if config.max_requests is not None:
        total = min(total, config.max_requests)
    timed = config.duration_s is not None  # the bar tracks time, the status the requests
    columns = (TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(), transient=False) as progress:
        task = progress.add_task(label, total=config.duration_s if timed else total, status="")
        counts = {"ok": 0, "err": 0, "prompt": 0, "cached": 0}
        t0 = time.monotonic()

        def on_record(rec: RequestRecord) -> None:
            counts["ok" if rec.ok else "err"] += 1
            counts["prompt"] += rec.prompt_tokens or 0
            counts["cached"] += rec.cached_tokens or 0
            hit = counts["cached"] / counts["prompt"] if counts["prompt"] else 0.0
            done = counts["ok"] + counts["err"]
            progress.update(task, completed=min(time.monotonic() - t0, config.duration_s or 0.0) if timed else done,
                            status=f"{done}/{total} requests  hit {100 * hit:.0f}%  errors {counts['err']}")

        records, stats = asyncio.run(drive(workload, config, on_record))
    summary = summarize(records, replicas=replicas, gpus_per_replica=gpus_per_replica)
    cfg = {**dataclasses.asdict(config), **(run_config or {}), "driver": stats,
           "workload": workload.name, "sessions": len(workload.sessions)}
    return RunResult(label, cfg, tuple(records), summary)
