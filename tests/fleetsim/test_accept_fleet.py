"""A fleet whose replicas differ only in speculative accept length, in `kvgate simulate`:
each replica reports its accept length as SGLang does, the learned speeds read it, and the
cache-aware policy sends more of the sessions to the replica whose drafts are accepted more."""
from __future__ import annotations

from pathlib import Path

from loadtest import traces
from loadtest.fleetsim.run import PROSE_WORKLOADS, FleetRun, SimConfig
from loadtest.fleetsim.sessions import Pacing
from loadtest.simulator.profile import load_profile
from tests.fleetsim.support import write_claude_traces


def test_the_better_accepted_replica_gets_more_of_the_sessions(tmp_path: Path) -> None:
    workload = traces.load([write_claude_traces(tmp_path / "cc", sessions=12, turns=5)])
    assert workload.name not in PROSE_WORKLOADS  # coding-agent traffic: spec_accept_length
    tiny = load_profile("tiny").replace(device_tokens=16_384, host_tokens=0)
    good = tiny.replace(name="tiny-good", spec_accept_length=4.0)
    poor = tiny.replace(name="tiny-poor", spec_accept_length=1.5)
    cfg = SimConfig(profile=good, replicas=2, gpus_per_replica=1, replica_profiles=(good, poor),
                    pacing=Pacing(sessions_concurrent=4))
    run = FleetRun(workload, "cache-aware", cfg)
    res = run.run()
    speeds = res.summary["speeds"]
    good_a, poor_a = (s["spec_accept_length"] for s in speeds)
    # tokens per verify step as the engines count them (a reply's last step may yield fewer)
    assert 3.0 < good_a <= 4.0 and 1.2 < poor_a <= 1.5
    assert speeds[1]["decode_step_s"] > 2 * speeds[0]["decode_step_s"]  # 5 tokens take 2.7x the steps
    served = res.summary["requests_per_replica"]
    assert served[0] > served[1]
    view = run.router.views(res.summary["span_s"])[1]
    assert view.spec_accept_length == run.speeds[1].spec_accept_length  # type: ignore[index]
    blind = FleetRun(workload, "cache-aware", SimConfig(profile=good, replicas=2, gpus_per_replica=1,
                                                        replica_profiles=(good, poor), speeds="no-accept"))
    assert all(s["spec_accept_length"] is None for s in blind.run().summary["speeds"])


def test_prose_requests_decode_at_the_profile_s_prose_accept_length() -> None:
    kimi = load_profile("kimi-k2.6-b200-tp8-lowaccept")
    assert (kimi.accept_length(prose=False), kimi.accept_length(prose=True)) == (3.5, 3.0)
    stock = load_profile("kimi-k2.6-b200-tp8")
    assert stock.accept_length(prose=True) == stock.accept_length(prose=False) == 5.0
    assert stock.replace(spec_algorithm=None).accept_length(prose=True) == 1.0
