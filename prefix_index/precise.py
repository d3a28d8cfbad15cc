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
``match`` walks the request's hashes once, narrowing a mask of replicas still matching;
it stops when no replica matches further. Device pages are prefix-closed in the radix
tree, so a replica's device match is the run of leading hashes on its GPU, and its host
match continues that run over GPU or host pages.

A replica whose stream lost batches that could not be replayed is *uncertain* until it
is cleared or rebuilt (``uncertain``): the caller decides how much to trust it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prefix_index.base import PrefixMatch, ReplicaId

DEVICE_MEDIA = frozenset({"GPU"})


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
        """Per replica, how many leading hashes it holds on device, then on host."""
        slots = {self._slots[r]: r for r in replicas if r in self._slots}
        device_depth = _depths(hashes, slots, lambda h: self._device.get(h, 0))
        any_depth = _depths(hashes, slots, lambda h: self._device.get(h, 0) | self._host.get(h, 0))
        out = {r: PrefixMatch() for r in replicas}
        for slot, replica in slots.items():
            dev = device_depth[slot]
            out[replica] = PrefixMatch(dev, max(any_depth[slot] - dev, 0))
        return out


def _depths(hashes: Sequence[int], slots: dict[int, ReplicaId], mask_of: Callable[[int], int]) -> dict[int, int]:
    """For each slot, the number of leading hashes whose mask has its bit."""
    alive = 0
    for slot in slots:
        alive |= 1 << slot
    depth = dict.fromkeys(slots, len(hashes))
    for i, h in enumerate(hashes):
        if not alive:
            break
        mask = mask_of(h)
        stopped = alive & ~mask
        while stopped:
            low = stopped & -stopped
            depth[low.bit_length() - 1] = i
            stopped ^= low
        alive &= mask
    return depth
