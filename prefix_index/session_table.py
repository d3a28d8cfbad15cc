"""The embedded session table: session key -> last routing, with expiry and the
resident working set (the KV of live sessions per replica)."""

from __future__ import annotations

from collections.abc import Callable

from prefix_index.base import ReplicaId, SessionEntry


class SessionTable:
    """Session key -> last routing, expiring ``ttl_s`` after it was set (by ``clock``)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[SessionEntry, float]] = {}

    def get(self, key: str) -> SessionEntry | None:
        item = self._entries.get(key)
        if item is None:
            return None
        if item[1] <= self._clock():
            del self._entries[key]
            return None
        return item[0]

    def set(self, key: str, entry: SessionEntry) -> None:
        self._entries.pop(key, None)  # re-insert: the dict stays ordered by expiry
        self._entries[key] = (entry, self._clock() + self._ttl_s)

    def prune(self) -> None:
        """Drop expired entries; the dict is ordered by expiry, so stop at the first live one."""
        now = self._clock()
        expired: list[str] = []
        for key, (_, exp) in self._entries.items():
            if exp > now:
                break
            expired.append(key)
        for key in expired:
            del self._entries[key]

    def resident(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        self.prune()
        since = now_s - window_s
        out: dict[ReplicaId, int] = {}
        for entry, _ in self._entries.values():
            if entry.last_seen_s >= since:
                out[entry.replica] = out.get(entry.replica, 0) + entry.tokens
        return out

    def drop_replica(self, replica: ReplicaId) -> None:
        for key in [k for k, (e, _) in self._entries.items() if e.replica == replica]:
            del self._entries[key]

    def __len__(self) -> int:
        self.prune()
        return len(self._entries)
