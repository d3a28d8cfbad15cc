"""The TTFT tail breakdown of a simulated run (loadtest/fleetsim/tail.py), on hand-made records."""
from __future__ import annotations

import pytest

from loadtest.fleetsim.metrics import Record
from loadtest.fleetsim.tail import tail_breakdown


def rec(arrival: float, ttft: float, turn: int = 1, reason: str = "affinity", prompt: int = 1000,
        cached: int = 900) -> Record:
    return Record(session=f"s{arrival}", turn=turn, agent=False, arrival_s=arrival, prompt_tokens=prompt,
                  reason=reason, cached_device=cached, first_token_s=arrival + ttft, finish_s=arrival + ttft + 1)


def test_the_tail_is_the_requests_at_or_above_the_p99_and_says_where_they_come_from() -> None:
    # 198 fast warm requests spread over an hour, 2 slow cold first turns at t = 5 s
    records = [rec(100.0 + i * 10, 0.1) for i in range(198)]
    records += [rec(5.0, 20.0, turn=0, reason="new-session", cached=0),
                rec(6.0, 30.0, turn=0, reason="new-session", cached=0)]
    records.append(Record(session="x", turn=3, agent=False, arrival_s=7.0, prompt_tokens=10, rejected=True))
    tail = tail_breakdown(records)
    assert tail is not None
    assert tail["requests"] == 2  # the p99 of 200 lies between the two slow ones and below them
    assert tail["first_minute_share"] == 1.0 and tail["first_turn_share"] == 1.0
    assert tail["reasons"] == {"new-session": 2}
    assert tail["uncached_tokens_p50"] == 1000 and tail["uncached_tokens_p50_all"] == 100
    assert tail["first_minute_requests"] == 2  # the rejected one is not served
    assert tail["first_minute_ttft_p99_s"] == pytest.approx(29.9)


def test_no_served_request_no_tail() -> None:
    assert tail_breakdown([]) is None
    assert tail_breakdown([Record(session="x", turn=0, agent=False, arrival_s=0.0, prompt_tokens=1,
                                  rejected=True)]) is None
