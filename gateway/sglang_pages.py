"""SGLang 0.5.23's page hashes of a token sequence: the block hashes its KV events carry.

A request's token ids hashed this way match, page by page, the ``block_hashes`` a
replica publishes in ``BlockStored`` events, so the gateway can look a request up in an
index built from those events (precise mode). The rule (``mem_cache/events.py``,
``hash_binding.cpp`` of SGLang 0.5.23):

    digest_k  = SHA256(digest_{k-1} (32 raw bytes; nothing for the first page)
                       || page k's tokens as little-endian uint32)
    published = first 8 bytes of digest_k, big-endian, as a signed int64

so page k's hash names pages 0..k. Only full pages are stored by the engine's paged
radix cache, so only full pages are hashed here. EAGLE-family speculative algorithms
(EAGLE, EAGLE3, NEXTN, FROZEN_KV_MTP) key the radix tree on bigrams
``(t0,t1),(t1,t2),...``: a page is ``page_size`` pairs packed as two uint32 each (a page
then needs ``page_size + 1`` tokens). ``PageHasher`` keeps the running digest so a
session's next turn only hashes its new tokens.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

BIGRAM_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP"})


def uses_bigrams(speculative_algorithm: object) -> bool:
    """True when the replica's radix keys are token pairs (``/server_info.speculative_algorithm``)."""
    return isinstance(speculative_algorithm, str) and speculative_algorithm.upper() in BIGRAM_ALGORITHMS


def to_int64(digest: bytes) -> int:
    value = int.from_bytes(digest[:8], "big")
    return value - (1 << 64) if value >= 1 << 63 else value


def _key_bytes(tokens: Sequence[int], bigram: bool) -> bytes:
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    ids32 = ids.astype("<u4")
    if not bigram:
        return ids32.tobytes()
    pairs = np.empty((max(ids32.size - 1, 0), 2), dtype="<u4")
    pairs[:, 0], pairs[:, 1] = ids32[:-1], ids32[1:]
    return pairs.tobytes()


def page_hashes(tokens: Sequence[int], page_size: int, *, bigram: bool = False,
                include_partial: bool = False) -> list[int]:
    """The published hash of every (full) page of ``tokens``."""
    hasher = PageHasher(page_size, bigram=bigram)
    hashes = hasher.extend(tokens)
    if include_partial and not bigram and hasher.pending_tokens:
        hashes.append(to_int64(hashlib.sha256(hasher.digest + hasher.pending_bytes()).digest()))
    return hashes


@dataclass(slots=True)
class PageHasher:
    """Hashes a growing token sequence page by page, keeping the chain's last digest."""

    page_size: int
    bigram: bool = False
    digest: bytes = b""
    hashes: list[int] = field(default_factory=list)
    _tail: list[int] = field(default_factory=list)  # tokens not yet in a full page (+1 for bigrams)
    checkpoint_every: int = 0  # > 0: keep every n-th page's digest (``checkpoints``) to resume from
    checkpoints: list[bytes] = field(default_factory=list)  # digest after pages n, 2n, ...
    yield_every: int = 0  # > 0: let other threads take the GIL after every n pages (a worker thread's hashing)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError("page_size must be > 0")

    @property
    def pending_tokens(self) -> int:
        """Tokens after the last full page (for bigrams: including the one the next pair starts with)."""
        return len(self._tail)

    @classmethod
    def resume(cls, page_size: int, bigram: bool, hashes: list[int], checkpoints: list[bytes],
               tail: Sequence[int], checkpoint_every: int, yield_every: int = 0) -> PageHasher:
        """Continue a chain from a checkpoint: ``hashes`` are its first pages (exactly
        ``len(checkpoints) * checkpoint_every``), ``checkpoints`` their kept digests, ``tail``
        the tokens after the last of those pages (for bigrams: from that page's last token)."""
        if len(hashes) != len(checkpoints) * checkpoint_every:
            raise ValueError("resume from a checkpoint: hashes must end at one")
        digest = checkpoints[-1] if checkpoints else b""
        return cls(page_size, bigram, digest, list(hashes), list(tail), checkpoint_every, list(checkpoints),
                   yield_every)

    def pending_bytes(self) -> bytes:
        return _key_bytes(self._tail, self.bigram)

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """Add tokens; returns the hashes of the pages they completed."""
        tail = self._tail + list(tokens)
        unit = self.page_size + (1 if self.bigram else 0)
        step = self.page_size
        data = _key_bytes(tail, self.bigram)
        width = 8 if self.bigram else 4
        new: list[int] = []
        start = 0
        while len(tail) - start >= unit:
            chunk = data[start * width:(start + step) * width]
            d = hashlib.sha256(self.digest + chunk).digest()
            self.digest = d
            new.append(to_int64(d))
            if self.checkpoint_every and (len(self.hashes) + len(new)) % self.checkpoint_every == 0:
                self.checkpoints.append(d)
            if self.yield_every and len(new) % self.yield_every == 0:
                time.sleep(0)  # hashing is Python; a waiting event loop gets the GIL now, not after 5 ms
            start += step
        self._tail = tail[start:]
        self.hashes += new
        return new
