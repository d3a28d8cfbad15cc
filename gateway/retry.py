"""How much retrying the fleet can afford, and which requests are not worth retrying.

- ``RetryBudget`` (Envoy's retry budget): retries in flight stay under
  ``max(minimum, ratio x requests in flight)``, fleet-wide, so a failing fleet is not
  hammered by its own retries; beyond it the first error goes back to the client.
- ``PoisonBodies``: fingerprints of request bodies judged to fail on their own (a 5xx
  from two different replicas), kept ``ttl_s``; their copies are not retried and count
  against no replica.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import xxhash


class RetryBudget:
    """Retries in flight bounded by a fraction of the requests in flight (fleet-wide)."""

    def __init__(self, ratio: float, minimum: int) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.requests = 0  # requests in flight (before their first byte and streaming)
        self.retries = 0  # retry attempts in flight

    def try_acquire(self) -> bool:
        """Take one retry, or False when the budget is spent (the caller then gives up)."""
        if self.retries >= max(self.minimum, int(self.ratio * self.requests)):
            return False
        self.retries += 1
        return True

    def release(self) -> None:
        self.retries = max(0, self.retries - 1)


class PoisonBodies:
    """Fingerprints (xxh3_64 of the body bytes) of requests judged to fail on their own."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._seen: OrderedDict[int, float] = OrderedDict()  # fingerprint -> expiry

    @staticmethod
    def fingerprint(body: bytes) -> int:
        return xxhash.xxh3_64_intdigest(body)

    def add(self, fingerprint: int) -> None:
        self._seen[fingerprint] = self._clock() + self.ttl_s
        self._seen.move_to_end(fingerprint)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def __contains__(self, fingerprint: int) -> bool:
        expiry = self._seen.get(fingerprint)
        if expiry is None:
            return False
        if expiry < self._clock():
            del self._seen[fingerprint]
            return False
        return True
