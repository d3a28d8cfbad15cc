"""Filters: which replicas may take a request at all.

- `RoutableFilter` ("routable"): only ACTIVE replicas. A joining, unhealthy, draining
  or removed replica gets nothing (a draining replica finishes what it has).
- `ScaleInFilter` ("scale-in"): a replica that scale-in marked ``removal_candidate``
  gets no request at all, so the sessions it serves move elsewhere on their next turn.
- `NewSessionFilter` ("new-session"): a *new* request (no session entry and no prefix
  match on any replica) goes only to replicas that ``accepts_new_sessions``.

The two soft filters (scale-in, new-session) fall back to their input when they would
leave nothing: steering away from a replica about to leave must never turn a request
that could be served into an error. Only `RoutableFilter` is strict.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress

from policies.base import RequestContext, RoutingInputs
from replicas.model import ReplicaView

_ROUTABLE = operator.attrgetter("routable")
_LEAVING = operator.attrgetter("removal_candidate")


def is_new_session(inputs: RoutingInputs) -> bool:
    """No session entry and no replica holds any of the prompt's prefix."""
    return inputs.session is None and all(m.blocks == 0 for m in inputs.matches.values())


class RoutableFilter:
    name = "routable"

    def filter(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> list[ReplicaView]:
        return list(compress(candidates, map(_ROUTABLE, candidates)))


class ScaleInFilter:
    name = "scale-in"

    def filter(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> list[ReplicaView]:
        if not any(map(_LEAVING, candidates)):
            return list(candidates)  # the common case: no replica is leaving
        kept = [c for c in candidates if not c.removal_candidate]
        return kept or list(candidates)


class NewSessionFilter:
    name = "new-session"

    def filter(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> list[ReplicaView]:
        if not is_new_session(inputs):
            return list(candidates)
        kept = [c for c in candidates if c.accepts_new_sessions]
        return kept or list(candidates)


def standard_filters() -> list[RoutableFilter | ScaleInFilter | NewSessionFilter]:
    """The filters every policy runs, in order."""
    return [RoutableFilter(), ScaleInFilter(), NewSessionFilter()]
