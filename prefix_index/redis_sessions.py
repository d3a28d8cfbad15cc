"""Sessions in the Redis backend: the stored value, and the *session feed* that copies
the other gateways' session writes into this gateway's local copy.

Why the feed: while Redis is down (or slower than its budget) each gateway routes on its
local copy, which holds only what this process wrote. With several gateways (or
``--workers``), a conversation whose previous turn went through another gateway was
unknown there, and affinity during an outage fell to ~45% (measured with two gateways,
tests/safety/test_redis_restart.py). So every ``set_session`` script also appends the
session to a stream ``P:sx`` (``XADD MAXLEN ~ SESSION_FEED_MAX``), and every gateway
reads it from where it left off (``XREAD``, at most ``FEED_BATCH`` entries) every
``index.redis_session_sync_s``, merging entries newer than its own into the local
copy's session table (bounded by ``index.max_sessions`` like any other).

Cost: one XREAD a second per gateway, O(session writes since the last one); the stream
holds at most ~``SESSION_FEED_MAX`` entries (docs/redis.md, "Memory per session").
"""
from __future__ import annotations

import time
from typing import Any

from prefix_index.base import ReplicaId, SessionEntry
from prefix_index.session_table import SessionTable

SESSION_FEED_MAX = 100_000
"""Stream length kept: 100 s of session writes at 1,000 turns/s, far more than a gateway
reading it every second falls behind. One that falls further (or starts later) resumes
from the oldest entry left: the feed is a cache of the session table, not a log."""

FEED_BATCH = 10_000
"""Entries read per pull (a gateway that starts catches up at this many a pull)."""


def session_value(entry: SessionEntry) -> str:
    return f"{entry.replica}\n{entry.tokens}\n{entry.last_seen_s!r}"


def parse_session(raw: bytes) -> SessionEntry:
    replica, tokens, seen = raw.decode().split("\n")
    return SessionEntry(ReplicaId(replica), int(tokens), float(seen))


class SessionFeed:
    """This gateway's position in the session stream, and the merge into a local table."""

    def __init__(self, stream_key: str, interval_s: float) -> None:
        self.key = stream_key
        self.interval_s = interval_s
        self.last_id: bytes = b"0-0"  # a new gateway first learns the sessions already there
        self._next_s = 0.0
        self.merged_total = 0

    def due(self) -> bool:
        """True at most once every ``interval_s`` (never when the interval is 0)."""
        now = time.monotonic()
        if self.interval_s <= 0 or now < self._next_s:
            return False
        self._next_s = now + self.interval_s
        return True

    def merge(self, reply: Any, table: SessionTable) -> int:
        """Apply an ``XREAD`` reply: entries newer than the table's own win. Returns how many."""
        merged = 0
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self.last_id = entry_id
                key, raw = fields.get(b"k"), fields.get(b"v")
                if key is None or raw is None:
                    continue
                try:
                    entry = parse_session(raw)
                except (ValueError, UnicodeDecodeError):
                    continue  # not ours: another version's format
                name = key.decode(errors="replace")
                current = table.get(name)
                if current is None or current.last_seen_s < entry.last_seen_s:
                    table.set(name, entry)
                    merged += 1
        self.merged_total += merged
        return merged
