"""SimFleet survives the free-port race: a port taken between choosing and binding."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from loadtest.simulator import fleet as fleet_mod
from loadtest.simulator.fleet import SimFleet


def test_replica_relaunched_on_a_new_port_when_its_port_was_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy_port = taken.getsockname()[1]
    real_free_port = fleet_mod.free_port
    ports: Iterator[int] = iter([busy_port])

    def first_busy(host: str = fleet_mod.HOST) -> int:
        return next(ports, None) or real_free_port(host)

    monkeypatch.setattr(fleet_mod, "free_port", first_busy)
    try:
        with SimFleet(1, profile="tiny", time_scale=100.0) as fleet:
            assert fleet.ports[0] != busy_port
            assert httpx.get(fleet.urls[0] + "/health", timeout=5.0).status_code == 200
            assert "address already in use" in fleet.output(0)  # the first launch's log
    finally:
        taken.close()
