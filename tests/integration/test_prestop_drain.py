"""The preStop drain program against a real gateway under load, then SIGTERM (issue 6).

What Kubernetes does when it deletes a replica pod: the pod's preStop hook runs
``kvgate drain --gateway URL --replica URL --wait --timeout-s S``; when it returns the
kubelet sends SIGTERM. Here: ``kvgate serve`` over three simulated replicas, the load
driver (``loadtest.driver``) running concurrent streaming sessions through the gateway,
``kvgate drain`` on the replica that served the most requests while the load flows,
then SIGTERM to that replica. Nothing may be lost: every request of the driver ends
with 200 and a complete stream; the replica has nothing in flight when the drain
returns; its sessions' next turns go to the other replicas.
"""
from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time
from collections import Counter

import httpx

from loadtest.driver import Driver, DriverConfig, make_client
from loadtest.results import RequestRecord
from loadtest.simulator.fleet import SimFleet
from loadtest.synthetic import SyntheticParams, generate
from tests.integration.conftest import ADMIN_TOKEN, GatewayFactory

SESSIONS = 9
DRAIN_AFTER = 10  # completed requests before the drain starts (load keeps flowing)
PARAMS = dataclasses.replace(
    SyntheticParams(sessions=SESSIONS, subagent_prob=0.0).scaled(0.02),
    turns_median=12.0, turns_p90=13.0, max_turns=14, initial_sigma=0.3, tool_output_sigma=0.5,
    compact_at_tokens=2500)  # prompts stay well inside the tiny profile's 4096-token KV pool


async def _run_drain(gateway: str, replica: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "gateway.cli", "drain", "--gateway", gateway, "--replica", replica,
           "--wait", "--timeout-s", "30", "--poll-interval-s", "0.2", "--admin-token", ADMIN_TOKEN]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=45.0)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def _busy(client: httpx.AsyncClient, gateway: str, replica: str) -> tuple[int | None, int]:
    """(the gateway's in_flight for the replica or None when unlisted, the replica's running + waiting)."""
    rows = (await client.get(gateway + "/admin/replicas",
                             headers={"authorization": f"Bearer {ADMIN_TOKEN}"})).json()["data"]
    in_flight = next((int(r["in_flight"]) for r in rows if r["url"] == replica), None)
    loads = (await client.get(replica + "/v1/loads")).json()["loads"]
    return in_flight, sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads)


async def test_prestop_drain_under_load_then_sigterm(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet3.urls)
    done: list[RequestRecord] = []
    enough = asyncio.Event()

    def on_record(rec: RequestRecord) -> None:
        done.append(rec)
        if len(done) >= DRAIN_AFTER:
            enough.set()

    config = DriverConfig(target=gw.url, model="tiny", sessions_concurrent=SESSIONS, max_think_s=0.4,
                          seed=5, request_timeout_s=60.0)
    async with make_client(64, 60.0) as client:
        driver = Driver(config, client, on_record)
        t0 = time.monotonic()
        load = asyncio.create_task(driver.run(generate(PARAMS, seed=5)))
        await asyncio.wait_for(enough.wait(), timeout=40.0)
        assert all(r.ok for r in done), [r for r in done if not r.ok][:2]
        victim = Counter(r.replica for r in done).most_common(1)[0][0]
        assert victim is not None
        started_s = time.monotonic() - t0
        rc, output = await _run_drain(gw.url, victim)
        returned_s = time.monotonic() - t0
        in_flight, replica_busy = await _busy(client, gw.url, victim)
        fleet3.signal(fleet3.urls.index(victim), signal.SIGTERM)  # what the kubelet does next
        records = await asyncio.wait_for(load, timeout=50.0)

    assert rc == 0, output
    assert in_flight in (None, 0) and replica_busy == 0, (in_flight, replica_busy, output)
    assert len(records) == len({(r.session, r.turn) for r in records})
    bad = [r for r in records if not r.ok or r.output_tokens != r.trace_out_tokens]
    assert not bad, bad[:3]
    assert len(records) == sum(len(s.turns) for s in generate(PARAMS, seed=5).sessions)
    after = [r for r in records if r.t_start_s > returned_s]
    assert after, (started_s, returned_s, max(r.t_start_s for r in records))
    assert after and all(r.replica != victim for r in after), victim
    # sessions the victim served before the drain went on elsewhere
    before = {r.session for r in records if r.replica == victim and r.t_start_s < started_s}
    moved = {r.session for r in after if r.session in before}
    assert moved, (victim, before)
    print(f"\nprestop drain: {len(records)} requests, 0 lost; drain took {returned_s - started_s:.2f}s; "
          f"{len(moved)}/{len(before)} sessions of the drained replica continued elsewhere")
