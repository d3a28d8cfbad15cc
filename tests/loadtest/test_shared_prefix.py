"""The shared-prefix generator: seeded, its shape, no session ids, disjoint halves; and
open-loop rate scaling and the halves of a recorded trace."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from loadtest import traces
from loadtest.percentile import percentile
from loadtest.shared_prefix import SharedPrefixParams, generate
from loadtest.workload import Session, Turn, Workload

SMALL = SharedPrefixParams(duration_s=600.0)


def _ids(w: Workload) -> set[int]:
    return {h for s in w.sessions for ids in s.hash_id_lists() for h in ids}


def test_seeded_and_halves_differ() -> None:
    assert generate(SMALL, seed=3) == generate(SMALL, seed=3)
    assert generate(SMALL, seed=3) != generate(SMALL, seed=4)
    assert generate(SMALL, seed=3, half="tuning") != generate(SMALL, seed=3, half="validation")


def test_halves_are_disjoint() -> None:
    tuning, validation = generate(SMALL, half="tuning"), generate(SMALL, half="validation")
    assert {s.namespace for s in tuning.sessions}.isdisjoint({s.namespace for s in validation.sessions})
    assert {s.id for s in tuning.sessions}.isdisjoint({s.id for s in validation.sessions})


def test_no_session_ids_and_open_loop() -> None:
    w = generate(SMALL, seed=1)
    assert w.open_loop and w.name == "synthetic-shared"
    assert all(not s.headers and s.parent is None for s in w.sessions)
    arrivals = [t.arrival_s for s in w.sessions for t in s.turns]
    assert min(arrivals) >= 0
    assert all(a.arrival_s < b.arrival_s for s in w.sessions for a, b in itertools.pairwise(s.turns))


def test_shape() -> None:
    w = generate(SMALL, seed=2)
    turns = [t for s in w.sessions for t in s.turns]
    assert 0.7 * 600 * 2.0 < len(w.sessions) < 1.3 * 600 * 2.0  # Poisson starts at 2 per s
    assert 1.4 < len(turns) / len(w.sessions) < 2.0  # 1 + Geometric(0.4): mean 1.67
    assert max(len(s.turns) for s in w.sessions) <= SMALL.max_turns
    ins = [float(t.in_tokens) for t in turns]
    outs = [float(t.out_tokens) for t in turns]
    assert 3_000 < (percentile(ins, 50) or 0) < 12_000
    assert 200 < (percentile(outs, 50) or 0) < 450
    assert all(len(ids) * SMALL.block_size <= t.in_tokens
               for s in w.sessions for ids, t in zip(s.hash_id_lists(), s.turns))


def test_later_turns_extend_earlier_ones_and_apps_share_prefixes() -> None:
    w = generate(SMALL, seed=2)
    for s in w.sessions:
        lists = [list(ids) for ids in s.hash_id_lists()]
        assert all(b[: len(a)] == a for a, b in itertools.pairwise(lists))
    firsts = [s.turns[0].new_hash_ids[:2] for s in w.sessions if len(s.turns[0].new_hash_ids) >= 2]
    most = max(firsts.count(f) for f in set(firsts))
    assert most > len(firsts) / 10  # the most popular app's prefix starts many conversations


def test_bad_half_is_refused() -> None:
    with pytest.raises(ValueError, match="half"):
        generate(SMALL, half="test")


def test_rate_scaled_divides_arrivals() -> None:
    w = generate(dataclasses.replace(SMALL, duration_s=60.0), seed=5)
    fast = traces.rate_scaled(w, 4.0)
    assert [t.arrival_s / 4.0 for s in w.sessions for t in s.turns] == [
        t.arrival_s for s in fast.sessions for t in s.turns]
    assert traces.rate_scaled(w, 1.0) is w
    with pytest.raises(traces.TraceError, match="> 0"):
        traces.rate_scaled(w, 0.0)
    with pytest.raises(traces.TraceError, match="closed loop"):
        traces.rate_scaled(Workload("claude-code", w.sessions), 2.0)


def _first_block(s: Session) -> int:
    return s.turns[0].new_hash_ids[0]


def test_a_recorded_trace_splits_by_its_first_block() -> None:
    """Two disjoint halves that together are the trace, in the trace's order; every
    session sharing a first block with another falls in the same half as it."""
    rng = random.Random(0)
    sessions = tuple(Session(f"s{i}", "ns", 512, (Turn(0.0, 1024, 4, 0, (rng.randrange(30), 1000 + i),
                                                        arrival_s=i * 0.5),))
                     for i in range(400))
    w = Workload("mooncake", sessions, open_loop=True)
    tuning, validation = traces.half(w, "tuning"), traces.half(w, "validation")
    assert sorted(tuning.sessions + validation.sessions, key=lambda s: int(s.id[1:])) == list(sessions)
    assert list(tuning.sessions) == [s for s in sessions if s in tuning.sessions]
    assert {_first_block(s) for s in tuning.sessions}.isdisjoint({_first_block(s) for s in validation.sessions})
    assert 100 < len(tuning.sessions) < 300
    assert traces.half(w, "tuning") == tuning
    with pytest.raises(traces.TraceError, match="half must be"):
        traces.half(w, "test")
    with pytest.raises(traces.TraceError, match="closed loop"):
        traces.half(Workload("claude-code", sessions), "tuning")


def test_kvgate_simulate_reaches_it() -> None:
    import argparse

    from loadtest.simulate_cmd import add_arguments, load_workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--trace", "synthetic-shared", "--half", "validation", "--rate-scale", "2",
                         "--limit-sessions", "5", "--seed", "7"])
    w = load_workload(args)
    want = generate(seed=7, half="validation").limited(5)
    assert [t.arrival_s / 2 for s in want.sessions for t in s.turns] == [
        t.arrival_s for s in w.sessions for t in s.turns]


def test_kvgate_simulate_takes_a_half_of_a_recorded_trace(tmp_path: Path) -> None:
    import argparse

    from loadtest.simulate_cmd import add_arguments, load_workload

    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024, "output_length": 4,
                                        "hash_ids": [i % 23, 100 + i]}) + "\n" for i in range(60)))
    p = argparse.ArgumentParser()
    add_arguments(p)
    whole = load_workload(p.parse_args(["--trace", str(path)]))
    halves = [load_workload(p.parse_args(["--trace", str(path), "--half", h])) for h in traces.HALVES]
    assert sorted(s.id for h in halves for s in h.sessions) == sorted(s.id for s in whole.sessions)
    assert all(h.sessions for h in halves)
    with pytest.raises(SystemExit, match="--half: .*closed loop"):
        load_workload(p.parse_args(["--trace", "synthetic", "--half", "tuning", "--limit-sessions", "2"]))
