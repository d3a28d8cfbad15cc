"""The oracle over a real run's requests: infinite cache, perfect affinity, send order."""
from __future__ import annotations

from loadtest.replay_oracle import oracle_hit_rate
from loadtest.results import RequestRecord
from loadtest.workload import Session, Turn, Workload


def _turn(shared: int, new: tuple[int, ...]) -> Turn:
    return Turn(think_time_s=0.0, in_tokens=0, out_tokens=1, shared_blocks=shared, new_hash_ids=new)


def _rec(session: str, turn: int, t: float, prompt: int, status: int = 200) -> RequestRecord:
    return RequestRecord(session=session, turn=turn, t_start_s=t, status=status, prompt_tokens=prompt)


def test_oracle_counts_prefixes_seen_earlier_in_send_order() -> None:
    a = Session("a", "ns", 10, (_turn(0, (1, 2)), _turn(2, (3,))))
    b = Session("b", "ns", 10, (_turn(0, (1, 9)),))
    other = Session("c", "other-ns", 10, (_turn(0, (1, 2)),))  # same ids, other namespace
    workload = Workload("t", (a, b, other))
    records = [
        _rec("a", 1, 2.0, 35),  # blocks 1,2 seen (20 tokens) of 35
        _rec("a", 0, 0.0, 25),  # first: nothing seen
        _rec("b", 0, 1.0, 20),  # block 1 seen: 10 of 20
        _rec("c", 0, 3.0, 20),  # another namespace: nothing
        _rec("b", 0, 4.0, 20, status=503),  # failed requests do not count
    ]
    assert oracle_hit_rate(workload, records) == (0 + 10 + 20 + 0) / (25 + 20 + 35 + 20)


def test_no_successful_request_has_no_rate() -> None:
    workload = Workload("t", (Session("a", "ns", 10, (_turn(0, (1,)),)),))
    assert oracle_hit_rate(workload, [_rec("a", 0, 0.0, 10, status=503)]) is None
