"""``kvgate serve --workers 2 --redis-url ...``: two gateway processes behind one port.

Connections are spread over the workers by the kernel, so routing must not care which
worker a turn reaches: the workers share the prefix index, the sessions and the replica
state through Redis.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import ADMIN_TOKEN, AUTH, Gateway, start_gateway
from tests.integration_redis.test_shared_redis import two_turns, until
from tests.support.redis_server import redis_process

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def workers_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimFleet]]:
    logs = tmp_path_factory.mktemp("workers")
    with redis_process() as server, SimFleet(2, profile="tiny", time_scale=4.0, seed=21, log_dir=logs) as fleet:
        gw = start_gateway(fleet.urls, logs / "gateway.log", "--redis-url", server.url, "--workers", "2",
                           "--set", "registry.shared.sync_interval_s=0.2")
        try:
            def every_worker_ready() -> bool:  # /ready is answered by one worker: ask several times
                return all({v["state"] for v in gw.replicas().values()} == {"active"}
                           and len(gw.replicas()) == 2 for _ in range(6))

            until(every_worker_ready, 60.0, "both workers see both replicas active", poll_s=0.2)
            yield gw, fleet
        finally:
            gw.proc.stop()


def test_two_workers_share_sessions_and_drains(workers_gateway: tuple[Gateway, SimFleet]) -> None:
    gw, fleet = workers_gateway
    for i in range(4):  # each request is a new connection: turns reach either worker
        t1, t2 = two_turns(gw, gw, f"workers-{i}", seed=50 + i)
        assert t2[0] == t1[0] and t2[2] >= 0.9 * t2[1], (t1[:3], t2[:3])
    url = fleet.urls[1]
    r = httpx.post(gw.url + "/admin/replicas/drain", json={"url": url, "deadline_s": 60}, headers=AUTH)
    assert r.status_code == 200, r.text

    def all_workers_see_it() -> bool:  # several fresh connections: both workers answer
        states = {gw.replicas().get(url, {}).get("state", "removed") for _ in range(6)}
        return states <= {"draining", "removed"}

    until(all_workers_see_it, 2.0, "every worker sees the drain")


def test_worker_processes_get_no_secret_in_their_environment(workers_gateway: tuple[Gateway, SimFleet]) -> None:
    """The settings (with the admin token) reach the children through the pickled process
    object, never through the environment every child inherits and /proc exposes."""
    gw, _ = workers_gateway
    parent = gw.proc.popen.pid
    children = [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    assert len(children) >= 2, children  # the two workers (uvicorn's spawn may add a resource tracker)
    for pid in [parent, *children]:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert ADMIN_TOKEN.encode() not in environ, pid
        assert b"KVGATE_SERVE_SETTINGS_JSON" not in environ, pid
