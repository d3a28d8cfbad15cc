"""Tables and replica-side figures of `kvgate bench peers` (see loadtest/bench_peers.py).

Replica side: every simulated replica's ``sglang:num_requests_total``,
``prompt_tokens_total`` and ``cached_tokens_total`` (summed over their label sets), read
before and after each run, give requests per replica (the imbalance, the same way for
every target: the peers send no ``x-kvgate-replica``) and the replicas' own hit rate.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import httpx
from rich.table import Table

from loadtest.report import _num, _pct, _ratio, _secs
from loadtest.results import RequestRecord, RunResult

COUNTER = re.compile(
    rb"^sglang:(num_requests|prompt_tokens|cached_tokens)_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE
)


def replica_counters(urls: Sequence[str]) -> list[dict[str, float]]:
    """Per replica: requests, prompt and cached tokens so far (sums over label sets)."""
    out = []
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        for url in urls:
            sums = {"num_requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
            for name, value in COUNTER.findall(client.get(url + "/metrics").content):
                sums[name.decode()] += float(value)
            out.append(sums)
    return out


def with_replica_side(
    run: RunResult,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    extra: dict[str, object],
) -> RunResult:
    """The run with its imbalance taken from the replicas' own request counters."""
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    reqs = [d["num_requests"] for d in delta]
    prompt = sum(d["prompt_tokens"] for d in delta)
    mean = sum(reqs) / len(reqs) if reqs else 0.0
    tok_mean = prompt / len(delta) if delta else 0.0
    summary = dataclasses.replace(
        run.summary,
        replicas={f"r{i}": int(n) for i, n in enumerate(reqs)},
        imbalance=max(reqs) / mean if mean else None,
        token_imbalance=max(d["prompt_tokens"] for d in delta) / tok_mean if tok_mean else None,
    )
    side = {
        "requests": reqs,
        "prompt_tokens": [d["prompt_tokens"] for d in delta],
        "hit_rate": sum(d["cached_tokens"] for d in delta) / prompt if prompt else None,
    }
    return dataclasses.replace(
        run, summary=summary, config={**run.config, "replica_side": side, **extra}
    )


def over_context(rec: RequestRecord) -> bool:
    """A request the replica refused because its prompt exceeds the context (a workload
    property: every target sends it; the Claude Code traces reach ~900k tokens)."""
    return rec.error is not None and "context_length" in rec.error


def routing_errors(run: RunResult) -> int:
    """Failed requests other than over-context refusals."""
    return sum(1 for r in run.records if not r.ok and not over_context(r))


def cpu_per_request_ms(run: RunResult) -> float | None:
    cpu = run.config.get("target_cpu_s")
    return (
        1e3 * float(cpu) / run.summary.requests
        if cpu is not None and run.summary.requests
        else None
    )


def out_ratio(run: RunResult) -> float | None:
    """Completion tokens received / requested, over successful requests."""
    asked = sum(r.trace_out_tokens for r in run.records if r.ok)
    return sum(r.output_tokens for r in run.records if r.ok) / asked if asked else None


def peers_table(runs: Sequence[RunResult], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    cols = (
        "target",
        "conc.",
        "requests",
        "errors",
        "over ctx",
        "hit rate",
        "oracle",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "tok/s/user p50",
        "tok/s/GPU",
        "imbalance",
        "out/asked",
        "router CPU/req",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "target" else "right")
    for run in runs:
        s = run.summary
        cpu = cpu_per_request_ms(run)
        table.add_row(
            str(run.config.get("target_label", run.label)),
            str(run.config.get("sessions_concurrent")),
            f"{s.requests:,}",
            "start failed" if "error" in run.config else f"{routing_errors(run):,}",
            f"{sum(map(over_context, run.records)):,}",
            _pct(s.cache_hit_rate),
            _pct(oracle if isinstance(oracle := run.config.get("oracle_hit_rate"), float) else None),
            _secs(s.ttft_p50_s),
            _secs(s.ttft_p90_s),
            _secs(s.ttft_p99_s),
            _num(s.output_tps_per_user_p50),
            _num(s.throughput_tokens_per_s_per_gpu),
            _ratio(s.imbalance),
            _ratio(out_ratio(run)),
            "-" if cpu is None else f"{cpu:.1f} ms",
        )
    return table
