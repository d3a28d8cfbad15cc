"""Lease counting: immediate counting, first byte, idempotent release on every path."""

from __future__ import annotations

import pytest

from prefix_index.base import ReplicaId
from replicas.load import LoadCounters, LoadLease


def test_lease_counts_immediately_and_moves_to_decoding() -> None:
    c = LoadCounters()
    lease = LoadLease(ReplicaId("r"), c, 300)
    assert c.as_tuple() == (1, 300, 0)
    lease.first_byte()
    lease.first_byte()
    assert c.as_tuple() == (1, 0, 1)
    lease.release()
    lease.release()
    assert c.as_tuple() == (0, 0, 0)


def test_release_before_first_byte_returns_pending_tokens() -> None:
    c = LoadCounters()
    released: list[LoadLease] = []
    lease = LoadLease(ReplicaId("r"), c, 50, on_release=released.append)
    lease.release()
    lease.first_byte()  # too late: no effect
    lease.release()
    assert c.as_tuple() == (0, 0, 0)
    assert released == [lease]


def test_context_manager_releases_on_error() -> None:
    c = LoadCounters()
    with pytest.raises(RuntimeError), LoadLease(ReplicaId("r"), c, 10) as lease:
        lease.first_byte()
        raise RuntimeError("upstream broke")
    assert c.as_tuple() == (0, 0, 0)


async def test_async_context_manager_releases_on_cancel() -> None:
    c = LoadCounters()
    with pytest.raises(KeyboardInterrupt):
        async with LoadLease(ReplicaId("r"), c, 10):
            assert c.in_flight == 1
            raise KeyboardInterrupt  # stands for a client disconnect (BaseException path)
    assert c.as_tuple() == (0, 0, 0)


def test_negative_prediction_is_clamped() -> None:
    c = LoadCounters()
    LoadLease(ReplicaId("r"), c, -5).release()
    assert c.as_tuple() == (0, 0, 0)
