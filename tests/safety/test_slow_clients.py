"""Slow-header clients never lock everyone out (issue 41, failure 4), over real processes:
a ``kvgate serve`` gateway in front of a simulated replica, and an attacker process that
opens thousands of connections and sends their headers one byte a second, never ending
them.

Before: 4,150 such connections filled the connection cap and for ~10 s every new client,
``/ready`` included, got 503, again every 10 s. Now (Granian, ``gateway/server.py``):

- 4,000 slow-header connections against the default cap (``server.max_connections``
  4096): a normal client's requests, on a kept-alive and on new connections, and
  ``/ready`` on the main and on the admin port all succeed (the test fails before this
  change: the admin listener answered 404 for ``/ready``).
- beyond the cap, the admin listener (``admin.port``) still answers ``/ready`` and
  ``/metrics`` at once: each listener has its own connection slots and backlog, so a
  readiness probe pointed there is never starved by client traffic; a connection the
  main port already accepted keeps being served.
- what Granian cannot do (docs/safety.md, "Slow-header clients"): a *new* connection on
  the main port at a cap full of unfinished connections waits in the backlog until they
  reach ``server.header_timeout_s``; there is no public way to close unfinished
  connections first or to cap them per peer address. Pinned by a strict xfail.

Latencies are printed (``-s``), not asserted, except the bounds the issue demands (every
request answered) and the header deadline that bounds a new connection's wait.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway
from tests.support.procs import free_port

pytestmark = pytest.mark.safety

HOST = "127.0.0.1"
TRICKLE = b"GET /v1/models HTTP/1.1\r\nx-slow: " + b"a" * 4096  # never reaches the end of the headers
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def trickle(port: int, count: int, duration_s: float, opened: Any, closed: Any) -> None:
    """The attacker (a process of its own): ``count`` connections, each sending one byte a
    second of headers that never end; a connection the server closes is opened again."""

    async def one(sem: asyncio.Semaphore, stop: float) -> None:
        while time.monotonic() < stop:
            try:
                async with sem:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 30.0)
            except (OSError, TimeoutError):
                await asyncio.sleep(1.0)
                continue
            with opened.get_lock():
                opened.value += 1
            try:
                for i in range(len(TRICKLE)):
                    if time.monotonic() >= stop or reader.at_eof():
                        break
                    writer.write(TRICKLE[i:i + 1])
                    await asyncio.sleep(1.0)
            except OSError:
                pass
            finally:
                writer.close()
                with closed.get_lock():
                    closed.value += 1

    async def main() -> None:
        sem = asyncio.Semaphore(256)  # connects in flight: the SYN backlog is the gateway's, not ours
        stop = time.monotonic() + duration_s
        await asyncio.gather(*(one(sem, stop) for _ in range(count)))

    asyncio.run(main())


class Attack:
    """``trickle`` in a child process (spawned: the measuring client shares no CPU time
    slice or GIL with it); stopped and joined at exit, killed if it does not end."""

    def __init__(self, port: int, count: int, duration_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.count = count
        self.opened = ctx.Value("i", 0)
        self.closed = ctx.Value("i", 0)
        self.process = ctx.Process(target=trickle, args=(port, count, duration_s, self.opened, self.closed),
                                   daemon=True)

    def open_now(self) -> int:
        return int(self.opened.value) - int(self.closed.value)

    def __enter__(self) -> Self:
        self.process.start()
        deadline = time.monotonic() + 60.0
        while self.open_now() < self.count:
            assert time.monotonic() < deadline, f"only {self.open_now()} of {self.count} slow connections opened"
            assert self.process.is_alive(), "the attacker process died"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


@dataclass
class Probe:
    """Outcomes of one kind of request: (status or error name, seconds)."""

    name: str
    results: list[tuple[str, float]] = field(default_factory=list)

    def run(self, client: httpx.Client, method: str, url: str, **kwargs: Any) -> None:
        start = time.monotonic()
        try:
            outcome = str(client.request(method, url, **kwargs).status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        self.results.append((outcome, time.monotonic() - start))

    def failures(self) -> list[tuple[str, float]]:
        return [r for r in self.results if r[0] != "200"]

    def summary(self) -> str:
        lat = [s * 1000 for _, s in self.results]
        p50, p99 = percentile(lat, 50) or 0.0, percentile(lat, 99) or 0.0
        return (f"{self.name}: {len(self.results) - len(self.failures())}/{len(self.results)} ok, "
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(lat, default=0.0):.1f} ms")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=1.0, seed=41, log_dir=tmp_path_factory.mktemp("sim")) as f:
        yield f


def gateway(fleet: SimFleet, tmp_path: Path, *extra: str) -> tuple[Gateway, str]:
    admin_port = free_port()
    gw = start_gateway(fleet.urls, tmp_path / "gw.log", "--set", f"admin.port={admin_port}", *extra)
    return gw, f"http://{HOST}:{admin_port}"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_4000_slow_header_connections_lock_no_client_out(fleet: SimFleet, tmp_path: Path) -> None:
    """The done-when of issue 41: with 4,000 slow-header connections open (default cap and
    header deadline), every request of a normal client and every ``/ready`` succeeds."""
    gw, admin = gateway(fleet, tmp_path)
    kinds = {name: Probe(name) for name in ("chat, kept-alive", "chat, new connection", "/ready main, new connection",
                                            "/ready admin, new connection", "/metrics admin, new connection")}
    fresh = httpx.Limits(max_keepalive_connections=0)  # every request on a connection of its own
    try:
        with Attack(port_of(gw.url), 4000, duration_s=45.0) as attack, \
                httpx.Client(timeout=10.0, trust_env=False) as kept, \
                httpx.Client(timeout=10.0, trust_env=False, limits=fresh) as new:
            held = open_fds(gw.proc.popen.pid)
            end = time.monotonic() + 20.0
            while time.monotonic() < end:
                kinds["chat, kept-alive"].run(kept, "POST", gw.url + "/v1/chat/completions", json=BODY)
                kinds["chat, new connection"].run(new, "POST", gw.url + "/v1/chat/completions", json=BODY)
                kinds["/ready main, new connection"].run(new, "GET", gw.url + "/ready")
                kinds["/ready admin, new connection"].run(new, "GET", admin + "/ready")
                kinds["/metrics admin, new connection"].run(new, "GET", admin + "/metrics")
                time.sleep(0.2)
            still_open = attack.open_now()
    finally:
        gw.proc.stop()
    print(f"\n4,000 slow-header connections (gateway fds {held}, still open at the end {still_open}):")
    for probe in kinds.values():
        print("  " + probe.summary())
    assert held >= 4000 and still_open == 4000  # the attack held its connections throughout
    for probe in kinds.values():
        assert len(probe.results) >= 20 and not probe.failures(), probe.summary() + f" {probe.failures()[:5]}"


HEADER_S = 8.0  # the small-cap gateway's header deadline (above the attacker's start-up: the kept connection lives)


@pytest.fixture(scope="module")
def full(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str, httpx.Client]]:
    """A gateway with a cap of 64 connections, 100 slow-header connections against it, and
    a client whose kept-alive connection was accepted before the attack."""
    gw, admin = gateway(fleet, tmp_path_factory.mktemp("full"), "--set", "server.max_connections=64",
                        "--set", f"server.header_timeout_s={HEADER_S}")
    kept = httpx.Client(timeout=HEADER_S + 10.0, trust_env=False)
    try:
        kept.get(gw.url + "/health").raise_for_status()
        with Attack(port_of(gw.url), 100, duration_s=90.0):
            time.sleep(0.5)
            yield gw, admin, kept
    finally:
        kept.close()
        gw.proc.stop()


def test_beyond_the_cap_the_admin_probes_and_accepted_connections_are_served(
        full: tuple[Gateway, str, httpx.Client]) -> None:
    gw, admin, kept = full
    probes = {name: Probe(name) for name in ("/ready admin", "/metrics admin", "chat, kept-alive")}
    with httpx.Client(timeout=5.0, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as new:
        for _ in range(10):
            probes["/ready admin"].run(new, "GET", admin + "/ready")
            probes["/metrics admin"].run(new, "GET", admin + "/metrics")
            probes["chat, kept-alive"].run(kept, "POST", gw.url + "/v1/chat/completions", json=BODY)
            time.sleep(0.3)
        # a new connection on the main port: in the backlog until slow connections reach their deadline
        waited = Probe("/ready main, new connection")
        with httpx.Client(timeout=HEADER_S * 2 + 5.0, trust_env=False) as patient:
            waited.run(patient, "GET", gw.url + "/ready")
    print(f"\n100 slow-header connections against a cap of 64 (header deadline {HEADER_S} s):")
    for probe in [*probes.values(), waited]:
        print("  " + probe.summary())
    for probe in probes.values():
        assert not probe.failures() and max(s for _, s in probe.results) < 2.0, probe.summary()
    assert not waited.failures(), waited.summary()  # bounded by the header deadline, never locked out


@pytest.mark.xfail(strict=True, reason="Granian 2.8.7 has no public way to close unfinished connections first "
                   "or to cap them per peer address: a new main-port connection waits for the header deadline")
def test_a_new_client_is_served_at_once_while_unfinished_connections_fill_the_cap(
        full: tuple[Gateway, str, httpx.Client]) -> None:
    gw, _, _ = full
    # Every time for longer than one header deadline: slow connections all reach their
    # deadline together and free the cap for a moment, so a handful of requests can all land
    # in such moments by chance; a whole deadline period cannot.
    end = time.monotonic() + HEADER_S * 1.5
    with httpx.Client(timeout=1.0, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as new:
        while time.monotonic() < end:
            new.get(gw.url + "/ready").raise_for_status()
            time.sleep(0.2)
