"""`kvgate simulate --index precise` hands the policy exact matches (`ExactMatch`) for every
replica (raised by in-flight chains for requests without a session entry), approximate
mode never; an eviction-heavy precise run may re-place sessions whose
home lost their KV (reason ``rehomed``), an approximate one never does."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest import traces
from loadtest.fleetsim.run import FleetRun, SimConfig
from loadtest.simulator.profile import load_profile
from policies.base import Decision, RequestContext, RoutingInputs
from policies.routing import is_exact
from tests.fleetsim.support import write_claude_traces


def _workload(folder: Path) -> Any:
    return traces.load([folder])


def _spied_run(workload: Any, mode: str) -> tuple[FleetRun, list[tuple[RoutingInputs, Decision]]]:
    prof = load_profile("tiny")
    prof = prof.replace(device_tokens=int(prof.device_tokens * 0.1), host_tokens=int(prof.host_tokens * 0.1))
    run = FleetRun(workload, "cache-aware", SimConfig(profile=prof, replicas=2, gpus_per_replica=1, seed=5,
                                                      index_mode=mode))
    policy = run.router.core.policy
    seen: list[tuple[RoutingInputs, Decision]] = []
    decide = policy.decide

    def spy(ctx: RequestContext, inputs: RoutingInputs, rng: Any) -> Decision:
        d = decide(ctx, inputs, rng)
        seen.append((inputs, d))
        return d

    policy.decide = spy  # type: ignore[method-assign]
    run.run()
    return run, seen


def test_precise_decisions_see_exact_matches_and_approximate_ones_never(tmp_path: Path) -> None:
    workload = _workload(write_claude_traces(tmp_path / "cc", sessions=10, turns=8))
    _, approx = _spied_run(workload, "approximate")
    _, precise = _spied_run(workload, "precise")
    assert approx and precise
    assert not any(is_exact(m) for inputs, _ in approx for m in inputs.matches.values())
    # a session's turns: exact for every replica; a request without a session entry may see
    # a match raised by a request just routed there (in flight: not in the events yet)
    assert all(is_exact(m) for inputs, _ in precise if inputs.session is not None for m in inputs.matches.values())
    assert any(not is_exact(m) for inputs, _ in precise if inputs.session is None for m in inputs.matches.values())
    assert "rehomed" not in {d.reason for _, d in approx}
    assert "rehomed" in {d.reason for _, d in precise}  # tiny pools x0.1: homes do lose sessions
    for inputs, d in precise:
        if d.reason == "rehomed":  # only ever away from a home the events show lost
            assert inputs.session is not None and d.replica != inputs.session.replica
            assert inputs.matches[inputs.session.replica].blocks < d.predicted_cached_tokens + d.predicted_uncached_tokens
