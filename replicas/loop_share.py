"""The share of the event loop that background work may take while it has more to do.

``LoopShare.rest(worked_s)`` after each piece of work waits until the work so far is at most
``share`` of the time since it began, so requests on the same loop keep the rest whatever
the work's rate. Used by the KV-event consumer (``replicas.kv_subscriber``): decoding and
applying a flood of 200,000-hash batches once added ~60 ms to every small request (issue 41).
"""
from __future__ import annotations

import asyncio

EVENT_LOOP_SHARE = 0.5
"""At most this share of the event loop's time goes to decoding and applying KV events
while they arrive faster than it can take (``LoopShare``): requests keep at least the rest
under any event rate; a stream that needs more falls behind, ZMQ drops what its queue cannot
hold (a gap: replayed, or the replica uncertain and routed approximately)."""
MIN_REST_S = 0.001  # a rest shorter than this is carried over (a timer costs more than it saves)


class LoopShare:
    """Keeps work on the event loop within a share of its time: after ``worked_s`` of work,
    ``rest`` waits until the work so far is at most ``share`` of the time since it began (a
    rest under ``MIN_REST_S`` is carried over to the next one). Shared by every caller, so the
    bound holds for all of them together; idle time is not saved up for later.

    Why not ``asyncio.sleep(0)`` between slices: it yields one loop iteration, and a request
    needs dozens of them (the server hand-offs, the upstream connection, each read and write),
    each then waiting behind another slice."""

    def __init__(self, share: float = EVENT_LOOP_SHARE) -> None:
        self.ratio = (1.0 - share) / share if 0.0 < share < 1.0 else 0.0  # rest per unit of work
        self._free_at = 0.0

    async def rest(self, worked_s: float) -> None:
        now = asyncio.get_running_loop().time()
        self._free_at = max(self._free_at, now) + worked_s * self.ratio
        wait = self._free_at - now
        await asyncio.sleep(wait if wait >= MIN_REST_S else 0)
