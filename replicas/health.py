"""Health hysteresis and the lifecycle transitions driven by probes and passive reports.

Pure: no I/O, no clock. The registry feeds it events and applies the state it returns.

    probe OK            JOINING -> ACTIVE (first success; capacity must be known)
                        UNHEALTHY -> ACTIVE after `healthy_after` consecutive successes
                        DRAINING (self-drained, not by an operator) -> ACTIVE
    /ready 503          ACTIVE -> DRAINING (SGLang's SIGTERM drain or pause: it keeps
                        accepting requests, so the gateway must stop sending them)
    probe fails         ACTIVE -> UNHEALTHY after `unhealthy_after` consecutive failures

Only probes move a replica to UNHEALTHY. The proxy's passive failures (requests that
failed on a replica) go to the outlier detector instead (replicas/outlier.py), which
ejects a replica for a while on its own rules: a request's own errors must never count
toward a replica's health, and one bad request copied to every replica must not turn
the fleet unhealthy. A 503 on ``/ready`` is not a health failure (the process answers);
it neither counts toward unhealthy nor resets the count. A passive success (a request
that worked) resets the probe failure count but does not count toward recovery:
recovery is the prober's call, since an unhealthy replica receives no requests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from replicas.model import ReplicaState


class HealthEvent(enum.Enum):
    PROBE_OK = "probe_ok"
    PROBE_NOT_READY = "probe_not_ready"  # /ready answered 503
    PROBE_FAILED = "probe_failed"  # connection error, timeout, 5xx, /health 503
    PASSIVE_SUCCESS = "passive_success"  # a request worked (passive failures: replicas/outlier.py)


@dataclass(slots=True)
class HealthTracker:
    """Consecutive success/failure counts with thresholds."""

    unhealthy_after: int = 3
    healthy_after: int = 2
    successes: int = 0
    failures: int = 0

    def record(self, event: HealthEvent) -> None:
        if event is HealthEvent.PROBE_OK:
            self.successes += 1
            self.failures = 0
        elif event is HealthEvent.PROBE_FAILED:
            self.failures += 1
            self.successes = 0
        elif event is HealthEvent.PASSIVE_SUCCESS:
            self.failures = 0

    @property
    def unhealthy_due(self) -> bool:
        return self.failures >= self.unhealthy_after

    @property
    def healthy_due(self) -> bool:
        return self.successes >= self.healthy_after


def next_state(
    state: ReplicaState, event: HealthEvent, tracker: HealthTracker, *, operator_drain: bool
) -> ReplicaState:
    """The state after ``event`` (already recorded in ``tracker``)."""
    if event is HealthEvent.PROBE_OK:
        if state is ReplicaState.JOINING:
            return ReplicaState.ACTIVE
        if state is ReplicaState.UNHEALTHY and tracker.healthy_due:
            return ReplicaState.ACTIVE
        if state is ReplicaState.DRAINING and not operator_drain:
            return ReplicaState.ACTIVE
        return state
    if event is HealthEvent.PROBE_NOT_READY:
        return ReplicaState.DRAINING if state is ReplicaState.ACTIVE else state
    if event is HealthEvent.PROBE_FAILED and state is ReplicaState.ACTIVE and tracker.unhealthy_due:
        return ReplicaState.UNHEALTHY
    return state


def state_after_undrain(ever_ok: bool, tracker: HealthTracker) -> ReplicaState:
    """Where an operator's undrain returns a replica."""
    if not ever_ok:
        return ReplicaState.JOINING
    return ReplicaState.UNHEALTHY if tracker.unhealthy_due else ReplicaState.ACTIVE
