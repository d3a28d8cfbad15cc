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

The whole-run throughput above is dominated, in a closed loop over recorded agent
sessions, by the run's length (set by the longest session, with its recorded think
times), not by the load: `steady_window` and `window_summary` measure a run only over
the part where its concurrency target is held (`loadtest.fleetsim.capacity` uses them;
the definition is there).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.percentile import percentiles
from loadtest.workload import Session


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


def served(records: Sequence[Record]) -> list[Record]:
    """The requests that were served (not rejected, first token seen)."""
    return [r for r in records if not r.rejected and r.first_token_s is not None]


def ttfts(done: Sequence[Record]) -> list[float]:
    return [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]


def user_tps(done: Sequence[Record]) -> list[float]:
    """Per request: output tokens/s after the first token (the load test's interactivity)."""
    return [(r.completion_tokens - 1) / (r.finish_s - r.first_token_s) for r in done
            if r.finish_s is not None and r.first_token_s is not None
            and r.completion_tokens > 1 and r.finish_s > r.first_token_s]


def summarize(records: Sequence[Record], replicas: int, gpus: int,
              prefill_busy_s: Sequence[float], prefill_tokens: int) -> dict[str, Any]:
    """The summary fields (see the module docstring) of one run."""
    done = served(records)
    prompt = sum(r.prompt_tokens for r in done)
    dev, host = sum(r.cached_device for r in done), sum(r.cached_host for r in done)
    out = sum(r.completion_tokens for r in done)
    ttft, tps = ttfts(done), user_tps(done)
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
    done = served(records)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.oracle_cached for r in done)
    ttft = [max(r.prompt_tokens - r.oracle_cached, 1) / prefill_tokens_per_s for r in done]
    p50, p90, p99 = percentiles(ttft, (50, 90, 99))
    return {"policy": "oracle", "requests": len(done), "cache_hit_rate": _ratio(cached, prompt),
            "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99,
            "prompt_tokens": prompt, "cached_tokens": cached}


# -- the steady-state window of a closed-loop run (kvgate simulate --capacity) ----------------

@dataclass(frozen=True, slots=True)
class Window:
    """The part ``[start_s, end_s)`` of a run where ``target`` sessions were live at once."""

    target: int
    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s


def session_roots(sessions: Iterable[Session]) -> dict[str, str]:
    """Session id -> the id of its top-level session (subagents at any depth map to theirs)."""
    out: dict[str, str] = {}
    stack = [(s, s.id) for s in sessions]
    while stack:
        s, root = stack.pop()
        out[s.id] = root
        stack.extend((sub, root) for t in s.turns for sub in t.subagents)
    return out


def live_intervals(records: Iterable[Record],
                   roots: Mapping[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """Per top-level session: (its first request's arrival, the last end of any of its requests).

    A request ends at ``finish_s`` (or at its arrival when it was rejected before an engine
    saw it); a subagent's requests count for their root session (``roots``, from
    `session_roots`). Without ``roots`` every record's session is its own root and subagent
    records (``agent``) are left out.
    """
    spans: dict[str, tuple[float, float]] = {}
    for r in records:
        if roots is not None:
            root: str | None = roots.get(r.session, r.session)
        else:
            root = None if r.agent else r.session
        if root is None:
            continue
        end = r.finish_s if r.finish_s is not None else r.arrival_s
        a, b = spans.get(root, (r.arrival_s, end))
        spans[root] = (min(a, r.arrival_s), max(b, end))
    return spans


def steady_window(records: Iterable[Record], target: int,
                  roots: Mapping[str, str] | None = None) -> Window | None:
    """From the first moment ``target`` sessions are live to the first moment after it that
    fewer are (None: never ``target`` at once, or no time between the two).

    Sessions are live over `live_intervals`. All the starts and ends at one instant are
    applied before the count is read, so a session ending while the pool starts its
    replacement at the same simulated instant does not end the window. In a closed loop
    over a pool of sessions (``--sessions-concurrent``) the count can only fall below the
    target once the pool has no unstarted session left (or sending was stopped).
    """
    deltas: dict[float, int] = {}
    for a, b in live_intervals(records, roots).values():
        deltas[a] = deltas.get(a, 0) + 1
        deltas[b] = deltas.get(b, 0) - 1
    live, start = 0, None
    for t in sorted(deltas):
        live += deltas[t]
        if start is None and live >= target:
            start = t
        elif start is not None and live < target:
            return Window(target, start, t) if t > start else None
    return None


def tokens_in(r: Record, start_s: float, end_s: float) -> float:
    """Output tokens of ``r`` produced in ``[start_s, end_s)``: the first at ``first_token_s``,
    the other ``completion - 1`` spread evenly up to ``finish_s``."""
    ft, fin, n = r.first_token_s, r.finish_s, r.completion_tokens
    if ft is None or fin is None or n <= 0:
        return 0.0
    first = 1.0 if start_s <= ft < end_s else 0.0
    if n == 1:
        return first
    if fin <= ft:
        return n * first
    overlap = max(0.0, min(fin, end_s) - max(ft, start_s))
    return first + (n - 1) * overlap / (fin - ft)


def window_summary(records: Sequence[Record], window: Window, gpus: int) -> dict[str, Any]:
    """The SLO figures and throughput of the requests in ``window`` (same names as `summarize`).

    Requests *in* the window are those arriving in it (TTFT, interactivity, hit rate, the
    counts); ``throughput_tokens_per_s_per_gpu`` is every output token produced in it
    (`tokens_in`) / its length / ``gpus``.
    """
    inside = [r for r in records if window.start_s <= r.arrival_s < window.end_s]
    done = served(inside)
    prompt = sum(r.prompt_tokens for r in done)
    out = sum(tokens_in(r, window.start_s, window.end_s) for r in records)
    p50, p99 = percentiles(ttfts(done), (50, 99))
    return {
        "window_target": window.target, "window_start_s": window.start_s,
        "window_end_s": window.end_s, "window_s": window.length_s,
        "requests": len(inside), "completed": len(done),
        "rejected": sum(1 for r in inside if r.rejected),
        "cache_hit_rate": _ratio(sum(r.cached for r in done), prompt),
        "ttft_p50_s": p50, "ttft_p99_s": p99,
        "output_tps_per_user_p50": percentiles(user_tps(done), (50,))[0],
        "throughput_tokens_per_s_per_gpu": _ratio(out, window.length_s * gpus),
        "output_tokens": out, "gpus": gpus,
    }
