"""The shared-prefix generator: seeded, its shape, no session ids, disjoint halves; and
open-loop rate scaling."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from loadtest import traces
from loadtest.percentile import percentile
from loadtest.shared_prefix import SharedPrefixParams, generate
from loadtest.workload import Workload

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


def test_kvgate_simulate_reaches_it() -> None:
    import argparse

    from loadtest.simulate_cmd import add_arguments, load_workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--trace", "synthetic-shared", "--shared-half", "validation", "--rate-scale", "2",
                         "--limit-sessions", "5", "--seed", "7"])
    w = load_workload(args)
    want = generate(seed=7, half="validation").limited(5)
    assert [t.arrival_s / 2 for s in want.sessions for t in s.turns] == [
        t.arrival_s for s in w.sessions for t in s.turns]
