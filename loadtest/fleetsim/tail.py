"""Who the slowest requests of a simulated run are: the TTFT tail, broken down.

A run's TTFT p99 is one number; what a routing change can do about it depends on which
requests make it. ``tail_breakdown(records)`` takes the served requests whose TTFT is at
or above the run's p99 (the same percentile as the summary) and reports, against the
whole run:

- ``first_minute_share``: the share of the tail that arrived in the run's first 60
  simulated seconds (the start-up burst of a closed loop: every session starts cold at
  once), and ``first_minute_ttft_p99_s``, the p99 of that minute's requests alone;
- ``first_turn_share``: the share of the tail that is a session's first request (a cold
  prefill no placement can avoid);
- ``reasons``: the routing reasons of the tail's decisions;
- ``uncached_tokens_p50`` of the tail and of the whole run (prompt minus reported cached
  tokens: the prefill each request paid).

It is part of every ``kvgate simulate`` result (``ttft_tail`` in the JSON).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadtest.fleetsim.metrics import Record, served, ttfts
from loadtest.percentile import percentile

TAIL_Q = 99.0
FIRST_WINDOW_S = 60.0


def tail_breakdown(records: Sequence[Record], q: float = TAIL_Q) -> dict[str, Any] | None:
    """The breakdown above for the requests at or above the run's ``q``-th TTFT percentile."""
    done = served(records)
    timed = list(zip(done, ttfts(done), strict=True))
    if not timed:
        return None
    cut = percentile([t for _, t in timed], q)
    assert cut is not None
    tail = [r for r, t in timed if t >= cut]
    start = min(r.arrival_s for r, _ in timed)
    first = [t for r, t in timed if r.arrival_s - start < FIRST_WINDOW_S]
    return {
        "q": q,
        "ttft_cut_s": cut,
        "requests": len(tail),
        "first_minute_share": sum(r.arrival_s - start < FIRST_WINDOW_S for r in tail) / len(tail),
        "first_minute_requests": len(first),
        "first_minute_ttft_p99_s": percentile(first, q),
        "first_turn_share": sum(r.turn == 0 for r in tail) / len(tail),
        "reasons": dict(Counter(r.reason for r in tail).most_common()),
        "uncached_tokens_p50": percentile([r.prompt_tokens - r.cached for r in tail], 50.0),
        "uncached_tokens_p50_all": percentile([r.prompt_tokens - r.cached for r, _ in timed], 50.0),
    }
