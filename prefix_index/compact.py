"""Compact embedded prefix index: the embedded backend's model in flat numpy arrays, so its
memory and its pauses do not grow with Python objects (one per block in ``memory.py``).

Same model and contract as ``prefix_index.memory`` (one recency list per replica: the
``device_blocks`` most recent blocks on device, the next ``host_blocks`` in host, the rest
dropped; ``record`` makes block 0 the most recent), stored by
``prefix_index.compact_store.RowStore`` (~17 bytes a held block; 512 replicas x 93,750
blocks in ~0.8 GB), with the device/host boundary of each replica kept as a log
position (a block is on device when its position is at or past it).

``match`` never walks the replicas block by block: one vectorized probe finds the
replicas holding block 0, then (chains, ``assume_chains``, the default: the gateway's
hashes are chains) a vectorized k-ary search over all of them at once finds each one's
held prefix and device prefix (both are prefixes along a chain: a parent is always more
recent than its child), ``SEARCH_POINTS`` probes a replica per round, ~3 rounds for a
1,500-block chain, whatever the fleet size. Every replica when ``assume_chains=False``, and
a replica with a *gap* on the requested chain, are checked block by block (one vectorized
probe of the whole chain per replica), exact for any hash list. A replica's gaps are the
blocks ``truncate`` removed from it (their descendants on other chains may remain held);
recording a block again clears it. Along a chain holding none of a replica's gaps its held
blocks are a prefix (eviction takes a child before its parent), so only such a chain is
walked, and only on the replicas whose gaps it holds (``_gap_counts`` finds them in one
pass over the chain), not for every lookup (docs/benchmarks.md, section 5.1, "Truncation
gaps"). A replica keeps at most ``max(its capacity in blocks, GAPS_MIN)`` gaps: past that
it is walked on every lookup and its gaps are dropped (bounded memory, still exact).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prefix_index.base import (
    BlockHash,
    PrefixMatch,
    ReplicaCapacity,
    ReplicaId,
)
from prefix_index.compact_store import I64, U64, RowStore, as_hashes
from prefix_index.embedded import EmbeddedMethods
from prefix_index.memory import DEFAULT_CAPACITY
from prefix_index.session_table import DEFAULT_MAX_SESSIONS, SessionTable

SEARCH_POINTS = 12  # probes per replica and round: 13**3 = 2,197 blocks in 3 rounds
GROUPS = 6  # replicas searched one by one (each with the replicas sharing its answer)
SCALAR_ROWS = 4  # this few replicas left: scalar searches, no vectorized check
_NONE = np.int64(1 << 62)  # a boundary no position reaches: nothing on device
_EMPTY = PrefixMatch()


GAPS_MIN = 4096  # gaps kept per replica at least (beyond its capacity in blocks: walked instead)


@dataclass(slots=True)
class _Replica:
    slot: int
    capacity: ReplicaCapacity
    boundary: int = 0  # log position from which blocks are on device
    gaps: set[BlockHash] = field(default_factory=set)
    walk_all: bool = False  # gaps beyond the bound: walked block by block, gaps no longer kept

    @property
    def total(self) -> int:
        return max(self.capacity.device_blocks, 0) + max(self.capacity.host_blocks, 0)


class CompactPrefixIndex(EmbeddedMethods):
    """The compact embedded backend. Implements ``prefix_index.base.PrefixIndex``."""

    def __init__(
        self,
        session_ttl_s: float = 3600.0,
        default_capacity: ReplicaCapacity = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        assume_chains: bool = True,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._default = default_capacity
        self._chains = assume_chains
        self._store = RowStore(default_capacity.device_blocks + default_capacity.host_blocks)
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_slots: list[int] = []
        # per slot, mirrored from the replicas for vectorized reads: the device boundary,
        # and whether the replica is always walked block by block (no chain assumption)
        self._bound = np.zeros(self._store.rows, dtype=np.int64)
        self._walks = np.full(self._store.rows, not assume_chains, dtype=np.bool_)
        self._rows_cache: tuple[tuple[ReplicaId, ...], I64, list[ReplicaId]] | None = None
        self._memo: dict[tuple[int, int], PrefixMatch] = {}
        self._gap_counts: dict[BlockHash, int] = {}  # gap block -> replicas with it in their gaps
        self.sessions = SessionTable(session_ttl_s, clock, max_sessions)

    # -- reads -------------------------------------------------------------------
    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        out = dict.fromkeys(replicas, _EMPTY)
        keys = as_hashes(hashes)
        rows, rids = self._rows_of(replicas)
        if not rids or keys.size == 0:
            return out
        idx = np.flatnonzero(self._store.find(rows, np.full(rows.size, keys[0], dtype=np.uint64)) >= 0)
        walked = self._walks[rows[idx]]
        if self._gap_counts and (hit := set(filter(self._gap_counts.__contains__, hashes))):
            gapped = [st.slot for st in self._replicas.values() if st.gaps and not st.gaps.isdisjoint(hit)]
            walked = walked | np.isin(rows[idx], gapped)
        for i in idx[walked].tolist():
            out[rids[i]] = self._walk(keys, self._replicas[rids[i]])
        searched = idx[~walked]
        if searched.size:
            srows = rows[searched]
            held, device = self._search_grouped(keys, srows, self._bound[srows])
            # one PrefixMatch per distinct answer (replicas mostly share a few), then the
            # dict filled at C speed, not replica by replica in Python
            answers, which = np.unique(held * (keys.size + 1) + device, return_inverse=True)
            matches = [self._prefix_match(*divmod(a, keys.size + 1)) for a in answers.tolist()]
            out.update(zip(map(rids.__getitem__, searched.tolist()), map(matches.__getitem__, which.tolist())))
        return out

    def _prefix_match(self, held: int, device: int) -> PrefixMatch:
        """The (shared, immutable) match of ``held`` blocks, ``device`` of them on device."""
        memo = self._memo
        m = memo.get((held, device))
        if m is None:
            if len(memo) > 4096:
                memo.clear()
            m = memo[(held, device)] = PrefixMatch(device_blocks=device, host_blocks=held - device)
        return m

    def _rows_of(self, replicas: Sequence[ReplicaId]) -> tuple[I64, list[ReplicaId]]:
        """Slots and ids of the known replicas among ``replicas`` (cached for the last list
        asked: the gateway asks for the same fleet every time)."""
        key = tuple(replicas)
        if self._rows_cache is not None and self._rows_cache[0] == key:
            return self._rows_cache[1], self._rows_cache[2]
        rids = [rid for rid in dict.fromkeys(replicas) if rid in self._replicas]
        rows = np.array([self._replicas[rid].slot for rid in rids], dtype=np.int64)
        self._rows_cache = (key, rows, rids)
        return rows, rids

    def _walk(self, keys: U64, st: _Replica) -> PrefixMatch:
        """Exact for any hash list: the longest held prefix, and its device blocks."""
        pos = self._store.positions(np.full(keys.size, st.slot, dtype=np.int64), keys)
        missing = np.flatnonzero(pos < 0)
        n = int(missing[0]) if missing.size else keys.size
        device = int((pos[:n] >= st.boundary).sum())
        return PrefixMatch(device_blocks=device, host_blocks=n - device)

    def _search_one(self, keys: U64, r: int, bound: int) -> tuple[int, int]:
        """Held and device prefix lengths on one row: binary searches of scalar probes."""
        pos1 = self._store.position1
        lo, hi = 1, keys.size  # block 0 is held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pos1(r, int(keys[mid - 1])) >= 0 else (lo, mid - 1)
        dlo, dhi = 0, lo
        while dlo < dhi:
            mid = (dlo + dhi + 1) // 2
            dlo, dhi = (mid, dhi) if pos1(r, int(keys[mid - 1])) >= bound else (dlo, mid - 1)
        return lo, dlo

    def _search_grouped(self, keys: U64, rows: I64, bounds: I64) -> tuple[I64, I64]:
        """Replicas mostly share answers (a system prompt held everywhere): search one
        pending replica, then check in one vectorized probe which pending replicas have
        the same held and device lengths (the blocks on both sides of each boundary);
        ``GROUPS`` rounds at most, then the k-ary search for the rest."""
        n = keys.size
        held = np.zeros(rows.size, dtype=np.int64)
        device = np.zeros(rows.size, dtype=np.int64)
        pending = np.arange(rows.size)
        for _ in range(GROUPS):
            if pending.size <= SCALAR_ROWS:
                for i in pending.tolist():
                    held[i], device[i] = self._search_one(keys, int(rows[i]), int(bounds[i]))
                return held, device
            i0 = int(pending[pending.size // 2])
            a, d = self._search_one(keys, int(rows[i0]), int(bounds[i0]))
            # same answer: key a-1 held and key a not; key d-1 on device and key d not
            # (a point is skipped outside the chain, or when it is another one's)
            checks = [(a - 1, "held")] + ([(a, "absent")] if a < n else [])
            checks += [(d - 1, "device")] if d > 0 else []
            checks += [(d, "not device")] if d < a else []
            idx = np.array([k for k, _ in checks], dtype=np.int64)
            pos = self._store.positions(np.repeat(rows[pending], idx.size), np.tile(keys[idx], pending.size))
            pos = pos.reshape(pending.size, idx.size)
            b = bounds[pending]
            same = np.ones(pending.size, dtype=np.bool_)
            for c, (_, what) in enumerate(checks):
                p = pos[:, c]
                same &= {"held": p >= 0, "absent": p < 0, "device": p >= b, "not device": p < b}[what]
            same[pending == i0] = True
            held[pending[same]], device[pending[same]] = a, d
            pending = pending[~same]
        if pending.size:
            held[pending], device[pending] = self._search(keys, rows[pending], bounds[pending])
        return held, device

    def _search(self, keys: U64, rows: I64, bounds: I64) -> tuple[I64, I64]:
        """Held and device prefix lengths of chain ``keys`` on ``rows`` (block 0 held by
        all): a k-ary search of both boundaries at once, vectorized over the rows."""
        n, k = keys.size, SEARCH_POINTS
        held_lo, held_hi = np.ones(rows.size, dtype=np.int64), np.full(rows.size, n, dtype=np.int64)
        dev_lo, dev_hi = np.zeros(rows.size, dtype=np.int64), np.full(rows.size, n, dtype=np.int64)
        j = np.arange(1, k + 1, dtype=np.int64)
        while True:
            dev_hi = np.minimum(dev_hi, held_hi)
            open_h, open_d = held_lo < held_hi, dev_lo < dev_hi
            if not (open_h.any() or open_d.any()):
                return held_lo, dev_lo
            pts_h = _points(held_lo, held_hi, j)  # prefix lengths to test, [rows, k]
            pts_d = _points(dev_lo, dev_hi, j)
            both = np.concatenate([pts_h, pts_d], axis=1)
            pos = self._store.positions(np.repeat(rows, 2 * k), keys[both.reshape(-1) - 1]).reshape(both.shape)
            ok_h = pos[:, :k] >= 0
            ok_d = pos[:, k:] >= bounds[:, None]
            held_lo, held_hi = _narrow(held_lo, held_hi, pts_h, ok_h, open_h)
            dev_lo, dev_hi = _narrow(dev_lo, dev_hi, pts_d, ok_d, open_d)

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        out = {}
        for rid, st in self._replicas.items():
            live = int(self._store.live[st.slot])
            device = min(live, max(st.capacity.device_blocks, 0))
            out[rid] = (device, live - device)
        return out

    # -- writes ------------------------------------------------------------------
    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        st = self._replica(replica)
        keys = as_hashes(hashes)
        if keys.size == 0:
            return
        if len(set(hashes)) == keys.size:  # a chain: distinct (a set costs less than a sort)
            chain = keys
        else:
            uniq, first = np.unique(keys, return_index=True)
            chain = uniq[np.argsort(first)]  # distinct blocks, most recent (block 0) first
        store, r, total = self._store, st.slot, st.total
        keep, drop = chain[:total], chain[total:]  # beyond the capacity: evicted at once
        if drop.size:
            store.delete(r, drop)
        found = store.find(np.full(keep.size, r, dtype=np.int64), keep)
        held = store.table[found[found >= 0]] & store.pos_mask
        excess = int(store.live[r]) - held.size + keep.size - total  # others that must go
        if excess > 0:  # deleting others moves no slot: ``found`` stays valid
            oldest = store.oldest_live(r, excess + held.size)
            mine = np.zeros(int(store.head[r]), dtype=np.bool_)  # the chain's own positions
            mine[held - 1] = True
            others = oldest[~mine[oldest]][:excess]
            store.delete(r, store.log[r * store.L + others])
        store.append(r, keep[::-1], found[::-1])  # oldest first: block 0 ends most recent
        if st.gaps:
            self._gaps_filled(st, st.gaps.intersection(hashes))
        dcap = max(st.capacity.device_blocks, 0)
        if 0 < dcap <= keep.size:  # the newest positions are this chain's, all live
            st.boundary = int(store.head[r]) - dcap
            self._sync(st)
        else:
            self._rebalance(st)

    def load(self, replica: ReplicaId, capacity: ReplicaCapacity, blocks: Sequence[BlockHash],
             gaps: set[BlockHash]) -> None:
        """Take a replica's whole recency list at once (converting another representation):
        ``blocks`` distinct, least recent first, at most ``capacity``; ``gaps``: missing
        blocks whose descendants are held (the replica is walked block by block until they
        are recorded again, as after ``truncate``). Replaces what the replica held."""
        known = replica in self._replicas
        st = self._replica(replica)
        st.capacity = capacity
        self._fit(st.total)
        if known:
            self._store.clear(st.slot)
        keys = as_hashes(blocks)[-st.total:] if st.total else as_hashes(())
        self._store.append(st.slot, keys, np.full(keys.size, -1, dtype=np.int64))  # an empty row: none found
        self._gaps_filled(st, set(st.gaps))
        st.walk_all = False
        if self._chains:
            self._gaps_made(st, gaps)
        self._place(st)

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        st = self._replicas.get(replica)
        if st is None:
            return
        gone = as_hashes(hashes)[max(keep_blocks, 0):]
        if gone.size:
            pos = self._store.positions(np.full(gone.size, st.slot, dtype=np.int64), gone)
            removed = np.unique(gone[pos >= 0])  # a hash list may repeat a block
            self._store.delete(st.slot, removed)
            if self._chains:  # their descendants on other chains may stay: gaps
                self._gaps_made(st, removed.tolist())
        self._rebalance(st)

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        st = self._replica(replica)
        st.capacity = capacity
        self._rebalance(st)

    async def remove_replica(self, replica: ReplicaId) -> None:
        st = self._replicas.pop(replica, None)
        if st is not None:
            self._gaps_filled(st, set(st.gaps))
            self._store.clear(st.slot)
            self._free_slots.append(st.slot)
            self._rows_cache = None
        self.sessions.drop_replica(replica)

    # -- internals -----------------------------------------------------------------
    def _replica(self, replica: ReplicaId) -> _Replica:
        st = self._replicas.get(replica)
        if st is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._replicas)
            self._store.add_rows(slot + 1)
            if self._store.rows > self._bound.size:
                extra = self._store.rows - self._bound.size
                self._bound = np.concatenate([self._bound, np.zeros(extra, dtype=np.int64)])
                self._walks = np.concatenate([self._walks, np.full(extra, not self._chains, dtype=np.bool_)])
            st = self._replicas[replica] = _Replica(slot=slot, capacity=self._default)
            self._rows_cache = None
            self._fit(st.total)
            self._sync(st)
        return st

    def _fit(self, total: int) -> None:
        """Grow every row when a replica's capacity exceeds the store's (rare: sizing)."""
        if total > self._store.cap:
            self._store = self._store.reshaped(max(total, 2 * self._store.cap))
            for st in self._replicas.values():  # positions were renumbered
                self._place(st)

    def _rebalance(self, st: _Replica) -> None:
        self._fit(st.total)
        self._place(st)

    def _place(self, st: _Replica) -> None:
        """Evict beyond the capacity (oldest first) and place the device boundary."""
        store, r = self._store, st.slot
        live = store.live_positions(r)
        if live.size > st.total:
            store.delete(r, store.log[r * store.L + live[: live.size - st.total]])
            live = live[live.size - st.total:]
        dcap = max(st.capacity.device_blocks, 0)
        st.boundary = int(_NONE) if dcap == 0 else (0 if dcap >= live.size else int(live[live.size - dcap]))
        self._sync(st)

    def _sync(self, st: _Replica) -> None:
        self._bound[st.slot] = st.boundary
        self._walks[st.slot] = not self._chains or st.walk_all

    def _gaps_made(self, st: _Replica, blocks: Iterable[BlockHash]) -> None:
        """``blocks`` are gaps of ``st``. Bounded: past ``max(st.total, GAPS_MIN)`` gaps the
        replica is walked block by block on every lookup (exact for any hash list, as
        without the chain assumption) and its gaps are dropped, until ``load`` replaces it."""
        if st.walk_all:
            return
        counts = self._gap_counts
        for h in set(blocks) - st.gaps:
            counts[h] = counts.get(h, 0) + 1
            st.gaps.add(h)
        if len(st.gaps) > max(st.total, GAPS_MIN):
            self._gaps_filled(st, set(st.gaps))
            st.walk_all = True
            self._sync(st)

    def _gaps_filled(self, st: _Replica, blocks: set[BlockHash]) -> None:
        """``blocks`` (among ``st.gaps``) are gaps no more."""
        counts = self._gap_counts
        for h in blocks:
            st.gaps.discard(h)
            if counts[h] == 1:
                del counts[h]
            else:
                counts[h] -= 1


def _points(lo: I64, hi: I64, j: I64) -> I64:
    """``k`` prefix lengths spread over ``(lo, hi]`` per row (clipped; ``lo`` >= 0)."""
    step = np.maximum((hi - lo + j.size) // (j.size + 1), 1)
    pts: I64 = np.clip(lo[:, None] + step[:, None] * j[None, :], 1, np.maximum(hi, 1)[:, None])
    return pts


def _narrow(lo: I64, hi: I64, pts: I64, ok: np.ndarray, still_open: np.ndarray) -> tuple[I64, I64]:
    """Monotone predicate: the largest passing point raises ``lo``, the smallest failing
    point lowers ``hi`` (rows already closed keep theirs)."""
    new_lo = np.maximum(lo, np.where(ok, pts, 0).max(axis=1))
    new_hi = np.maximum(np.minimum(hi, np.where(ok, hi[:, None], pts - 1).min(axis=1)), new_lo)
    return np.where(still_open, new_lo, lo), np.where(still_open, new_hi, hi)
