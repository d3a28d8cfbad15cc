"""Embedded prefix index for hash chains, its recency kept per recorded chain, not per block.

The model is the memory backend's (``prefix_index/memory.py``): each replica has ONE
recency list of blocks; its ``device_blocks`` most recent are on device, the next
``host_blocks`` in host, the rest dropped; ``record`` moves a chain's blocks to the most
recent end, block 0 last (a prefix outlives its extensions). This backend keeps that list
as a list of *segments*: a segment is a run of one chain's blocks by depth, ``[lo, hi)``,
of which ``[lo, dev)`` are on device; ``where`` maps each held block to its segment. A
record relinks the segments its chain takes whole, splits off the front of one it takes
in part (a prefix shared with a more recent chain), extends the deepest with the new
blocks, and writes ``where`` only for the blocks that changed segment: a session's next
turn costs a few operations per segment and one dict write per new block, instead of
the per-block moves between two LRUs that dominate the memory backend's record when
sessions come back from host.

Why it is exact (on chains: block k's hash names blocks 0..k, the contract's property):
- A block's depth is its index in every chain holding it, so a segment finds a block at
  ``chain[depth - off]`` and two chains agree up to some depth and never after.
- A record takes from older segments only the front of their live run (its chain agrees
  with theirs up to a depth, and their run starts where a newer record took the rest),
  and relinks what it took newest, in depth order: along any chain, the segments holding
  its prefix get older as the depth grows. Within a segment the lower depth is the more
  recent. So the recency list is the segments, newest first, each from ``lo`` to ``hi``.
- The device tier is the most recent ``device_blocks``: all segments newer than one edge
  segment are wholly on device, all older wholly in host, the edge split at ``dev``.
  Moving the tier boundary walks the segments it crosses (``_rebalance``).
- ``match`` follows the chain from block 0: the segment holding block j holds a run from
  j on (its ``lo`` is j: the block before it, if held, is in a newer segment), the run
  agreeing with the chain is found by a binary search, and the next segment is looked up
  at its end. That is the longest held prefix exactly, also after a truncation removed
  blocks from the middle of a run (the run is split in two segments; what sits behind
  the removed blocks is held, but no chain reaches it until they are recorded again).
  No gap bookkeeping is needed.
Eviction drops the oldest segment's deepest blocks first, as the per-block model does.
``tests/prefix_index/test_segments.py`` checks answers and recency orders against the
per-block model on random chains with truncations and capacity changes.

Inputs that are not chains (a repeated block, a block at two depths) never break the
structures: a segment's slot whose block has moved elsewhere is skipped, never popped
from ``where``; such input is outside the contract and may be counted inexactly.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_

from prefix_index.base import BlockHash, PrefixMatch, ReplicaCapacity, ReplicaId
from prefix_index.embedded import EmbeddedMethods
from prefix_index.memory import DEFAULT_CAPACITY
from prefix_index.session_table import DEFAULT_MAX_SESSIONS, SessionTable

COMPACT_BELOW = 0.25  # a segment keeping under this share of its chain copies its run (frees the rest)
COMPACT_MIN = 8  # chains up to this long are kept as they are


class _Segment:
    """Blocks ``chain[j - off]`` for depths ``lo <= j < hi``, on device for ``j < dev``."""

    __slots__ = ("chain", "dev", "hi", "lo", "newer", "off", "older")

    def __init__(self, chain: Sequence[BlockHash], off: int, lo: int, hi: int, dev: int) -> None:
        self.chain, self.off, self.lo, self.hi, self.dev = chain, off, lo, hi, dev
        self.newer: _Segment = self
        self.older: _Segment = self


class _SegmentLane:
    """One replica: its segments in a ring around a sentinel (``head.newer`` is the
    oldest, ``head.older`` the newest), its blocks' segments, the tier counts."""

    __slots__ = ("capacity", "edge", "head", "n_dev", "n_host", "where")

    def __init__(self, capacity: ReplicaCapacity) -> None:
        self.capacity = capacity
        self.head = _Segment((), 0, 0, 0, 0)
        self.edge = self.head  # newer segments wholly on device, older wholly in host
        self.where: dict[BlockHash, _Segment] = {}
        self.n_dev = self.n_host = 0

    def link_newest(self, seg: _Segment) -> None:
        head = self.head
        seg.older, seg.newer = head.older, head
        head.older.newer = seg
        head.older = seg

    def link_older(self, seg: _Segment, than: _Segment) -> None:
        seg.newer, seg.older = than, than.older
        than.older.newer = seg
        than.older = seg

    def unlink(self, seg: _Segment) -> None:
        seg.older.newer, seg.newer.older = seg.newer, seg.older
        if self.edge is seg:
            self.edge = seg.newer if seg.newer is not self.head else seg.older

    def remove(self, seg: _Segment, x: int, y: int) -> None:
        """Remove depths ``[x, y)`` (within ``[lo, hi)``) from ``seg``; the caller has
        dealt with ``where`` for them."""
        on_device = max(0, min(y, seg.dev) - x)
        self.n_dev -= on_device
        self.n_host -= (y - x) - on_device
        if x == seg.lo and y == seg.hi:
            self.unlink(seg)
            return
        if x == seg.lo:
            seg.lo, seg.dev = y, max(seg.dev, y)
        elif y == seg.hi:
            seg.hi, seg.dev = x, min(seg.dev, x)
        else:  # the middle: the older part becomes its own segment, right behind
            rest = _Segment(seg.chain, seg.off, y, seg.hi, max(seg.dev, y))
            seg.hi, seg.dev = x, min(seg.dev, x)
            self.link_older(rest, seg)
            self.point(rest, seg)
            if self.edge is seg and rest.dev > rest.lo:
                self.edge = rest
            self.compact(rest)
        self.compact(seg)

    def owned(self, seg: _Segment, x: int, y: int, holder: _Segment) -> list[BlockHash]:
        """The blocks of ``seg``'s chain at depths ``[x, y)`` that ``where`` gives to
        ``holder`` (a slot whose block moved elsewhere is not its own)."""
        run = seg.chain[x - seg.off: y - seg.off]
        return list(compress(run, map(is_, map(self.where.get, run), repeat(holder))))  # C loops

    def point(self, seg: _Segment, was: _Segment) -> None:
        """Re-point ``where`` at ``seg`` for the blocks of its run that ``was`` held."""
        self.where.update(zip(self.owned(seg, seg.lo, seg.hi, was), repeat(seg)))

    @staticmethod
    def compact(seg: _Segment) -> None:
        """A run much shorter than the chain it points into gets its own copy, so a long
        chain is not kept alive for a few of its blocks. The copy starts one block early
        (the run's parent, when it has one): ``held_oldest_first`` reads it."""
        run = seg.hi - seg.lo
        if len(seg.chain) > COMPACT_MIN and run < COMPACT_BELOW * len(seg.chain):
            start = max(seg.lo - 1, seg.off)
            seg.chain, seg.off = tuple(seg.chain[start - seg.off: seg.hi - seg.off]), start

    def held_oldest_first(self) -> tuple[list[BlockHash], set[BlockHash]]:
        """The recency list, least recent block first, and the *gaps*: the missing parents
        of held runs (what a truncation removed in front of blocks still held; no chain
        reaches those blocks until their parents are recorded again)."""
        where, head = self.where, self.head
        blocks: list[BlockHash] = []
        gaps: set[BlockHash] = set()
        seg = head.newer
        while seg is not head:
            run = self.owned(seg, seg.lo, seg.hi, seg)
            run.reverse()  # within a segment the deepest block is the least recent
            blocks.extend(run)
            if seg.lo > seg.off:  # the run's parent (depth lo - 1) is in the chain
                parent = seg.chain[seg.lo - 1 - seg.off]
                holder = where.get(parent)
                if holder is None or not holder.lo <= seg.lo - 1 < holder.hi:
                    gaps.add(parent)
            seg = seg.newer
        return blocks, gaps

    def drop_oldest(self, count: int) -> None:
        """Drop the ``count`` least recent blocks (the oldest segments' deepest)."""
        where, head = self.where, self.head
        while count > 0 and (seg := head.newer) is not head:
            x = max(seg.lo, seg.hi - count)
            deque(map(where.pop, self.owned(seg, x, seg.hi, seg)), maxlen=0)
            count -= seg.hi - x
            self.remove(seg, x, seg.hi)


def _agree(seg: _Segment, hashes: Sequence[BlockHash], j: int, stop: int) -> int:
    """The end of the run from depth ``j`` (held by ``seg``) along which ``seg``'s chain
    is ``hashes``, before ``stop``: a binary search (chains agree up to a depth, then never)."""
    chain, off = seg.chain, seg.off
    return bisect_left(range(j, stop), True, key=lambda k: chain[k - off] != hashes[k]) + j


def _held(lane: _SegmentLane, hashes: Sequence[BlockHash]) -> list[tuple[_Segment, int, int]]:
    """The segments along the longest held prefix of ``hashes``: (segment, from, to)."""
    where, n = lane.where, len(hashes)
    hops: list[tuple[_Segment, int, int]] = []
    j = 0
    while j < n and (seg := where.get(hashes[j])) is not None:
        if seg.lo != j or seg.chain[j - seg.off] != hashes[j]:
            break  # not a chain at this depth (outside the contract): stop here
        end = _agree(seg, hashes, j + 1, min(seg.hi, n))
        hops.append((seg, j, end))
        j = end
    return hops


class SegmentPrefixIndex(EmbeddedMethods):
    """The embedded backend (default). Implements ``prefix_index.base.PrefixIndex`` for
    hash chains (module docstring)."""

    def __init__(
        self,
        session_ttl_s: float = 3600.0,
        default_capacity: ReplicaCapacity = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._default = default_capacity
        self._lanes: dict[ReplicaId, _SegmentLane] = {}
        self.sessions = SessionTable(session_ttl_s, clock, max_sessions)

    # -- reads -------------------------------------------------------------------
    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Synchronous ``match`` (the embedded backend never waits)."""
        out: dict[ReplicaId, PrefixMatch] = {}
        lanes = self._lanes
        for rid in replicas:
            lane = lanes.get(rid)
            hops = _held(lane, hashes) if lane is not None and hashes else None
            if not hops:
                out[rid] = PrefixMatch()
                continue
            device = sum(max(0, min(end, seg.dev) - start) for seg, start, end in hops)
            out[rid] = PrefixMatch(device_blocks=device, host_blocks=hops[-1][2] - device)
        return out

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        return {rid: (lane.n_dev, lane.n_host) for rid, lane in self._lanes.items()}

    def replica_count(self) -> int:
        return len(self._lanes)

    def holds(self, replica: ReplicaId) -> bool:
        return replica in self._lanes

    def pop_lane(self) -> tuple[ReplicaId, ReplicaCapacity, list[BlockHash], set[BlockHash]]:
        """The oldest replica's capacity, its blocks least recent first and its gaps
        (``_SegmentLane.held_oldest_first``), taken out (its sessions stay): what another
        representation needs to take the replica over (``prefix_index.local_index``)."""
        rid = next(iter(self._lanes))
        lane = self._lanes.pop(rid)
        return (rid, lane.capacity, *lane.held_oldest_first())

    # -- writes ------------------------------------------------------------------
    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        """The chain's blocks become the most recent, block 0 last (module docstring).

        The held prefix moves segment by segment: a segment the chain takes whole is
        relinked as it is (its blocks' ``where`` entries stay right); of one it takes the
        front only, the front becomes a new segment. The new blocks extend the deepest
        piece. So a session's next turn writes ``where`` only for its new blocks and for
        the prefix it shares with a more recent session."""
        lane = self._lane(replica)
        chain = hashes if isinstance(hashes, tuple) else tuple(hashes)
        n = len(chain)
        if n:
            where = lane.where
            hops = _held(lane, chain)
            held = hops[-1][2] if hops else 0
            if self._take(lane, chain, held, n):  # held further on, behind removed blocks
                hops = _held(lane, chain)  # (unchanged on chains; input that is not one may differ)
                held = hops[-1][2] if hops else 0
            pieces: list[_Segment] = []
            for seg, start, end in hops:
                whole = end == seg.hi
                lane.remove(seg, start, end)
                if whole:  # the segment itself moves
                    piece = seg
                else:  # its front becomes a new segment; the rest stays where it is
                    piece = _Segment(chain, 0, start, end, end)
                    where.update(zip(chain[start:end], repeat(piece)))
                pieces.append(piece)
            if held < n:  # the new blocks: the deepest piece grows (its run agrees with the chain)
                if pieces:
                    last = pieces[-1]
                    last.chain, last.off, last.hi = chain, 0, n
                else:
                    last = _Segment(chain, 0, 0, n, n)
                    pieces.append(last)
                where.update(zip(chain[held:], repeat(last)))
            for piece in reversed(pieces):  # the deepest first: block 0's piece ends newest
                piece.dev = piece.hi
                lane.link_newest(piece)
                lane.n_dev += piece.hi - piece.lo
                lane.compact(piece)
        self._rebalance(lane)

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        lane = self._lanes.get(replica)
        if lane is None:
            return
        where = lane.where
        keep = max(keep_blocks, 0)
        taken = self._take(lane, hashes, keep, len(hashes))
        deque(map(where.pop, taken), maxlen=0)
        self._rebalance(lane)

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        lane = self._lane(replica)
        lane.capacity = capacity
        self._rebalance(lane)

    async def remove_replica(self, replica: ReplicaId) -> None:
        self._lanes.pop(replica, None)
        self.sessions.drop_replica(replica)

    # -- internals -----------------------------------------------------------------
    def _lane(self, replica: ReplicaId) -> _SegmentLane:
        lane = self._lanes.get(replica)
        if lane is None:
            lane = self._lanes[replica] = _SegmentLane(self._default)
        return lane

    @staticmethod
    def _take(lane: _SegmentLane, hashes: Sequence[BlockHash], lo: int, hi: int) -> list[BlockHash]:
        """Remove the held blocks among ``hashes[lo:hi]`` from their segments (each
        segment's blocks among them are one run by depth); returns them (still in
        ``where``, which the caller overwrites or pops)."""
        if lo >= hi or not lane.where:
            return []
        found = list(map(lane.where.get, hashes[lo:hi]))
        if not any(found):
            return []
        runs: dict[_Segment, list[int]] = {}
        taken: list[BlockHash] = []
        for k, seg in enumerate(found, lo):
            if seg is not None and seg.lo <= k < seg.hi and seg.chain[k - seg.off] == hashes[k]:
                run = runs.setdefault(seg, [k, k])
                run[1] = k
                taken.append(hashes[k])
        for seg, (x, last) in runs.items():
            lane.remove(seg, x, last + 1)
        return taken

    @staticmethod
    def _rebalance(lane: _SegmentLane) -> None:
        """Move the tier boundary so the device holds the most recent ``device_blocks``
        (demoting from the edge newer-wards, or promoting older-wards), then drop the
        least recent blocks beyond ``device_blocks + host_blocks``."""
        dcap, hcap = max(lane.capacity.device_blocks, 0), max(lane.capacity.host_blocks, 0)
        head = lane.head
        if lane.edge is head:  # the ring was empty: any segment now in it is the edge
            lane.edge = head.newer
        while lane.n_dev > dcap:
            seg = lane.edge
            if seg is head:
                break  # nothing on device to demote (counts of non-chain input)
            take = min(seg.dev - seg.lo, lane.n_dev - dcap)
            seg.dev -= take
            lane.n_dev -= take
            lane.n_host += take
            if lane.n_dev > dcap:
                lane.edge = seg.newer
        while lane.n_dev < dcap and lane.n_host > 0:
            seg = lane.edge
            if seg is head:
                break
            take = min(seg.hi - seg.dev, dcap - lane.n_dev)
            seg.dev += take
            lane.n_dev += take
            lane.n_host -= take
            if lane.n_dev < dcap and lane.n_host > 0:
                lane.edge = seg.older
        excess = lane.n_dev + lane.n_host - (dcap + hcap)
        if excess > 0:
            lane.drop_oldest(excess)
