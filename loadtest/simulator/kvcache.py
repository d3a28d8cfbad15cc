"""Paged prefix cache of the simulated replica: device pool + HiCache host pool.

Only page identities are stored, never KV values or token ids. A page is ``page_size``
tokens; its id is a chained hash ``h_k = xxh3_64(page_k bytes, seed=h_{k-1})`` with
``h_{-1} = ROOT_SEED``, so equal ids mean an equal page AND an equal prefix before it, and a
prompt's cached prefix is the longest run of its leading page ids present in the cache.
Trailing partial pages are never cached (SGLang's paged radix keys are page-aligned).

Tiers and accounting (tokens, always whole pages for cached content):

* device: ``pinned`` pages (on the path of a running request, never evicted) +
  ``evictable`` pages + ``private`` tokens (KV a running request holds that is not, or not
  yet, a shared page: uncomputed prompt, output, a partial last page).
  ``pinned + evictable + private <= device_tokens``.
* host (HiCache): an LRU of pages evicted from the device. A host hit is loaded back
  to the device (the engine charges ``host_load_tokens_per_s``). Eviction runs
  device -> host -> dropped. The tiers are exclusive (a page lives in one of them); SGLang's
  write-through policy also keeps host copies of device pages, which this model folds into
  "the host pool holds what the device no longer does" (see README.md).

Speed: per page there are only C loops (``dict.update`` over ``zip``); everything else is
a binary search, so a 100k-token request costs a fraction of a millisecond. Each device
page carries a recency stamp; a pinned page carries the stamp ``PINNED`` (never the
oldest). The cache keeps the pinned path (a list of page ids) of every running request:
chained ids make "page k of two paths is equal" imply "their first k pages are equal", so
the pages of a path that other running requests also pin are a prefix whose length is a
binary search per running request. Releasing a path stamps its no-longer-pinned pages leaf
first, so a parent is always more recent than its children and the radix-tree rule "evict
leaves first" holds; along any path the device pages and the cached pages each form a
prefix too, so a lookup is a binary search. Eviction takes the oldest unpinned pages from
a first-in-first-out queue of (stamp, page) entries appended in stamp order on release, an
entry being stale when its page has since been re-stamped, pinned or evicted (lazy
deletion; the queue is rebuilt when stale entries outnumber live pages), so evicting k
pages costs O(k).

Events (``observer``, None by default: then no extra work): an attached
``CacheObserver`` (``kv_publisher.KvEventRecorder``) is told every page move in the
cache's ids: stored / removed per medium (``GPU`` = device, ``CPU_PINNED`` = host),
``forget`` when a page leaves both tiers, ``cleared`` on a flush. An eviction to the host
is removed GPU + stored CPU_PINNED; a load-back (admission of a host hit, or a commit of a
page found on the host) is removed CPU_PINNED + stored GPU.

The index costs ~140 bytes per page (measured by ``loadtest/bench_simulator_memory.py``):
6M tokens of content = 93,720 pages of 64 tokens ~= 13 MB.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import eq
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from prefix_index.base import common_chain_prefix
from replicas.kv_events import CPU_PINNED, GPU

ROOT_SEED = 0
PINNED = 1 << 62  # the stamp of a pinned page
_hash = xxhash.xxh3_64_intdigest


class CacheObserver(Protocol):
    """Told every page move of a ``PagedPrefixCache`` (pages are the cache's ids)."""

    def stored(self, pages: Sequence[int], medium: str) -> None: ...

    def removed(self, pages: Sequence[int], medium: str) -> None: ...

    def forget(self, pages: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


@dataclass(frozen=True)
class CacheMatch:
    """The cached prefix of a prompt: leading pages on the device, then on the host."""

    device_pages: int
    host_pages: int
    page_size: int

    @property
    def pages(self) -> int:
        return self.device_pages + self.host_pages

    @property
    def device_tokens(self) -> int:
        return self.device_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


def page_hashes(ids: npt.NDArray[Any], page_size: int, parent: int = ROOT_SEED) -> list[int]:
    """Chained hashes of the full pages of ``ids`` (uint32), continuing from ``parent``."""
    data = np.ascontiguousarray(ids, dtype=np.uint32).data.cast("B")  # no copy
    step = page_size * 4
    out: list[int] = []
    append = out.append
    h = parent
    for start in range(0, (len(data) // step) * step, step):
        h = _hash(data[start : start + step], h)
        append(h)
    return out


def _prefix_run(
    hashes: Sequence[int], limit: int, present: Callable[[int], bool], start: int = 0
) -> int:
    """Length of the leading run of ``hashes[:limit]`` satisfying a prefix-closed predicate
    (a binary search for the first hash without it)."""
    return bisect_left(hashes, True, start, limit, key=lambda h: not present(h))


class _Pool:
    """Pages with recency stamps, and a lazy-deletion FIFO giving the oldest first.

    The FIFO is a deque of chunks ``(pages, stamps)`` appended in stamp order (one chunk
    per release: no per-page work to queue); an entry is stale when its page has since been
    re-stamped, pinned or removed. When stale entries outnumber live pages the FIFO is
    rebuilt from the stamps (one numpy sort).
    """

    def __init__(self) -> None:
        self.stamps: dict[int, int] = {}  # page -> stamp (PINNED: not evictable)
        self._chunks: deque[tuple[Sequence[int], Sequence[int]]] = deque()
        self._cursor = 0  # entries of the first chunk already consumed
        self._queued = 0

    def __len__(self) -> int:
        return len(self.stamps)

    def __contains__(self, h: object) -> bool:
        return h in self.stamps

    def add(self, pages: Sequence[int], stamps: Sequence[int]) -> None:
        """Stamp pages (stamps increasing and newer than any before) and queue them."""
        self.stamps.update(zip(pages, stamps))
        self._chunks.append((pages, stamps))
        self._queued += len(pages)
        if self._queued > 4 * len(self.stamps) + 4096:
            self._rebuild()

    def _rebuild(self) -> None:
        n = len(self.stamps)
        keys = np.fromiter(self.stamps.keys(), dtype=np.uint64, count=n)
        stamps = np.fromiter(self.stamps.values(), dtype=np.int64, count=n)
        order = np.argsort(stamps, kind="stable")
        order = order[stamps[order] < PINNED]
        self._chunks = deque([(keys[order].tolist(), stamps[order].tolist())])
        self._cursor, self._queued = 0, len(order)

    def pop_oldest(self, count: int) -> tuple[list[int], list[int]]:
        """Remove up to ``count`` oldest unpinned pages: (pages, their stamps).

        Reads the FIFO in slices of exactly the number still wanted (a slice holds at most
        that many live entries, so nothing is over-read), each checked by C loops. A page
        has at most one live entry (stamps are unique), so the slice's live entries can be
        found before any of them is removed.
        """
        out_pages: list[int] = []
        out_stamps: list[int] = []
        current, chunks = self.stamps, self._chunks
        while len(out_pages) < count and chunks:
            pages, stamps = chunks[0]
            i = self._cursor
            stop = min(len(pages), i + count - len(out_pages))
            seg_pages, seg_stamps = pages[i:stop], stamps[i:stop]
            live = list(map(eq, map(current.get, seg_pages), seg_stamps))
            found = list(itertools.compress(seg_pages, live))
            deque(map(current.__delitem__, found), maxlen=0)
            out_pages += found
            out_stamps += itertools.compress(seg_stamps, live)
            self._queued -= stop - i
            if stop == len(pages):
                chunks.popleft()
                stop = 0
            self._cursor = stop
        return out_pages, out_stamps

    def clear(self) -> None:
        self.stamps.clear()
        self._chunks.clear()
        self._cursor = self._queued = 0


class PagedPrefixCache:
    """The device and host page pools, with LRU eviction and pinning."""

    def __init__(self, page_size: int, device_tokens: int, host_tokens: int) -> None:
        self.page_size = page_size
        self.device_capacity_pages = device_tokens // page_size
        self.host_capacity_pages = host_tokens // page_size
        self._device = _Pool()
        self._host = _Pool()
        self._paths: dict[int, list[int]] = {}  # id(path) -> pinned path of a running request
        self._pinned_pages = 0
        self._next_stamp = 0
        self.private_tokens = 0
        self.evicted_tokens_total = 0  # device -> host (or dropped when no host)
        self.host_dropped_tokens_total = 0
        self.load_back_tokens_total = 0
        self.observer: CacheObserver | None = None

    # -- sizes -------------------------------------------------------------------------
    @property
    def device_total_tokens(self) -> int:
        return self.device_capacity_pages * self.page_size

    @property
    def host_total_tokens(self) -> int:
        return self.host_capacity_pages * self.page_size

    @property
    def pinned_tokens(self) -> int:
        return self._pinned_pages * self.page_size

    @property
    def evictable_tokens(self) -> int:
        return (len(self._device) - self._pinned_pages) * self.page_size

    @property
    def host_used_tokens(self) -> int:
        return len(self._host) * self.page_size

    @property
    def locked_tokens(self) -> int:
        """KV held by running requests (SGLang's num_used_tokens)."""
        return self.pinned_tokens + self.private_tokens

    @property
    def device_used_tokens(self) -> int:
        return len(self._device) * self.page_size + self.private_tokens

    def is_empty(self) -> bool:
        return not (self._device or self._host)

    def is_pinned(self, h: int) -> bool:
        return self._device.stamps.get(h, 0) == PINNED

    def on_device(self, h: int) -> bool:
        return h in self._device

    def on_host(self, h: int) -> bool:
        return h in self._host

    # -- lookups -----------------------------------------------------------------------
    def hashes(self, ids: npt.NDArray[Any], parent: int = ROOT_SEED) -> list[int]:
        return page_hashes(ids, self.page_size, parent)

    def match(self, hashes: Sequence[int], max_pages: int | None = None) -> CacheMatch:
        """Longest cached prefix of ``hashes``: the device run, then the host run."""
        limit = len(hashes) if max_pages is None else min(max_pages, len(hashes))
        device = _prefix_run(hashes, limit, self._device.stamps.__contains__)
        cached = _prefix_run(hashes, limit, self._cached, start=device)
        return CacheMatch(device, cached - device, self.page_size)

    def _cached(self, h: int) -> bool:
        return h in self._device or h in self._host

    def _shared(self, path: Sequence[int], exclude: list[int] | None = None) -> int:
        """How many leading pages of ``path`` other running requests pin."""
        best = 0
        for other in self._paths.values():
            if other is not exclude:
                best = max(best, common_chain_prefix(path, other))
        return best

    # -- admission and release ---------------------------------------------------------
    def try_admit(
        self, hashes: Sequence[int], match: CacheMatch, private_tokens: int
    ) -> list[int] | None:
        """Pin ``hashes[:match.pages]`` (loading host pages back), reserve private tokens.

        Returns the request's pinned path (extend it with ``commit``, end it with
        ``release``), or None, changing nothing, when the device cannot hold it even after
        evicting every evictable page.
        """
        path = list(hashes[: match.pages])
        shared = self._shared(path)
        new_pins = len(path) - shared
        after = (self._pinned_pages + new_pins) * self.page_size + self.private_tokens
        if after + private_tokens > self.device_total_tokens:
            return None
        loaded = path[match.device_pages :]
        deque(map(self._host.stamps.__delitem__, loaded), maxlen=0)
        if self.observer is not None and loaded:
            self.observer.removed(loaded, CPU_PINNED)
            self.observer.stored(loaded, GPU)
        self._device.stamps.update(zip(path[shared:], itertools.repeat(PINNED)))
        self._pinned_pages += new_pins
        self._paths[id(path)] = path
        self.load_back_tokens_total += match.host_tokens
        self.private_tokens += private_tokens
        self._evict_to_fit()
        return path

    def commit(self, path: list[int], hashes: Sequence[int]) -> None:
        """Pages a running request computed extend its path and become shared pages."""
        if not hashes:
            return
        start = len(path)
        path.extend(hashes)
        already = max(0, min(len(path), self._shared(path, exclude=path)) - start)
        self._pinned_pages += len(hashes) - already
        host = self._host.stamps
        on_host = host.keys() & set(hashes)
        for h in on_host:
            del host[h]
        if self.observer is not None:
            self._observe_commit(hashes, on_host)
        self._device.stamps.update(zip(hashes, itertools.repeat(PINNED)))
        self.private_tokens -= len(hashes) * self.page_size
        self._evict_to_fit()

    def _observe_commit(self, hashes: Sequence[int], on_host: set[int]) -> None:
        assert self.observer is not None
        if on_host:
            self.observer.removed([h for h in hashes if h in on_host], CPU_PINNED)
        device = self._device.stamps
        fresh = [h for h in hashes if h not in device]
        if fresh:
            self.observer.stored(fresh, GPU)

    def release(self, path: list[int], private_tokens: int) -> None:
        """A request ends: unpin what no one else pins, stamped leaf first."""
        self.private_tokens -= private_tokens
        del self._paths[id(path)]
        shared = self._shared(path)
        self._pinned_pages -= len(path) - shared
        unpinned = path[shared:]
        unpinned.reverse()  # leaf first: parents get the newer stamps
        self._device.add(unpinned, self._stamps(len(unpinned)))

    def flush(self) -> bool:
        """Drop every page (device and host). False if any request holds KV."""
        if self._paths or self.private_tokens:
            return False
        self._device.clear()
        self._host.clear()
        if self.observer is not None:
            self.observer.cleared()
        return True

    # -- eviction ------------------------------------------------------------------------
    def _stamps(self, count: int) -> range:
        start = self._next_stamp
        self._next_stamp += count
        return range(start, start + count)

    def _evict_to_fit(self) -> None:
        excess = len(self._device) + -(-self.private_tokens // self.page_size)
        excess -= self.device_capacity_pages
        if excess <= 0:
            return
        victims, stamps = self._device.pop_oldest(excess)
        self.evicted_tokens_total += len(victims) * self.page_size
        obs = self.observer
        if obs is not None:
            obs.removed(victims, GPU)
        if self.host_capacity_pages == 0:
            if obs is not None:
                obs.forget(victims)
            return
        overflow = len(self._host) + len(victims) - self.host_capacity_pages
        if overflow > 0:
            dropped, _ = self._host.pop_oldest(overflow)
            self.host_dropped_tokens_total += len(dropped) * self.page_size
            if obs is not None:
                obs.removed(dropped, CPU_PINNED)
                obs.forget(dropped)
            if len(dropped) < overflow:  # more victims than the whole host pool
                cut = overflow - len(dropped)
                if obs is not None:
                    obs.forget(victims[:cut])
                victims, stamps = victims[cut:], stamps[cut:]
                self.host_dropped_tokens_total += cut * self.page_size
        self._host.add(victims, stamps)
        if obs is not None:
            obs.stored(victims, CPU_PINNED)
