"""Fixtures for the simulated replica's tests: real replica processes on free ports.

``replica`` is one ``kvgate sim`` process (tiny profile, fast clock) shared by a test
module; tests that kill, drain or break a replica start their own with ``sim_fleet``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet

TIME_SCALE = 20.0  # tiny profile: a 16-token answer takes ~10 ms of wall time


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "peers: needs the peer routers of loadtest/peers/install.sh")


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=TIME_SCALE, seed=7,
                  log_dir=tmp_path_factory.mktemp("replica")) as fleet:
        yield fleet


@pytest.fixture
def url(replica: SimFleet) -> str:
    return replica.urls[0]


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=20.0, trust_env=False) as c:
        yield c


@pytest.fixture
def sim_fleet(tmp_path: Path) -> Iterator[Callable[..., SimFleet]]:
    """Start a private fleet (stopped at teardown): ``sim_fleet(extra_args=[...])``."""
    started: list[SimFleet] = []

    def start(n: int = 1, time_scale: float = TIME_SCALE, extra_args: tuple[str, ...] = ()) -> SimFleet:
        fleet = SimFleet(n, profile="tiny", time_scale=time_scale, seed=3, extra_args=extra_args,
                         log_dir=tmp_path)
        fleet.__enter__()
        started.append(fleet)
        return fleet

    yield start
    for fleet in started:
        fleet.stop()


def parse_sse(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order (``b"[DONE]"`` included)."""
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: "):] for e in events]


@pytest.fixture
def sse() -> Callable[[bytes], list[bytes]]:
    return parse_sse
