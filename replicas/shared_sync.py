"""How the registry uses the shared state: degrade on failure, apply what changed.

``SharedGuard`` runs every Redis call under a time budget. A failure or a slow answer
counts in ``degraded_total``, is logged once per outage, and switches the registry to
local state only (no remote load, no shared decisions) until a sync succeeds again;
the sync loop keeps trying, so it resumes by itself. While degraded, per-request calls
(``reserve``) do not touch Redis at all.

``diff_snapshots`` turns two successive snapshots into the changes to apply locally.
Only *changes* are applied, so a local operation whose write is still in flight is not
undone by a snapshot read just before it; and a replica is removed locally only when
it disappears from a membership it was seen in (a local add not yet written, or made
while Redis was down, survives). With ``prev=None`` (first sync, after an outage or
after Redis lost its data) nothing is removed: the registry republishes its own view
first, so membership is add-biased across partitions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import RedisError

from replicas.config import SharedStateConfig
from replicas.load import LoadCounters
from replicas.shared_state import SharedSnapshot, SharedState

log = logging.getLogger(__name__)
T = TypeVar("T")


class SharedGuard:
    """Budgeted calls with degrade-and-resume bookkeeping."""

    def __init__(self) -> None:
        self.degraded = False
        self.degraded_total = 0

    async def call(self, awaitable: Awaitable[T], budget_s: float, what: str) -> T | None:
        try:
            result = await asyncio.wait_for(awaitable, budget_s)
        except (TimeoutError, RedisError, OSError) as e:
            self.fail(what, e)
            return None
        return result

    def fail(self, what: str, error: BaseException | None = None) -> None:
        self.degraded_total += 1
        if not self.degraded:
            self.degraded = True
            log.warning(
                "shared state unavailable (%s: %r); running on local state only", what, error
            )

    def skip(self) -> None:
        """A per-request call skipped because the shared state is down."""
        self.degraded_total += 1

    def succeeded(self) -> bool:
        """Record a successful sync; True when this ends an outage."""
        if self.degraded:
            self.degraded = False
            log.warning("shared state available again; resuming shared membership and load")
            return True
        return False


@dataclass(frozen=True, slots=True)
class SharedDiff:
    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    drain: dict[str, float] = field(default_factory=dict)  # url -> seconds left
    undrain: tuple[str, ...] = ()
    candidates: dict[str, bool] = field(default_factory=dict)


def diff_snapshots(
    prev: SharedSnapshot | None, snap: SharedSnapshot, local: Collection[str]
) -> SharedDiff:
    """What changed in the shared view since ``prev``, to apply to the ``local`` members."""
    prev_members = set(prev.members) if prev else set()
    members = set(snap.members)
    add = tuple(u for u in snap.members if u not in local and u not in prev_members)
    remove = tuple(u for u in local if prev is not None and u in prev_members and u not in members)
    prev_drains = prev.drains if prev else {}
    drain = {u: left for u, left in snap.drains.items() if u not in prev_drains}
    undrain = tuple(u for u in prev_drains if u not in snap.drains) if prev else ()
    prev_cands = prev.candidates if prev else frozenset()
    cands = {u: True for u in snap.candidates - prev_cands}
    if prev is not None:
        cands.update({u: False for u in prev_cands - snap.candidates})
    return SharedDiff(add=add, remove=remove, drain=drain, undrain=undrain, candidates=cands)


class SharedLink:
    """The registry's side of the shared state: budgets, degrade/resume, diffs."""

    def __init__(self, shared: SharedState, config: SharedStateConfig) -> None:
        self.shared = shared
        self.config = config
        self.guard = SharedGuard()
        self._prev: SharedSnapshot | None = None
        self._epoch: str | None = None

    async def write(self, op: Callable[[SharedState], Awaitable[Any]], what: str) -> None:
        """An admin write; skipped (and counted) while degraded."""
        if self.guard.degraded:
            self.guard.skip()
            return
        await self.guard.call(op(self.shared), self.config.op_budget_s, what)

    async def reserve(self, candidates: Sequence[str], predicted_tokens: int) -> str | None:
        if self.guard.degraded:
            self.guard.skip()
            return None
        return await self.guard.call(
            self.shared.reserve(candidates, predicted_tokens),
            self.config.reserve_budget_s,
            "reserve",
        )

    async def sync(
        self, local: Mapping[str, LoadCounters], republish: Callable[[], Awaitable[None]]
    ) -> tuple[SharedDiff, SharedSnapshot] | None:
        """One sync; None when Redis failed (local state only). ``republish`` puts the
        local view back after an outage or when Redis lost its data (epoch changed)."""
        snap = await self.guard.call(self.shared.sync(local), self.config.sync_budget_s, "sync")
        if snap is None:
            self._prev = None
            return None
        resumed = self.guard.succeeded()
        if resumed or (self._epoch is not None and snap.epoch != self._epoch):
            await republish()
            self._prev = None
        self._epoch = snap.epoch
        diff = diff_snapshots(self._prev, snap, tuple(local))
        self._prev = snap
        return diff, snap

    async def close(self) -> None:
        """Withdraw this gateway's load now (not at lease expiry); close an owned client."""
        if not self.guard.degraded:
            await self.guard.call(self.shared.forget_gateway(), self.config.op_budget_s, "stop")
        await self.shared.aclose()
