"""The precise (event-fed) index against a plain per-replica model."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.base import PrefixMatch, ReplicaId
from prefix_index.precise import EventBlockIndex

R = [ReplicaId(f"http://r{i}:1") for i in range(4)]
ops = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared", "drop"]), st.integers(0, 3),
                         st.lists(st.integers(0, 12), max_size=6), st.sampled_from(["GPU", "CPU_PINNED"])),
               max_size=40)


def leading(hashes: list[int], held: set[int]) -> int:
    """The match of a prefix-closed cache: up to the deepest page held."""
    return max((i + 1 for i, h in enumerate(hashes) if h in held), default=0)


@settings(max_examples=300)
@given(ops, st.lists(st.integers(0, 12), max_size=10))
def test_matches_the_model(operations: list[tuple[str, int, list[int], str]], request: list[int]) -> None:
    index = EventBlockIndex()
    model: dict[ReplicaId, dict[str, set[int]]] = {}
    for op, r, hashes, medium in operations:
        rid = R[r]
        tier = "device" if medium == "GPU" else "host"
        entry = model.setdefault(rid, {"device": set(), "host": set()})
        if op == "stored":
            index.stored(rid, hashes, medium)
            entry[tier] |= set(hashes)
        elif op == "removed":
            index.removed(rid, hashes, medium)
            entry[tier] -= set(hashes)
        else:
            getattr(index, op)(rid)
            model[rid] = {"device": set(), "host": set()}
    got = index.match(request, R)
    for rid in R:
        entry = model.get(rid, {"device": set(), "host": set()})
        dev = leading(request, entry["device"])
        anyt = leading(request, entry["device"] | entry["host"])
        assert got[rid] == PrefixMatch(dev, anyt - dev), rid
        assert index.blocks(rid) == (len(entry["device"]), len(entry["host"])) or rid not in index.replicas()


def test_evicted_from_gpu_but_on_host_is_a_host_hit() -> None:
    index = EventBlockIndex()
    index.stored(R[0], [1, 2, 3], "GPU")
    index.stored(R[0], [1, 2, 3], "CPU_PINNED")
    index.removed(R[0], [2, 3], "GPU")
    assert index.match([1, 2, 3, 4], [R[0], R[1]]) == {R[0]: PrefixMatch(1, 2), R[1]: PrefixMatch()}
    index.cleared(R[0])
    assert index.match([1], [R[0]]) == {R[0]: PrefixMatch()}


def test_a_page_stored_before_subscribing_does_not_cut_the_match() -> None:
    index = EventBlockIndex()
    index.stored(R[0], [2, 3], "GPU")  # page 1 was stored before the gateway subscribed
    assert index.match([1, 2, 3, 4], [R[0]]) == {R[0]: PrefixMatch(3, 0)}
