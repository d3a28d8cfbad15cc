"""Prefill admission in `kvgate simulate` (loadtest/fleetsim/admission.py): the gateway's rule in virtual time."""
from __future__ import annotations

from pathlib import Path

from gateway.admission import AdmissionConfig
from loadtest import traces
from loadtest.fleetsim.run import FleetRun, SimConfig
from loadtest.fleetsim.sessions import Pacing
from loadtest.simulator.profile import load_profile
from tests.fleetsim.support import write_claude_traces


def _run(folder: Path, admission: AdmissionConfig, context_length: int = 4096) -> FleetRun:
    """Two ``tiny`` replicas; at the default ``context_length`` their pool holds a full-context
    request (not memory-bound)."""
    workload = traces.load([folder])
    cfg = SimConfig(profile=load_profile("tiny").replace(context_length=context_length), replicas=2,
                    gpus_per_replica=1,
                    pacing=Pacing(sessions_concurrent=12, think_scale=0.05), admission=admission)
    run = FleetRun(workload, "cache-aware", cfg)
    run.run()
    return run


def test_admission_holds_under_load_and_loses_nothing(tmp_path: Path) -> None:
    folder = write_claude_traces(tmp_path / "t", sessions=12, turns=8, seed=4)
    on = _run(folder, AdmissionConfig(budget_tokens=16))
    off = _run(folder, AdmissionConfig(enabled=False))
    q = on.admission.queue
    assert q.held_total > 0  # the rule engaged: replicas had prefill queued
    assert q.held() == 0 and all(q.pending_tokens(r) == 0 for r in on.router.ids)  # nothing left behind
    assert off.admission.queue.held_total == 0 and off.admission.queue.released_total == 0
    for run in (on, off):  # every turn was sent and answered, in both
        assert len(run.records) == 12 * 8 + 2  # + the subagent's two requests
        assert all(r.finish_s is not None for r in run.records)
        assert all(c.in_flight == 0 and c.pending_prefill_tokens == 0 for c in run.router.counters)
    assert sum(r.rejected for r in on.records) == sum(r.rejected for r in off.records)


def test_on_memory_bound_replicas_admission_changes_nothing(tmp_path: Path) -> None:
    """The bundled ``tiny`` serves 8,192-token contexts on a 4,096-token pool: memory-bound,
    so the same run with admission on is the run with it off, request for request."""
    folder = write_claude_traces(tmp_path / "t", sessions=12, turns=8, seed=4)
    on = _run(folder, AdmissionConfig(budget_tokens=16), context_length=8192)
    off = _run(folder, AdmissionConfig(enabled=False), context_length=8192)
    assert on.memory_bound == [True, True]
    assert on.admission.queue.held_total == 0 and on.admission.queue.released_total == 0
    assert [(r.replica, r.first_token_s, r.cached) for r in on.records] == \
        [(r.replica, r.first_token_s, r.cached) for r in off.records]


def test_the_age_bound_releases_everything_even_with_no_prefill_ending(tmp_path: Path) -> None:
    folder = write_claude_traces(tmp_path / "t", sessions=12, turns=3, seed=5)
    run = _run(folder, AdmissionConfig(budget_tokens=1, max_wait_s=0.0))
    assert run.admission.queue.held() == 0
    assert all(r.finish_s is not None for r in run.records)
