"""The embedded session table against a plain model: expiry, the LRU size bound and the
incremental resident working set give the answers of a full scan, in any order of
``last_seen_s`` (monotone or not) and with any windows."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.base import ReplicaId, SessionEntry
from prefix_index.session_table import SessionTable

REPLICAS = [ReplicaId(f"http://r{i}") for i in range(3)]
TTL_S, BOUND = 30.0, 5


@dataclass
class Model:
    items: dict[str, tuple[SessionEntry, float]] = field(default_factory=dict)  # insertion = set order
    evictions: int = 0

    def prune(self, now: float) -> None:
        self.items = {k: v for k, v in self.items.items() if v[1] > now}

    def set(self, key: str, entry: SessionEntry, now: float) -> None:
        self.items.pop(key, None)
        self.items[key] = (entry, now + TTL_S)
        if len(self.items) > BOUND:
            self.prune(now)
            while len(self.items) > BOUND:
                del self.items[next(iter(self.items))]
                self.evictions += 1

    def resident(self, now: float, since: float) -> dict[ReplicaId, int]:
        self.prune(now)
        out: dict[ReplicaId, int] = {}
        for entry, _ in self.items.values():
            if entry.last_seen_s >= since:
                out[entry.replica] = out.get(entry.replica, 0) + entry.tokens
        return out


op = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 8), st.integers(0, 2), st.integers(1, 100), st.floats(-3, 10)),
    st.tuples(st.just("resident"), st.sampled_from([5.0, 20.0, 100.0]), st.floats(-2, 10)),
    st.tuples(st.just("get"), st.integers(0, 8)),
    st.tuples(st.just("tick"), st.floats(0, 15)),
    st.tuples(st.just("drop"), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60), st.booleans())
def test_table_matches_the_model(ops: list[tuple[object, ...]], monotone: bool) -> None:
    clock = [0.0]
    table = SessionTable(TTL_S, lambda: clock[0], BOUND)
    model = Model()
    seen = 0.0
    for o in ops:
        now = clock[0]
        if o[0] == "set":
            _, k, r, tokens, dt = o
            seen = seen + abs(float(dt)) if monotone else now + float(dt)  # type: ignore[arg-type]
            entry = SessionEntry(REPLICAS[int(r)], int(tokens), seen)  # type: ignore[call-overload]
            table.set(f"s{k}", entry)
            model.set(f"s{k}", entry, now)
        elif o[0] == "resident":
            _, window, offset = o
            at = now + float(offset)  # type: ignore[arg-type]
            got = table.resident(at, float(window))  # type: ignore[arg-type]
            assert got == {r: n for r, n in model.resident(now, at - float(window)).items() if n}  # type: ignore[arg-type]
        elif o[0] == "get":
            model.prune(now)
            expect = model.items.get(f"s{o[1]}")
            assert table.get(f"s{o[1]}") == (expect[0] if expect else None)
        elif o[0] == "tick":
            clock[0] += float(o[1])  # type: ignore[arg-type]
        else:
            table.drop_replica(REPLICAS[int(o[1])])  # type: ignore[call-overload]
            model.items = {k: v for k, v in model.items.items() if v[0].replica != REPLICAS[int(o[1])]}  # type: ignore[call-overload]
        model.prune(clock[0])
        assert len(table) == len(model.items)
        assert table.evictions == model.evictions


def test_out_of_order_last_seen_falls_back_to_the_exact_scan() -> None:
    table = SessionTable(TTL_S, lambda: 0.0, BOUND)
    table.set("recent", SessionEntry(REPLICAS[0], 10, 10.0))
    table.set("stale", SessionEntry(REPLICAS[1], 20, 1.0))  # set later, seen earlier
    assert table.resident(10.0, 5.0) == {REPLICAS[0]: 10}
    assert table.resident(10.0, 50.0) == {REPLICAS[0]: 10, REPLICAS[1]: 20}


def test_monotone_windows_move_incrementally() -> None:
    table = SessionTable(1000.0, lambda: 0.0, 100)
    for i in range(50):
        table.set(f"s{i}", SessionEntry(REPLICAS[i % 2], 1, float(i)))
    assert table.resident(49.0, 9.5) == {REPLICAS[0]: 5, REPLICAS[1]: 5}
    table.set("s0", SessionEntry(REPLICAS[0], 7, 50.0))  # back in the window
    assert table.resident(50.0, 9.5) == {REPLICAS[0]: 4 + 7, REPLICAS[1]: 5}
    assert table.resident(50.0, 100.0) == {REPLICAS[0]: 24 + 7, REPLICAS[1]: 25}  # another window
