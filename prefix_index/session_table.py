"""The embedded session table: session key -> last routing, with expiry, a size bound and
the resident working set (the KV of live sessions per replica).

Bounds: an entry expires ``ttl_s`` after it was last set, and the table never holds more
than ``max_sessions`` entries: setting one more evicts the least recently *used* entry,
where a use is a ``set`` (every routed turn sets its session; a ``get`` alone, without a
routing, does not count). Both orders are one: entries sit in ``OrderedDict``s in the
order they were last set, which is also their expiry order (one TTL for all), so pruning
and eviction both pop from the front in O(1). ``evictions`` counts the entries the bound
pushed out (not those that expired). ~370 B a session (docs/redis.md, "Memory per
session"), so the default bound of 1,000,000 is ~0.37 GB at most.

Resident working set, incrementally. A full table made ``resident`` a scan of every
entry (1.5 s at 1,000,000 sessions, once a second on the router's event loop). When the
callers' ``last_seen_s`` never decreases along the set order (one clock: the gateway's),
the entries inside the window ``[now - window_s, now]`` are a suffix of that order. So
the table keeps two ``OrderedDict``s, ``_old`` (left the window) before ``_new``, and
per-replica token sums over ``_new``; ``resident`` moves the front of ``_new`` that fell
out of the window to ``_old`` (each entry moves once per set): amortized O(1). A call
with another window, an earlier ``now``, or a table whose order is not monotone (an
out-of-order ``last_seen_s``) falls back to the exact scan.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from prefix_index.base import ReplicaId, SessionEntry

DEFAULT_MAX_SESSIONS = 1_000_000
"""Far above what a fleet holds (a session lives while it has turns within ``ttl_s``: 64
concurrent agent sessions for an hour are a few thousand), low enough that random
session ids cannot take more than ~0.4 GB."""

_Item = tuple[SessionEntry, float]  # (entry, expiry on the table's clock)


class SessionTable:
    """Session key -> last routing, expiring ``ttl_s`` after it was set (by ``clock``),
    at most ``max_sessions`` entries (least recently set evicted first)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float],
                 max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._max = max(int(max_sessions), 1)
        self._old: OrderedDict[str, _Item] = OrderedDict()  # out of the window, older than _new
        self._new: OrderedDict[str, _Item] = OrderedDict()
        self._sums: dict[ReplicaId, int] = {}  # tokens of the _new entries, per replica
        self._window: tuple[float, float] | None = None  # (window_s, since) _old/_new are split at
        self._ordered = True  # last_seen_s never decreased along the set order
        self._last_seen = float("-inf")
        self.evictions = 0

    @property
    def max_sessions(self) -> int:
        return self._max

    def get(self, key: str) -> SessionEntry | None:
        item = self._new.get(key) or self._old.get(key)
        if item is None:
            return None
        if item[1] <= self._clock():
            self._remove(key)
            return None
        return item[0]

    def set(self, key: str, entry: SessionEntry) -> None:
        self._remove(key)
        if entry.last_seen_s < self._last_seen:
            self._ordered = False
        self._last_seen = max(self._last_seen, entry.last_seen_s)
        self._new[key] = (entry, self._clock() + self._ttl_s)
        self._sums[entry.replica] = self._sums.get(entry.replica, 0) + entry.tokens
        if self._size() > self._max:
            self.prune()  # expired entries go first: they are not evictions
            while self._size() > self._max:
                self._pop_oldest()
                self.evictions += 1

    def prune(self) -> None:
        """Drop expired entries; they are in expiry order, so stop at the first live one."""
        now = self._clock()
        while (front := self._front()) is not None and front[1] <= now:
            self._pop_oldest()

    def resident(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        self.prune()
        since = now_s - window_s
        if not self._ordered:
            return self._scan(since)
        if self._window is None or self._window[0] != window_s or since < self._window[1]:
            self._old.update(self._new)  # re-split for this window: everything is "new" again
            self._new, self._old = self._old, OrderedDict()
            self._sums = self._scan(float("-inf"))
        self._window = (window_s, since)
        new, sums = self._new, self._sums
        while new:
            key, item = next(iter(new.items()))
            if item[0].last_seen_s >= since:
                break
            del new[key]
            self._old[key] = item
            sums[item[0].replica] -= item[0].tokens
        return {rid: n for rid, n in sums.items() if n}

    def drop_replica(self, replica: ReplicaId) -> None:
        for table in (self._old, self._new):
            for key in [k for k, (e, _) in table.items() if e.replica == replica]:
                self._remove(key)

    def __len__(self) -> int:
        self.prune()
        return self._size()

    # -- internals -------------------------------------------------------------------
    def _size(self) -> int:
        return len(self._old) + len(self._new)

    def _scan(self, since: float) -> dict[ReplicaId, int]:
        """Exact sums over every entry seen since ``since`` (both parts)."""
        out: dict[ReplicaId, int] = {}
        for table in (self._old, self._new):
            for entry, _ in table.values():
                if entry.last_seen_s >= since:
                    out[entry.replica] = out.get(entry.replica, 0) + entry.tokens
        return out

    def _front(self) -> _Item | None:
        table = self._old or self._new
        return next(iter(table.values())) if table else None

    def _pop_oldest(self) -> None:
        table = self._old or self._new
        key = next(iter(table))
        self._remove(key)

    def _remove(self, key: str) -> None:
        item = self._new.pop(key, None)
        if item is not None:
            self._sums[item[0].replica] -= item[0].tokens
        else:
            self._old.pop(key, None)
        if not self._old and not self._new:  # empty: order and sums start afresh
            self._ordered, self._last_seen, self._sums, self._window = True, float("-inf"), {}, None


class SessionMethods:
    """The session half of ``PrefixIndex`` for an embedded backend whose ``sessions`` is a
    ``SessionTable`` (the memory and compact backends share it)."""

    sessions: SessionTable

    async def get_session(self, key: str) -> SessionEntry | None:
        return self.sessions.get(key)

    async def set_session(self, key: str, entry: SessionEntry) -> None:
        self.sessions.set(key, entry)

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        return self.sessions.resident(now_s, window_s)
