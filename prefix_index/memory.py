"""Embedded prefix index: per-replica two-tier LRUs and one global block -> replicas map.

Layout
- Each replica gets a *slot* s; a block's entry in ``_owners`` (``dict[hash, int]``) is a
  bit set with bit ``2s`` = "replica s holds it" (in either tier; the odd bits stay 0). The
  tier is read from the replica's own LRUs, so moving a block between its tiers (HiCache's
  demotion and load-back, most of a busy replica's work) touches only those two dicts.
- Each replica keeps two ``OrderedDict`` LRUs (``device``, ``host``; last = most recent).
  Together they are ONE recency list: the replica's ``device_blocks`` most recent blocks
  are on device, the next ``host_blocks`` in host, the rest dropped. ``record`` walks the
  chain backwards so block 0 ends most recent: a prefix outlives its extensions, as in
  SGLang's radix cache (leaves are evicted first).
- ``match`` walks the chain once, narrowing a bit mask of still-matching replicas: one
  dict lookup and a few integer operations per block, whatever the number of replicas;
  then each matching replica's host blocks are counted in its host LRU (a C loop).
- ``record`` and ``_rebalance`` do their per-block work in C loops (``map``/``filter``/
  ``update`` over the chain or over an ``islice`` of the oldest blocks of a tier): the
  chain's new blocks are inserted, then the whole chain is moved to the MRU end in order
  (``move_to_end``). The orders and bits are exactly those of one ``move_to_end`` /
  ``popitem`` per block (``tests/prefix_index/test_memory_speed_equivalence.py`` checks it
  against that per-block model, chains repeating a block included).

- Used for hash lists that need not be chains (the Redis backend's local copy with
  ``redis_exact_match``; the contract suite's ``memory-walk``). The gateway's hashes are
  chains: its embedded index is ``prefix_index/segments.py``, which keeps this model's
  recency list one segment per recorded chain instead of one entry per block.

The Redis backend implements the same model (one sorted set per replica scored by a
logical clock), so both pass one contract suite.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, filterfalse, islice, repeat
from operator import not_

from prefix_index.base import (
    BlockHash,
    PrefixMatch,
    ReplicaCapacity,
    ReplicaId,
)
from prefix_index.embedded import EmbeddedMethods
from prefix_index.session_table import DEFAULT_MAX_SESSIONS, SessionTable

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


class MemoryPrefixIndex(EmbeddedMethods):
    """The per-block embedded index, for any hash list. Implements ``prefix_index.base.PrefixIndex``."""

    def __init__(
        self,
        session_ttl_s: float = 3600.0,
        default_capacity: ReplicaCapacity = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._default = default_capacity
        self._owners: dict[BlockHash, int] = {}
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_slots: list[int] = []
        self.sessions = SessionTable(session_ttl_s, clock, max_sessions)

    # -- reads -------------------------------------------------------------------
    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Synchronous ``match`` (the embedded backend never waits)."""
        by_slot = {st.slot: rid for rid in replicas if (st := self._replicas.get(rid)) is not None}
        out = {rid: PrefixMatch() for rid in replicas}
        out.update(self._walk(hashes, by_slot) if by_slot else {})
        return out

    def _walk(self, hashes: Sequence[BlockHash], by_slot: dict[int, ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Match by walking the chain once for the replicas in ``by_slot`` (any hash list)."""
        alive = sum(1 << (2 * s) for s in by_slot)
        lengths: dict[int, int] = {}
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
        else:
            k = len(hashes)
        for s in _slots(alive):
            lengths[s] = k
        out: dict[ReplicaId, PrefixMatch] = {}
        for s, n in lengths.items():
            if n:
                rid = by_slot[s]
                host = sum(map(self._replicas[rid].host.__contains__, islice(hashes, n)))
                out[rid] = PrefixMatch(device_blocks=n - host, host_blocks=host)
        return out

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        return {rid: (len(st.device), len(st.host)) for rid, st in self._replicas.items()}

    # -- writes ------------------------------------------------------------------

    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        st = self._replica(replica)
        chain = hashes[::-1]  # block 0 last: most recent
        owners, device, host = self._owners, st.device, st.host
        pbit = st.present_bit
        absent = list(filterfalse(device.__contains__, chain))
        promoted = list(filter(host.__contains__, absent))
        fresh = list(filterfalse(host.__contains__, absent)) if promoted else absent
        deque(map(host.pop, promoted, repeat(None)), maxlen=0)  # a repeated block
        owners.update(zip(fresh, map(pbit.__or__, map(owners.get, fresh, repeat(0)))))
        device.update(zip(absent, repeat(None)))
        deque(map(device.move_to_end, chain), maxlen=0)  # the chain to the end, in its order
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

    # -- internals -----------------------------------------------------------------
    def _replica(self, replica: ReplicaId) -> _Replica:
        st = self._replicas.get(replica)
        if st is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._replicas)
            st = self._replicas[replica] = _Replica(slot=slot, capacity=self._default)
        return st

    def _clear(self, h: BlockHash, pbit: int) -> None:
        v = self._owners.get(h, 0) & ~pbit
        if v:
            self._owners[h] = v
        else:
            self._owners.pop(h, None)

    def _rebalance(self, st: _Replica) -> None:
        """Restore the tier sizes: device = the most recent ``device_blocks``, host = next."""
        owners, device, host = self._owners, st.device, st.host
        dcap, hcap = max(st.capacity.device_blocks, 0), max(st.capacity.host_blocks, 0)
        if len(device) > dcap:  # demote the device LRU blocks -> host MRU, oldest first
            moved = list(islice(device, len(device) - dcap))
            deque(map(device.pop, moved), maxlen=0)
            host.update(zip(moved, repeat(None)))
        while len(device) < dcap and host:  # room on device: the host MRU moves up
            h, _ = host.popitem(last=True)
            device[h] = None
            device.move_to_end(h, last=False)
        if len(host) > hcap:  # drop the host LRU blocks
            dropped = list(islice(host, len(host) - hcap))
            deque(map(host.pop, dropped), maxlen=0)
            keep = ~st.present_bit
            left = list(map(keep.__and__, map(owners.get, dropped, repeat(0))))
            owners.update(zip(dropped, left))
            deque(map(owners.pop, compress(dropped, map(not_, left))), maxlen=0)
