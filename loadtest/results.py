"""Per-request records, the run summary, and the JSON results file.

Durations are in *target seconds*: wall seconds multiplied by the run's ``time_scale``
(a simulated fleet running ``time_scale`` times faster than real time reports what the
real fleet would have taken). Summary field names are shared with `kvgate simulate`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.percentile import percentile


@dataclass(frozen=True, slots=True)
class RequestRecord:
    session: str
    turn: int
    t_start_s: float  # since the start of the run
    status: int  # HTTP status (0: no response)
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    output_tps: float | None = None  # (output_tokens - 1) / (last - first token chunk time): decode speed per user
    itl_mean_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    replica: str | None = None  # x-kvgate-replica, when the target sends it
    rejected: bool = False  # 429 / 503
    error: str | None = None
    trace_in_tokens: int = 0
    trace_out_tokens: int = 0
    agent: bool = False  # a subagent's request
    itl_s: tuple[float, ...] | None = None  # every inter-token gap (only with keep_itl)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    rejected: int
    errors: int
    cache_hit_rate: float | None  # sum cached / sum prompt tokens (successful requests)
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    output_tps_per_user_p50: float | None
    throughput_tokens_per_s_per_gpu: float | None  # output tokens / makespan / GPUs
    output_tokens_per_min_per_gpu: float | None
    imbalance: float | None  # max / mean requests per replica
    token_imbalance: float | None  # max / mean prompt tokens per replica
    makespan_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    gpus: int
    replicas: dict[str, int] = field(default_factory=dict)  # requests per replica


def summarize(records: Iterable[RequestRecord], gpus: int | None = None,
              replicas: int | None = None, gpus_per_replica: int = 8) -> Summary:
    recs = list(records)
    good = [r for r in recs if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in good)
    cached = sum(r.cached_tokens or 0 for r in good)
    out = sum(r.output_tokens for r in good)
    per_replica: dict[str, int] = {}
    tokens_per_replica: dict[str, int] = {}
    for r in good:
        if r.replica is not None:
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
            tokens_per_replica[r.replica] = tokens_per_replica.get(r.replica, 0) + (r.prompt_tokens or 0)
    n_replicas = replicas or max(1, len(per_replica))
    n_gpus = gpus or n_replicas * gpus_per_replica
    ends = [r.t_start_s + (r.e2e_s or 0.0) for r in recs]
    makespan = (max(ends) - min(r.t_start_s for r in recs)) if recs else 0.0
    tput = out / makespan / n_gpus if makespan > 0 else None
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    tps = [r.output_tps for r in good if r.output_tps is not None]
    return Summary(
        requests=len(recs), ok=len(good), rejected=sum(r.rejected for r in recs),
        errors=sum(1 for r in recs if not r.ok and not r.rejected),
        cache_hit_rate=cached / prompt if prompt else None,
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99), output_tps_per_user_p50=percentile(tps, 50),
        throughput_tokens_per_s_per_gpu=tput,
        output_tokens_per_min_per_gpu=tput * 60 if tput is not None else None,
        imbalance=_imbalance(per_replica, n_replicas),
        token_imbalance=_imbalance(tokens_per_replica, n_replicas),
        makespan_s=makespan, output_tokens=out, prompt_tokens=prompt, cached_tokens=cached,
        gpus=n_gpus, replicas=dict(sorted(per_replica.items())),
    )


def _imbalance(counts: Mapping[str, int], n_replicas: int) -> float | None:
    if not counts:
        return None
    mean = sum(counts.values()) / max(n_replicas, len(counts))
    return max(counts.values()) / mean if mean else None


@dataclass(frozen=True)
class RunResult:
    """One run: its label (policy/target), configuration, records and summary."""

    label: str
    config: Mapping[str, Any]
    records: tuple[RequestRecord, ...]
    summary: Summary


def _record_dict(r: RequestRecord, keep_itl: bool) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    if not keep_itl or d["itl_s"] is None:
        d.pop("itl_s")
    return d


def to_json(runs: Sequence[RunResult], keep_itl: bool = False) -> bytes:
    doc = {"runs": [{"label": run.label, "config": dict(run.config),
                     "summary": dataclasses.asdict(run.summary),
                     "records": [_record_dict(r, keep_itl) for r in run.records]} for run in runs]}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)


def write_json(path: str | Path, runs: Sequence[RunResult], keep_itl: bool = False) -> None:
    Path(path).write_bytes(to_json(runs, keep_itl))


def read_json(path: str | Path) -> list[RunResult]:
    doc = orjson.loads(Path(path).read_bytes())
    runs = []
    for run in doc["runs"]:
        recs = tuple(RequestRecord(**{**r, "itl_s": tuple(r["itl_s"]) if r.get("itl_s") else None})
                     for r in run["records"])
        runs.append(RunResult(run["label"], run["config"], recs, Summary(**run["summary"])))
    return runs
