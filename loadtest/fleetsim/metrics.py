"""Per-request records of a simulated run and the summary fields of `kvgate simulate`.

Field names match ``loadtest.results.Summary`` where they mean the same thing, so a
simulated run and a real load test read side by side.

- ``cache_hit_rate``: sum of cached tokens / sum of prompt tokens reported by the
  engines (completed requests), split ``cache_hit_rate_device`` / ``_host``.
- ``ttft_p50_s`` ...: engine first token - arrival at the gateway (simulated seconds).
- ``output_tps_per_user_p50``: median over requests of ``(completion - 1) / (finish -
  first token)`` (the first token arrives with the prefill; as the load test measures).
- ``throughput_tokens_per_s_per_gpu``: output tokens / simulated span / GPUs (span =
  first arrival to last finish); ``input_tokens_per_s_per_gpu`` likewise for prompt
  tokens and ``prefill_tokens_per_s_per_gpu`` for the uncached tokens computed.
- ``imbalance``: max / mean over replicas of prompt tokens routed;
  ``imbalance_busy``: the same for prefill busy time; ``imbalance_requests`` for counts.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.percentile import percentiles


@dataclass(slots=True)
class Record:
    """One request of a simulated run (mutable while the request is in flight)."""

    session: str
    turn: int
    agent: bool
    arrival_s: float
    prompt_tokens: int
    replica: int = -1
    reason: str = ""
    predicted_cached: int = 0
    oracle_cached: int = 0
    completion_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: bool = False

    @property
    def cached(self) -> int:
        return self.cached_device + self.cached_host


def imbalance(per_replica: Sequence[float]) -> float | None:
    mean = sum(per_replica) / len(per_replica) if per_replica else 0.0
    return max(per_replica) / mean if mean > 0 else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(records: Sequence[Record], replicas: int, gpus: int,
              prefill_busy_s: Sequence[float], prefill_tokens: int) -> dict[str, Any]:
    """The summary fields (see the module docstring) of one run."""
    done = [r for r in records if not r.rejected and r.first_token_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    dev, host = sum(r.cached_device for r in done), sum(r.cached_host for r in done)
    out = sum(r.completion_tokens for r in done)
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    tps = [(r.completion_tokens - 1) / (r.finish_s - r.first_token_s) for r in done
           if r.finish_s is not None and r.first_token_s is not None
           and r.completion_tokens > 1 and r.finish_s > r.first_token_s]
    ends = [r.finish_s for r in records if r.finish_s is not None]
    span = (max(ends) - min(r.arrival_s for r in records)) if ends else 0.0
    tokens = [0.0] * replicas
    counts = [0.0] * replicas
    for r in records:
        if r.replica >= 0:
            tokens[r.replica] += r.prompt_tokens
            counts[r.replica] += 1
    p50, p90, p99 = percentiles(ttft, (50, 90, 99))
    per_gpu_s = span * gpus
    reasons = Counter(r.reason for r in records if r.reason)
    return {
        "requests": len(records), "completed": len(done),
        "rejected": sum(1 for r in records if r.rejected),
        "cache_hit_rate": _ratio(dev + host, prompt),
        "cache_hit_rate_device": _ratio(dev, prompt), "cache_hit_rate_host": _ratio(host, prompt),
        "oracle_cache_hit_rate": _ratio(sum(r.oracle_cached for r in done), prompt),
        "predicted_cached_ratio": _ratio(sum(r.predicted_cached for r in done), dev + host),
        "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "output_tps_per_user_p50": percentiles(tps, (50,))[0],
        "throughput_tokens_per_s_per_gpu": _ratio(out, per_gpu_s),
        "input_tokens_per_s_per_gpu": _ratio(prompt, per_gpu_s),
        "prefill_tokens_per_s_per_gpu": _ratio(prefill_tokens, per_gpu_s),
        "imbalance": imbalance(tokens), "imbalance_busy": imbalance(list(prefill_busy_s)),
        "imbalance_requests": imbalance(counts),
        "span_s": span, "prompt_tokens": prompt, "cached_tokens": dev + host,
        "output_tokens": out, "gpus": gpus,
        "requests_per_replica": [int(c) for c in counts],
        "reasons": dict(sorted(reasons.items())),
    }


def oracle_summary(records: Sequence[Record], prefill_tokens_per_s: float) -> dict[str, Any]:
    """The oracle row: its hit rate and the TTFT of prefilling only the uncached tokens."""
    done = [r for r in records if not r.rejected and r.first_token_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.oracle_cached for r in done)
    ttft = [max(r.prompt_tokens - r.oracle_cached, 1) / prefill_tokens_per_s for r in done]
    p50, p90, p99 = percentiles(ttft, (50, 90, 99))
    return {"policy": "oracle", "requests": len(done), "cache_hit_rate": _ratio(cached, prompt),
            "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99,
            "prompt_tokens": prompt, "cached_tokens": cached}
