"""Embedded prefix index: per-replica two-tier LRUs and one global block -> replicas map.

Layout
- Each replica gets a *slot* s; a block's entry in ``_owners`` (``dict[hash, int]``) is a
  bit set with bit ``2s`` = "replica s holds it" and bit ``2s+1`` = "... in the host tier".
- Each replica keeps two ``OrderedDict`` LRUs (``device``, ``host``; last = most recent).
  Together they are ONE recency list: the replica's ``device_blocks`` most recent blocks
  are on device, the next ``host_blocks`` in host, the rest dropped. ``record`` walks the
  chain backwards so block 0 ends most recent: a prefix outlives its extensions, as in
  SGLang's radix cache (leaves are evicted first).
- ``match`` walks the chain once, narrowing a bit mask of still-matching replicas: one
  dict lookup and a few integer operations per block, whatever the number of replicas.
  Host blocks are counted over runs of equal host masks (the mask changes rarely along a
  chain), not per block and replica.

The Redis backend implements the same model (one sorted set per replica scored by a
logical clock), so both pass one contract suite.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefix_index.base import (
    BlockHash,
    IndexStats,
    PrefixMatch,
    ReplicaCapacity,
    ReplicaId,
    SessionEntry,
)

DEFAULT_CAPACITY = ReplicaCapacity(device_blocks=16384, host_blocks=0)
"""Used until ``set_capacity``: 16,384 blocks x 64 tokens = 1M tokens of device KV, a
mid-size GPU pool; the registry replaces it with the replica's reported size."""


@dataclass(slots=True)
class _Replica:
    slot: int
    capacity: ReplicaCapacity
    device: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    host: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    @property
    def present_bit(self) -> int:
        return 1 << (2 * self.slot)


def _slots(mask: int) -> list[int]:
    """Slots whose present bit is set in ``mask`` (only even bits may be set)."""
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.append((low.bit_length() - 1) >> 1)
        mask ^= low
    return out


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


class MemoryPrefixIndex:
    """The embedded backend (default). Implements ``prefix_index.base.PrefixIndex``."""

    def __init__(
        self,
        session_ttl_s: float = 3600.0,
        default_capacity: ReplicaCapacity = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default = default_capacity
        self._owners: dict[BlockHash, int] = {}
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_slots: list[int] = []
        self.sessions = SessionTable(session_ttl_s, clock)

    # -- reads -------------------------------------------------------------------
    async def match(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        return self.match_now(hashes, replicas)

    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Synchronous ``match`` (the embedded backend never waits)."""
        by_slot = {st.slot: rid for rid in replicas if (st := self._replicas.get(rid)) is not None}
        alive = sum(1 << (2 * s) for s in by_slot)
        lengths: dict[int, int] = {}
        runs: list[tuple[int, int]] = []  # (host mask, first block index of the run)
        host_mask = 0
        get = self._owners.get
        k = 0
        for k, h in enumerate(hashes):
            v = get(h, 0)
            if v & alive != alive:
                for s in _slots(alive & ~v):
                    lengths[s] = k
                alive &= v
                if not alive:
                    break
            hm = (v >> 1) & alive
            if hm != host_mask:
                runs.append((hm, k))
                host_mask = hm
        else:
            k = len(hashes)
        for s in _slots(alive):
            lengths[s] = k
        host = self._host_counts(runs, k)
        out = {rid: PrefixMatch() for rid in replicas}
        for s, n in lengths.items():
            if n:
                out[by_slot[s]] = PrefixMatch(device_blocks=n - host.get(s, 0), host_blocks=host.get(s, 0))
        return out

    @staticmethod
    def _host_counts(runs: list[tuple[int, int]], end: int) -> dict[int, int]:
        host: dict[int, int] = {}
        for i, (mask, start) in enumerate(runs):
            stop = runs[i + 1][1] if i + 1 < len(runs) else end
            for s in _slots(mask):
                host[s] = host.get(s, 0) + stop - start
        return host

    async def get_session(self, key: str) -> SessionEntry | None:
        return self.sessions.get(key)

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        return self.sessions.resident(now_s, window_s)

    async def stats(self) -> IndexStats:
        return IndexStats(
            device_blocks={rid: len(st.device) for rid, st in self._replicas.items()},
            host_blocks={rid: len(st.host) for rid, st in self._replicas.items()},
            sessions=len(self.sessions),
        )

    def replicas(self) -> list[ReplicaId]:
        return list(self._replicas)

    def chain_order(self, replica: ReplicaId) -> list[BlockHash]:
        """The replica's blocks, least recent first (to republish them elsewhere)."""
        st = self._replicas.get(replica)
        return [] if st is None else [*st.host, *st.device]

    # -- writes ------------------------------------------------------------------
    async def record(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self.record_now(replica, hashes)

    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        st = self._replica(replica)
        owners, device, host = self._owners, st.device, st.host
        pbit = st.present_bit
        hbit = pbit << 1
        for h in reversed(hashes):
            if h in device:
                device.move_to_end(h)
                continue
            if host.pop(h, 0) is None:  # was in host: promote
                owners[h] &= ~hbit
            else:
                owners[h] = owners.get(h, 0) | pbit
            device[h] = None
        self._rebalance(st)

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        st = self._replicas.get(replica)
        if st is None:
            return
        for h in hashes[max(keep_blocks, 0):]:
            if st.device.pop(h, 0) is None or st.host.pop(h, 0) is None:
                self._clear(h, st.present_bit)
        self._rebalance(st)

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        st = self._replica(replica)
        st.capacity = capacity
        self._rebalance(st)

    async def remove_replica(self, replica: ReplicaId) -> None:
        st = self._replicas.pop(replica, None)
        if st is not None:
            for h in [*st.device, *st.host]:
                self._clear(h, st.present_bit)
            self._free_slots.append(st.slot)
        self.sessions.drop_replica(replica)

    async def set_session(self, key: str, entry: SessionEntry) -> None:
        self.sessions.set(key, entry)

    async def close(self) -> None:
        return None

    # -- internals -----------------------------------------------------------------
    def _replica(self, replica: ReplicaId) -> _Replica:
        st = self._replicas.get(replica)
        if st is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._replicas)
            st = self._replicas[replica] = _Replica(slot=slot, capacity=self._default)
        return st

    def _clear(self, h: BlockHash, pbit: int) -> None:
        v = self._owners.get(h, 0) & ~(pbit | pbit << 1)
        if v:
            self._owners[h] = v
        else:
            self._owners.pop(h, None)

    def _rebalance(self, st: _Replica) -> None:
        """Restore the tier sizes: device = the most recent ``device_blocks``, host = next."""
        owners, device, host = self._owners, st.device, st.host
        pbit = st.present_bit
        hbit = pbit << 1
        dcap, hcap = max(st.capacity.device_blocks, 0), max(st.capacity.host_blocks, 0)
        while len(device) > dcap:  # demote device LRU -> host MRU
            h, _ = device.popitem(last=False)
            host[h] = None
            owners[h] |= hbit
        while len(device) < dcap and host:  # room on device: the host MRU moves up
            h, _ = host.popitem(last=True)
            device[h] = None
            device.move_to_end(h, last=False)
            owners[h] &= ~hbit
        while len(host) > hcap:
            h, _ = host.popitem(last=False)
            self._clear(h, pbit)
