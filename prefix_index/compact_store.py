"""The storage of the compact prefix index: per replica, a recency log and a hash table, in
flat numpy arrays shared by every replica (no Python object per block).

Rows. Replica slot ``r`` owns row ``r`` of four flat arrays (every row has the same
shape, sized for the largest replica capacity):

- ``log[r*L + p]`` (uint64): the block hash written at log position ``p``. A replica's
  recency list is its log read from the newest position down, skipping holes;
  ``alive[r*L + p]`` (bool) says whether position ``p`` still holds its block (moving a
  block to the MRU end appends it again and leaves a hole). ``head[r]``: next position.
- ``table[r*S + s]`` (int32): open addressing over the row's live blocks in buckets of
  ``BUCKET`` slots (a probe reads one bucket, 32 bytes, per step). A slot holds
  ``fingerprint << pos_bits | (p + 1)`` (0 = empty): the position ``p`` of
  the block in the log and a few bits of its hash, so a probe reads the log (the full
  64-bit hash: ``log[r*L + p] == hash``) only for a slot whose fingerprint agrees. The
  table stores 4 bytes a slot, not the hash again.
- ``over[r*S/BUCKET + b]`` (int32): how many of the row's blocks live beyond bucket ``b``
  on their probe path (their home bucket is ``b`` or before it and they sit after it). A
  probe goes on past a bucket only while its count is positive, so a deleted slot can be
  emptied at once: no tombstones, and so no table rehash ever.

*Tidying.* A block stays where it was inserted, so a bucket that was full when a block
passed it keeps a positive count after its own slots empty, until that block goes: under
churn (every block replaced once per capacity of inserts) half the buckets end up
"passed" and a miss reads ~2.8 buckets instead of ~1.3. So every append also sweeps the
next ``TIDY_SLOTS`` slots per block it inserted (a cursor per row, wrapping around) and
re-inserts the blocks found there away from their home bucket, which puts them back home
whenever their home has room again: a miss then reads ~1.5 buckets (the longest run of
passed buckets 21 at 94k blocks, against 23 for the tombstone table before its rehash),
and a call moves at most ``TIDY_SLOTS`` slots per block it inserts (``moved``).

Bytes per held (block, replica): ``4 / TABLE_LOAD`` (table, 5.7) + ``0.5 / TABLE_LOAD``
(over, 0.7) + ``9 * LOG_SLACK`` (log + alive, 11.3), ~18 B: 512 replicas x 93,750 blocks
(2M device + 4M host tokens of 64-token blocks) are ~0.8 GB. The arrays are created with
``np.zeros`` (0 = empty), so pages a row never touched cost nothing.

Compaction. When a row's log is full its live positions are packed to the front in order
(``alive`` compress) and the table's values renumbered through the running count of live
positions: a few vectorized passes over the row (~3.4 ms at 94k blocks), every
``(LOG_SLACK - 1) x capacity`` appended positions: the longest pause left, once per call at
most. A delete empties its slot and takes one off the counts of the buckets its block's
probe passed; an insert takes the first empty slot from its home and adds one to the
buckets it passes. Each call writes one slot per block it inserts, moves or deletes
(``slot_writes``) and nothing else of the table but a compaction's renumbering
(``renumbered``): an earlier version rehashed a row once deleted slots passed 80% of it
(~50 ms at 94k blocks).

Every per-block step is a numpy operation over all the blocks (and rows) of one call:
``find`` probes a batch of (row, hash) pairs at once, one round per bucket step, until
``SCALAR_TAIL`` walks are left, which go on one by one in plain Python (a few microseconds
each, where a round costs ~20 numpy calls); ``position1`` is that probe for one pair
(inserts finish their last few the same way).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

BUCKET = 8  # slots a probe reads at once (one vectorized step per bucket, not per slot)
TABLE_LOAD = 0.7  # live blocks / table slots at full capacity
LOG_SLACK = 1.25  # log positions per block of capacity: compaction every 0.25 x capacity appends
TIDY_SLOTS = 4  # table slots an append sweeps (re-placing displaced blocks) per block it inserts
SCALAR_TAIL = 32  # probes (and inserts) still walking when this few are left go on one by one
EMPTY = 0
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads sequential test hashes too
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)  # another odd constant: the fingerprint's bits
_U32 = np.uint64(32)
_MIX_INT, _MIX2_INT = int(_MIX), int(_MIX2)

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def as_hashes(hashes: Sequence[int] | U64) -> U64:
    """A hash sequence as a uint64 array (through ``array("Q")``: ~1.5x faster than
    ``np.asarray`` on Python ints, which must handle those above 2**63 one by one)."""
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64, copy=False).reshape(-1)
    return np.frombuffer(array("Q", hashes), dtype=np.uint64)


class RowStore:
    """Rows of (log, alive, table); see the module docstring. Positions are per row."""

    def __init__(self, capacity_blocks: int, rows: int = 8) -> None:
        self.cap = max(int(capacity_blocks), 1)
        self.S = max(int(self.cap / TABLE_LOAD / BUCKET) + 1, 2) * BUCKET
        self.L = max(int(self.cap * LOG_SLACK) + 1, self.cap + 2)
        self.pos_bits = int(self.L).bit_length()  # p + 1 <= L < 2**pos_bits
        self.fp_bits = 31 - self.pos_bits
        if self.fp_bits < 4:
            raise ValueError(f"capacity {capacity_blocks} blocks is too large for a 32-bit table slot")
        self.pos_mask = (1 << self.pos_bits) - 1
        self.high = np.int32(-(1 << self.pos_bits))  # the fingerprint bits of a slot value
        self.rows = max(rows, 1)
        self.log: U64 = np.zeros(self.rows * self.L, dtype=np.uint64)
        self.alive = np.zeros(self.rows * self.L, dtype=np.bool_)
        self.table = np.zeros(self.rows * self.S, dtype=np.int32)
        self.over = np.zeros(self.rows * self.S // BUCKET, dtype=np.int32)  # blocks probing past a bucket
        self.head = np.zeros(self.rows, dtype=np.int64)
        self.live = np.zeros(self.rows, dtype=np.int64)
        self.sweep = np.zeros(self.rows, dtype=np.int64)  # the next bucket tidying looks at
        # work counters (tests bound the work of one call with them): table slots written
        # for the blocks of a call (of them emptied by deletes), slots moved by tidying,
        # slots renumbered by compactions, buckets read by probes
        self.slot_writes = self.emptied = self.moved = self.renumbered = self.bucket_reads = 0

    # -- shape -------------------------------------------------------------------
    def add_rows(self, rows: int) -> None:
        """Grow to at least ``rows`` rows (doubling), keeping every row's content."""
        if rows <= self.rows:
            return
        new = max(rows, 2 * self.rows)
        for name, per_row in (("log", self.L), ("alive", self.L), ("table", self.S), ("over", self.S // BUCKET),
                              ("head", 1), ("live", 1), ("sweep", 1)):
            old = getattr(self, name)
            grown = np.zeros(new * per_row, dtype=old.dtype)  # the new rows' pages stay untouched
            grown[:old.size] = old
            setattr(self, name, grown)
        self.rows = new

    def reshaped(self, capacity_blocks: int) -> RowStore:
        """A store sized for ``capacity_blocks`` holding every row's live blocks, in order."""
        out = RowStore(capacity_blocks, self.rows)
        for r in range(self.rows):
            keys = self.recency(r)
            if keys.size:
                out.append(r, keys[: out.cap][::-1])  # oldest first; at most the new capacity
        return out

    # -- reads -------------------------------------------------------------------
    def find(self, rows: I64, keys: U64) -> I64:
        """Global table index of each (row, key) pair, -1 when absent (vectorized probe:
        one step reads a whole bucket per pair; a bucket no block probes past ends a miss)."""
        n = keys.size
        out = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return out
        nb = self.S // BUCKET
        buckets = self.table.reshape(-1, BUCKET)  # a view: one row per bucket
        flat_log = self.log
        bucket, fps = self._home(keys), self._fingerprint(keys) << self.pos_bits
        first, lbase = rows * nb, rows * self.L
        active = np.arange(n)
        while active.size > SCALAR_TAIL:  # the long tail of a few walks: one by one, below
            self.bucket_reads += active.size
            g = first[active] + bucket[active]  # global bucket index
            v = np.take(buckets, g, axis=0)  # [m, BUCKET]: 32 contiguous bytes per pair
            idx = np.flatnonzero((v & self.high) == fps[active][:, None])  # fingerprint agrees
            ci = idx // BUCKET
            ok = flat_log[lbase[active[ci]] + (v.reshape(-1)[idx] & self.pos_mask) - 1] == keys[active[ci]]
            ci, cj = ci[ok], idx[ok] % BUCKET  # ... and so does the hash
            out[active[ci]] = g[ci] * BUCKET + cj
            found = np.zeros(active.size, dtype=np.bool_)
            found[ci] = True
            go = ~found & (self.over[g] > 0)  # no block probed past this bucket: a miss
            active = active[go]
            nxt = bucket[active] + 1
            nxt[nxt == nb] = 0
            bucket[active] = nxt
        for i in active.tolist():
            out[i] = self._slot1(int(rows[i]), int(keys[i]), int(bucket[i]), int(fps[i]))
        return out

    def positions(self, rows: I64, keys: U64) -> I64:
        """Log position of each (row, key), -1 when absent."""
        t = self.find(rows, keys)
        pos = np.full(t.size, -1, dtype=np.int64)
        held = t >= 0
        pos[held] = self._pos(self.table[t[held]])
        return pos

    def position1(self, r: int, key: int) -> int:
        """``positions`` of one (row, key) in plain Python (a numpy call costs more than
        the probe): the log position, -1 when absent."""
        nb, mask64 = self.S // BUCKET, (1 << 64) - 1
        b = ((((key * _MIX_INT) & mask64) >> 32) * nb) >> 32
        raw = ((key * _MIX2_INT) & mask64) >> (64 - self.fp_bits)
        fp = (raw % ((1 << self.fp_bits) - 2) + 1) << self.pos_bits
        t = self._slot1(r, key, b, fp)
        return -1 if t < 0 else (int(self.table[t]) & self.pos_mask) - 1

    def _slot1(self, r: int, key: int, b: int, fp: int) -> int:
        """The global table index of ``key`` on row ``r`` probing from row-local bucket ``b``
        (``fp``: its fingerprint, shifted), -1 when absent: plain Python, for few probes."""
        nb, high, pmask = self.S // BUCKET, int(self.high), self.pos_mask
        lbase, first = r * self.L, r * nb
        table, log, over = self.table, self.log, self.over
        for _ in range(nb):
            g = first + b
            self.bucket_reads += 1
            for j, v in enumerate(table[g * BUCKET:(g + 1) * BUCKET].tolist()):
                if v & high == fp and int(log[lbase + (v & pmask) - 1]) == key:
                    return g * BUCKET + j
            if over[g] == 0:
                return -1
            b = b + 1 if b + 1 < nb else 0
        return -1

    def oldest_live(self, r: int, m: int) -> I64:
        """Row ``r``'s ``m`` oldest live positions (scanning from the oldest end only)."""
        base, head = r * self.L, int(self.head[r])
        parts: list[I64] = []
        start, chunk, count = 0, max(4096, 2 * m), 0
        while start < head and count < m:
            stop = min(head, start + chunk)
            idx = np.flatnonzero(self.alive[base + start:base + stop]) + start
            parts.append(idx)
            count += idx.size
            start, chunk = stop, 2 * chunk
        return np.concatenate(parts)[:m] if parts else np.zeros(0, dtype=np.int64)

    def live_positions(self, r: int) -> I64:
        """Row ``r``'s live positions, oldest first."""
        start = r * self.L
        return np.flatnonzero(self.alive[start:start + int(self.head[r])])

    def recency(self, r: int) -> U64:
        """Row ``r``'s blocks, most recent first."""
        start = r * self.L
        return self.log[start + self.live_positions(r)][::-1]

    # -- writes ------------------------------------------------------------------
    def delete(self, r: int, keys: U64) -> None:
        """Forget these distinct blocks of row ``r`` (absent ones are ignored)."""
        t = self.find(np.full(keys.size, r, dtype=np.int64), keys)
        held = t >= 0
        t = t[held]
        if t.size:
            pos = self._pos(self.table[t])
            self.alive[r * self.L + pos] = False
            self.table[t] = EMPTY
            self.slot_writes += t.size
            self.emptied += t.size
            self.live[r] -= t.size
            self._passed(r, keys[held], t // BUCKET - r * (self.S // BUCKET), -1)

    def append(self, r: int, keys: U64, found: I64 | None = None) -> None:
        """Write ``keys`` (distinct) at the MRU end of row ``r``, the last one most recent;
        a block already held moves (its old position becomes a hole). The caller keeps
        the row within capacity (``live + new <= cap``). ``found``: ``find`` of these
        keys on this row, when the caller has it (valid until one of them is deleted or the
        next append: deletes move no other slot, appends tidy)."""
        n = keys.size
        if n == 0:
            return
        base = r * self.L
        t = self.find(np.full(n, r, dtype=np.int64), keys) if found is None else found
        held = t >= 0
        th = t[held]
        self.alive[base + self._pos(self.table[th])] = False  # moved: a hole
        if int(self.head[r]) + n > self.L:
            self.compact(r)  # renumbers the moved blocks too: overwritten just below
        pos = int(self.head[r]) + np.arange(n, dtype=np.int64)
        self.table[th] = self._value(keys[held], pos[held])
        self.slot_writes += th.size
        self._insert(r, keys[~held], pos[~held])
        self.log[base + pos] = keys
        self.alive[base + pos] = True
        self.head[r] += n
        self.live[r] += n - th.size
        self._tidy(r, -(-TIDY_SLOTS * (n - th.size) // BUCKET))

    def compact(self, r: int) -> None:
        """Pack row ``r``'s live positions to the front, in order; renumber the table."""
        base, head = r * self.L, int(self.head[r])
        alive = self.alive[base:base + head]
        # new position + 1 of each old position + 1; index 0 (empty slots) -> 0
        rank = np.zeros(head + 1, dtype=np.int32)
        np.cumsum(alive, dtype=np.int32, out=rank[1:])
        live = np.flatnonzero(alive)
        n = live.size
        self.log[base:base + n] = self.log[base + live]
        alive[:] = False
        alive[:n] = True
        row = self.table[r * self.S:(r + 1) * self.S]
        row[:] = (row & self.high) | rank[row & self.pos_mask]
        self.renumbered += row.size
        self.head[r] = n

    def clear(self, r: int) -> None:
        self.log[r * self.L:(r + 1) * self.L] = 0
        self.alive[r * self.L:(r + 1) * self.L] = False
        self.table[r * self.S:(r + 1) * self.S] = EMPTY
        self.over[r * self.S // BUCKET:(r + 1) * self.S // BUCKET] = 0
        self.head[r] = self.live[r] = self.sweep[r] = 0

    # -- internals -----------------------------------------------------------------
    def _fingerprint(self, keys: U64) -> npt.NDArray[np.int32]:
        """A fingerprint of each key in [1, 2**fp_bits - 2] (other bits than the home
        bucket's): 0 is an empty slot's, so it never agrees (all ones is not used either)."""
        raw = (keys * _MIX2) >> np.uint64(64 - self.fp_bits)
        return (raw % np.uint64((1 << self.fp_bits) - 2) + np.uint64(1)).astype(np.int32)

    def _value(self, keys: U64, pos: I64) -> npt.NDArray[np.int32]:
        """The slot value of keys at log positions ``pos``."""
        return (self._fingerprint(keys) << self.pos_bits) | (pos + 1).astype(np.int32)

    def _pos(self, values: npt.NDArray[np.int32]) -> I64:
        """Log positions of (live) slot values."""
        return (values & self.pos_mask).astype(np.int64) - 1

    def _home(self, keys: U64) -> I64:
        """Home bucket of each key."""
        mixed = (keys * _MIX) >> _U32
        return ((mixed * np.uint64(self.S // BUCKET)) >> _U32).astype(np.int64)

    def _insert(self, r: int, keys: U64, pos: I64) -> None:
        """Insert absent, distinct keys of row ``r`` with their log positions: each takes an
        empty slot of the first bucket from its home that has one, and counts itself in
        ``over`` of every bucket it passes; keys meeting in one bucket take its empty slots
        in turn (rank within the bucket)."""
        if keys.size == 0:
            return
        tbase, nb = r * self.S, self.S // BUCKET
        cols = np.arange(BUCKET, dtype=np.int64)
        bucket, values = self._home(keys), self._value(keys, pos)
        pending = np.arange(keys.size)
        while pending.size > SCALAR_TAIL:
            pending = pending[np.argsort(bucket[pending], kind="stable")]
            b = bucket[pending]
            starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
            rank = np.arange(b.size) - np.repeat(starts, np.diff(np.r_[starts, b.size]))
            t = (tbase + b * BUCKET)[:, None] + cols
            free = self.table[t] == EMPTY
            take = free & (np.cumsum(free, axis=1) == (rank + 1)[:, None])
            ok = take.any(axis=1)
            slots = t[ok, take[ok].argmax(axis=1)]
            self.table[slots] = values[pending[ok]]
            self.slot_writes += slots.size
            pending = pending[~ok]
            np.add.at(self.over, r * nb + bucket[pending], 1)  # these go on past their bucket
            nxt = bucket[pending] + 1
            nxt[nxt == nb] = 0
            bucket[pending] = nxt
        table, over = self.table, self.over
        for i in pending.tolist():  # the last few, one by one
            g = r * nb + int(bucket[i])
            while EMPTY not in (row := table[g * BUCKET:(g + 1) * BUCKET].tolist()):
                over[g] += 1
                g = g + 1 if g + 1 < (r + 1) * nb else r * nb
            table[g * BUCKET + row.index(EMPTY)] = values[i]
            self.slot_writes += 1

    def _passed(self, r: int, keys: U64, at: I64, delta: int) -> None:
        """Add ``delta`` to ``over`` of the buckets each key's probe passes on row ``r``, from
        its home bucket to the one before ``at`` (its bucket, row-local), wrapping around."""
        nb = self.S // BUCKET
        home = self._home(keys)
        steps = (at - home) % nb
        total = int(steps.sum())
        if total == 0:
            return
        offset = np.arange(total) - np.repeat(np.cumsum(steps) - steps, steps)
        np.add.at(self.over, r * nb + (np.repeat(home, steps) + offset) % nb, delta)

    def _tidy(self, r: int, buckets: int) -> None:
        """Re-insert the displaced blocks (not in their home bucket) of the next ``buckets``
        buckets of row ``r``: each goes to the first bucket from its home with an empty
        slot, which is where it was or closer to home."""
        nb = self.S // BUCKET
        k = min(buckets, nb)
        if k <= 0:
            return
        start = int(self.sweep[r])
        self.sweep[r] = (start + k) % nb
        local = (start + np.arange(k)) % nb
        t = ((r * self.S + local * BUCKET)[:, None] + np.arange(BUCKET)).reshape(-1)
        v = self.table[t]
        held = v != EMPTY
        t, v = t[held], v[held]
        pos = self._pos(v)
        keys = self.log[r * self.L + pos]
        at = t // BUCKET - r * nb
        away = self._home(keys) != at
        if not away.any():
            return
        self.table[t[away]] = EMPTY
        self._passed(r, keys[away], at[away], -1)
        writes = self.slot_writes
        self._insert(r, keys[away], pos[away])
        self.slot_writes = writes  # moves are counted apart: ``moved``
        self.moved += int(away.sum())
