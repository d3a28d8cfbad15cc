"""A bounded cache of where earlier request bodies' conversations ended (issue 15).

A coding agent's turn N+1 re-sends turn N's messages and adds a few. ``gateway.context``
parses, validates, renders and hashes a whole body; with this cache a later turn costs
only its new part (``gateway.context_turns`` does the work, this module keeps the state).

**What is kept.** For a request body, one ``Entry``: the byte offset ``start`` of its
first message (``messages``, or Responses' ``input`` items) in the body, its whole block
chain, and for each of its last ``BOUNDARIES`` messages a ``Boundary``: the byte offset
``end`` just after that message's JSON, the digest of ``body[start:end]`` (xxh3-128 with
this cache's random seed) and a copy of its last ``FINGERPRINT`` bytes, and the state of
the rendering at that point (bytes and characters rendered so far, the bytes after the
last hashed block, the Responses turn left open). The last few messages, not only the
last: Claude Code moves its ``cache_control`` marker to the newest message each turn, so
the previous turn's last message is re-sent with different bytes and the longest reusable
boundary is usually the one before it.

**Finding an entry.** Entries live under a *key* (``gateway.context`` builds it: the
endpoint and the conversation's session header, else a digest of the body's first 512
bytes), at most ``PER_KEY`` per key, most recent first. ``find`` tries each entry's
boundaries from the last: a boundary matches a new body when the fingerprint equals the
new body's bytes before ``end`` and the digest of ``body[start:end]`` equals the stored
one, i.e. the new body has, byte for byte, the same messages at the same place. Cost: one
xxh3 pass over the matched bytes (~20 us for 400 KB), no JSON parse.

**Bounds.** At most ``max_entries`` entries and ``max_bytes`` estimated bytes
(``Entry.size``: 8 bytes per block hash, kept in an ``array('Q')`` rather than a tuple:
a tuple's 1,600 int objects of a 400 KB body, scattered in memory, cost more to slice
and copy on a hit than making new ones from contiguous memory; plus the boundaries'
bytes and a fixed overhead); the least recently used key loses its oldest entry first. An entry larger than
``max_bytes`` is not kept. 0 in either disables the cache (``HashingConfig``).
"""
from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import xxhash

BOUNDARIES = 8  # message boundaries kept per entry (the last ones)
PER_KEY = 8  # entries kept per key (conversations that share a session header or a first 512 bytes)
FINGERPRINT = 32  # bytes before a boundary compared before hashing the whole prefix
_HASH_BYTES = 8  # per block hash, in an array('Q')
_BOUNDARY_BYTES = 200  # per boundary: the object, its ints, the fingerprint and tail objects
_ENTRY_BYTES = 300  # per entry: the objects, the tuple header, the key's list slot


@dataclass(frozen=True, slots=True)
class Boundary:
    """The state after message ``count - 1`` of a cached body."""

    end: int  # byte offset just after the message's JSON value
    digest: int  # xxh3-128 (the cache's seed) of body[entry.start:end]
    fingerprint: bytes  # body[max(entry.start, end - FINGERPRINT):end]
    count: int  # messages up to here
    rendered: int  # bytes of the canonical rendering so far (head + these messages)
    chars: int  # characters of it
    tail: bytes  # its bytes after the last hashed block (b"" once max_blocks are hashed)
    open_role: str | None  # Responses: the turn the last item left open

    def blocks(self, block_bytes: int, max_blocks: int) -> int:
        """How many of the entry's hashes the rendering so far covers."""
        return min(self.rendered // block_bytes, max_blocks)


@dataclass(frozen=True, slots=True)
class Outer:
    """What the bytes around a cached body's message list parse to, for a later body with
    the same bytes there (``gateway.context_turns``: then only the new messages are parsed)."""

    suffix: int  # bytes from the list's closing "]" to the body's end
    digest: int  # xxh3-128 (the cache's seed) of body[:entry.start] + body[-suffix:]
    model: str
    max_tokens: int | None
    stream: bool
    session_field: Any  # the body's own session key (``gateway.api_agents.session_field``)


@dataclass(frozen=True, slots=True)
class Entry:
    head_id: int  # digest of (endpoint, model, block settings, the rendering before the messages)
    start: int  # byte offset of the first message's JSON value
    hashes: array[int]  # the body's whole chain ('Q': 8 bytes a hash); a boundary's is a prefix of it
    boundaries: tuple[Boundary, ...]  # ascending ``end``; at most BOUNDARIES
    outer: Outer | None = None  # None: the list's place is not known exactly (or Responses)
    size: int = 0  # estimated bytes held (see the module docstring); ``make`` computes it

    @classmethod
    def make(cls, head_id: int, start: int, hashes: array[int], boundaries: tuple[Boundary, ...],
             outer: Outer | None) -> Entry:
        size = (_ENTRY_BYTES + _HASH_BYTES * len(hashes)
                + sum(_BOUNDARY_BYTES + len(b.fingerprint) + len(b.tail) for b in boundaries))
        if outer is not None:
            size += _BOUNDARY_BYTES + len(outer.model) + len(outer.session_field or "")
        return cls(head_id, start, hashes, boundaries, outer, size)


@dataclass(frozen=True, slots=True)
class Hit:
    entry: Entry
    boundary: Boundary
    hasher: xxhash.xxh3_128  # fed body[entry.start:boundary.end]: continue it with the new messages


class ContextCache:
    """Entries under keys, LRU by key, bounded by entries and estimated bytes."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.seed = int.from_bytes(os.urandom(8), "little")
        # a placeholder for the cached messages in a body's skeleton (gateway.context_turns):
        # a JSON integer has one spelling, so counting it in the skeleton's bytes is exact
        self.nonce = str(10 ** 17 + int.from_bytes(os.urandom(8), "little") % (8 * 10 ** 17)).encode()
        self._keys: OrderedDict[Hashable, list[Entry]] = OrderedDict()
        self.entries = 0
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def hasher(self) -> xxhash.xxh3_128:
        return xxhash.xxh3_128(seed=self.seed)

    def find(self, key: Hashable, body: bytes) -> Hit | None:
        """The entry and boundary under ``key`` whose messages ``body`` repeats, the longest first."""
        entries = self._keys.get(key)
        if entries:
            view = memoryview(body)
            for entry in entries:
                for b in reversed(entry.boundaries):
                    if b.end > len(body) or body[b.end - len(b.fingerprint):b.end] != b.fingerprint:
                        continue
                    h = self.hasher()
                    h.update(view[entry.start:b.end])
                    if h.intdigest() == b.digest:
                        self._keys.move_to_end(key)
                        self.hits += 1
                        return Hit(entry, b, h)
        self.misses += 1
        return None

    def record(self, key: Hashable, entry: Entry, replaces: Entry | None = None) -> None:
        """Keep ``entry`` first under ``key`` (instead of ``replaces``), then evict to the bounds."""
        entries = self._keys.pop(key, [])
        if replaces is not None and any(e is replaces for e in entries):
            entries = [e for e in entries if e is not replaces]
            self._forget(replaces)
        size = entry.size
        if size <= self.max_bytes:
            entries.insert(0, entry)
            self.entries += 1
            self.bytes += size
        for dropped in entries[PER_KEY:]:
            self._forget(dropped)
        if entries:
            self._keys[key] = entries[:PER_KEY]
        while self.entries > self.max_entries or self.bytes > self.max_bytes:
            oldest, lst = next(iter(self._keys.items()))
            self._forget(lst.pop())
            if not lst:
                del self._keys[oldest]

    def _forget(self, entry: Entry) -> None:
        self.entries -= 1
        self.bytes -= entry.size

    def __len__(self) -> int:
        return self.entries


class CacheSlot:
    """Where a ``gateway.context.HashingConfig`` keeps its ``ContextCache``: created on
    first use, rebuilt when the budget changes, equal to every other slot and neither
    copied nor pickled (a copied or compared configuration is the same configuration;
    the cache is process state).
    ``build_context`` reaches the cache through the settings it is given, so the
    gateway's callers need no change."""

    __slots__ = ("cache",)

    def __init__(self) -> None:
        self.cache: ContextCache | None = None

    def get(self, entries: int, max_bytes: int) -> ContextCache | None:
        if entries <= 0 or max_bytes <= 0:
            return None
        cache = self.cache
        if cache is None or (cache.max_entries, cache.max_bytes) != (entries, max_bytes):
            cache = self.cache = ContextCache(entries, max_bytes)
        return cache

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheSlot)

    __hash__ = None  # type: ignore[assignment]

    def __copy__(self) -> CacheSlot:
        return CacheSlot()

    def __deepcopy__(self, memo: dict[int, Any]) -> CacheSlot:
        return CacheSlot()

    def __reduce__(self) -> tuple[type[CacheSlot], tuple[()]]:  # a pickled configuration: an empty slot
        return CacheSlot, ()
