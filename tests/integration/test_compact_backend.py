"""``kvgate serve --set index.backend=compact``: the flat-array embedded index behind a
real gateway keeps a session's turns on the replica holding its prefix."""
from __future__ import annotations

from pathlib import Path

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import start_gateway
from tests.integration_redis.test_shared_redis import two_turns


def test_compact_backend_keeps_sessions_on_their_replica(tmp_path: Path) -> None:
    with SimFleet(3, profile="tiny", time_scale=4.0, seed=17, log_dir=tmp_path) as fleet:
        gw = start_gateway(fleet.urls, tmp_path / "gateway.log", "--set", "index.backend=compact")
        try:
            for i in range(3):
                t1, t2 = two_turns(gw, gw, f"compact-{i}", seed=70 + i)
                assert t2[0] == t1[0] and t2[2] >= 0.9 * t2[1], (t1[:3], t2[:3])
        finally:
            gw.proc.stop()
