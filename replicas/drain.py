"""Drain: stop sending new requests to a replica, remove it once empty or at a deadline.

Two ways in:
- an operator (admin API, scale-in, another gateway through the shared state) calls
  ``Registry.drain(url, deadline_s)``: ``by_operator=True``; only ``undrain`` ends it;
- the replica drains itself: SGLang answers 503 on ``/ready`` after SIGTERM (it keeps
  accepting requests, so the gateway must stop sending them) or while paused:
  ``by_operator=False``; a later 200 on ``/ready`` returns it to ACTIVE.

Either way the replica is removed when no request is in flight on it (this gateway's
leases plus every live gateway's published leases) or when the deadline passes, even
with requests in flight: those finish on their own and their leases stay valid.

With shared state, "empty" is trusted only after ``min_empty_s`` of draining (the
registry uses two sync intervals): another gateway's newest leases reach us up to one
sync interval late, and a drain must not remove a replica they are still using.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DrainInfo:
    deadline_s: float  # on the registry's clock
    by_operator: bool
    started_s: float = 0.0


def drain_outcome(
    info: DrainInfo, now_s: float, in_flight: int, min_empty_s: float = 0.0
) -> str | None:
    """Why a draining replica should be removed now ("empty", "deadline"), or None."""
    if in_flight <= 0 and now_s - info.started_s >= min_empty_s:
        return "empty"
    if now_s >= info.deadline_s:
        return "deadline"
    return None
