"""Precise mode: what each replica holds, per medium, exactly as its KV events say.

Where the approximate index (``memory.py``, ``redis_backend.py``) *predicts* a replica's
cache from the gateway's own decisions, this one is *told*: SGLang publishes every page
its radix cache stores (``BlockStored``), evicts (``BlockRemoved``) or flushes
(``AllBlocksCleared``), per medium (``GPU`` = device, ``CPU_PINNED`` = HiCache host; the
storage tiers ``DISK``/``EXTERNAL`` count as host here: a load, not a recompute). Keys are
SGLang's own chained page hashes (``gateway.sglang_pages``), so a request hashed from its
token ids matches page for page.

Layout, so that a lookup costs the same for 8 replicas as for 512: one dict per tier
mapping a page hash to a bitmask of the replicas holding it (bit = the replica's slot).
``match`` walks the request's hashes once from the end, collecting the replicas found;
it stops when every replica asked for has been found. Pages are prefix-closed in the
radix tree (per tier), so a replica's device match ends at the deepest page on its GPU,
and its host match at the deepest page on GPU or host: a page stored before the gateway
subscribed (which it never saw) does not cut a match short.

A replica whose stream lost batches that could not be replayed is *uncertain* until it
is cleared or rebuilt (``uncertain``): the caller decides how much to trust it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefix_index.base import PrefixMatch, ReplicaId

DEVICE_MEDIA = frozenset({"GPU"})


def to_prefix_match(pages_device: int, pages_host: int, page_size: int, block_tokens: int = 1) -> PrefixMatch:
    """A precise match (``EventBlockIndex.match``: leading pages on device, then on host)
    in blocks of ``block_tokens`` tokens, rounded down per cumulative tier.

    ``block_tokens=1`` (the default) gives tokens: ``PrefixMatch(device_tokens, host_tokens)``,
    the unit of ``policies.routing.merge_matches``/``token_context``. With the request's
    ``ctx.block_tokens`` it gives block-equivalents for a policy in approximate units
    (up to one block of the match is then lost to rounding).
    """
    unit = max(block_tokens, 1)
    device_tokens = max(pages_device, 0) * page_size
    total_tokens = device_tokens + max(pages_host, 0) * page_size
    device = device_tokens // unit
    return PrefixMatch(device, total_tokens // unit - device)


class EventBlockIndex:
    def __init__(self) -> None:
        self._slots: dict[ReplicaId, int] = {}
        self._free: list[int] = []
        self._device: dict[int, int] = {}
        self._host: dict[int, int] = {}
        self._held: dict[ReplicaId, tuple[set[int], set[int]]] = {}  # device, host hashes
        self.uncertain: set[ReplicaId] = set()

    # ---------------------------------------------------------------- membership
    def _slot(self, replica: ReplicaId) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[replica] = slot
            self._held[replica] = (set(), set())
        return slot

    def replicas(self) -> list[ReplicaId]:
        return list(self._slots)

    def blocks(self, replica: ReplicaId) -> tuple[int, int]:
        """(device, host) pages the replica holds."""
        device, host = self._held.get(replica, (set(), set()))
        return len(device), len(host)

    # ---------------------------------------------------------------- events
    def stored(self, replica: ReplicaId, hashes: Iterable[int], medium: str) -> None:
        bit = 1 << self._slot(replica)
        device = medium in DEVICE_MEDIA
        table = self._device if device else self._host
        held = self._held[replica][0 if device else 1]
        for h in hashes:
            table[h] = table.get(h, 0) | bit
            held.add(h)

    def removed(self, replica: ReplicaId, hashes: Iterable[int], medium: str) -> None:
        slot = self._slots.get(replica)
        if slot is None:
            return
        device = medium in DEVICE_MEDIA
        self._drop_bits(self._device if device else self._host, hashes, ~(1 << slot),
                        self._held[replica][0 if device else 1])

    @staticmethod
    def _drop_bits(table: dict[int, int], hashes: Iterable[int], keep: int, held: set[int]) -> None:
        for h in hashes:
            mask = table.get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                table[h] = mask
            else:
                del table[h]
            held.discard(h)

    def cleared(self, replica: ReplicaId) -> None:
        """Everything the replica held is gone (AllBlocksCleared, a restart)."""
        slot = self._slots.get(replica)
        if slot is None:
            return
        device, host = self._held[replica]
        keep = ~(1 << slot)
        self._drop_bits(self._device, list(device), keep, device)
        self._drop_bits(self._host, list(host), keep, host)
        self.uncertain.discard(replica)

    def drop(self, replica: ReplicaId) -> None:
        """The replica left the fleet: its entries and its slot go."""
        if replica not in self._slots:
            return
        self.cleared(replica)
        self._free.append(self._slots.pop(replica))
        del self._held[replica]

    # ---------------------------------------------------------------- lookup
    def match(self, hashes: Sequence[int], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Per replica, how many leading hashes it holds on device, then on device or host.

        A replica's cache is a radix tree, prefix-closed per tier (a page on device has its
        parents on device; the host tier likewise), so the match is the *deepest* page it
        holds: a page stored before this gateway subscribed (a shared first page, stored
        once long ago) does not hide the pages stored after it.
        """
        slots = {self._slots[r]: r for r in replicas if r in self._slots}
        device_depth = _deepest(hashes, slots, (self._device,))
        any_depth = _deepest(hashes, slots, (self._device, self._host)) if self._host else device_depth
        out = {r: PrefixMatch() for r in replicas}
        for slot, replica in slots.items():
            dev = device_depth[slot]
            out[replica] = PrefixMatch(dev, max(any_depth[slot] - dev, 0))
        return out


def _deepest(hashes: Sequence[int], slots: dict[int, ReplicaId], tables: tuple[dict[int, int], ...]) -> dict[int, int]:
    """For each slot, 1 + the index of the last hash whose mask (OR over ``tables``) has its bit (0: none)."""
    want = 0
    for slot in slots:
        want |= 1 << slot
    depth = dict.fromkeys(slots, 0)
    found = 0
    first = tables[0].get
    rest = [t.get for t in tables[1:]]
    i = len(hashes)
    for h in reversed(hashes):  # the hot loop: one dict lookup per page while nothing is found
        mask = first(h, 0)
        if rest:
            for get in rest:
                mask |= get(h, 0)
        if mask and mask & want & ~found:
            new = mask & want & ~found
            found |= new
            while new:
                low = new & -new
                depth[low.bit_length() - 1] = i
                new ^= low
            if found == want:
                break
        i -= 1
    return depth
