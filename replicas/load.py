"""Load accounting: per-replica counters and the lease that ties them to a response.

A decision counts the moment it is made: ``Registry.lease()`` increments ``in_flight``
and ``pending_prefill_tokens`` (the predicted uncached tokens) before the request is
even sent, so the next decision sees it. The lease is a guard object owned by the
response stream: ``first_byte()`` moves the request from "prefilling" to "decoding",
``release()`` (idempotent) takes it out on completion, error and client disconnect.
Health probes never touch these counters; only leases do.

A lease keeps a reference to the counters it incremented, so removing a replica (or
re-adding one at the same URL) never corrupts the accounting of requests in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from prefix_index.base import ReplicaId


@dataclass(slots=True)
class LoadCounters:
    """Work one gateway (or, summed, several) has in flight on one replica."""

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    decoding: int = 0

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.in_flight, self.pending_prefill_tokens, self.decoding)


class LoadLease:
    """Guard for one routed request; see the module docstring."""

    __slots__ = (
        "_counters",
        "_first",
        "_on_release",
        "_released",
        "predicted_uncached_tokens",
        "replica",
    )

    def __init__(
        self,
        replica: ReplicaId,
        counters: LoadCounters,
        predicted_uncached_tokens: int,
        on_release: Callable[[LoadLease], None] | None = None,
    ) -> None:
        self.replica = replica
        self.predicted_uncached_tokens = max(0, int(predicted_uncached_tokens))
        self._counters = counters
        self._on_release = on_release
        self._first = False
        self._released = False
        counters.in_flight += 1
        counters.pending_prefill_tokens += self.predicted_uncached_tokens

    @property
    def released(self) -> bool:
        return self._released

    @property
    def decoding(self) -> bool:
        return self._first and not self._released

    def first_byte(self) -> None:
        """The replica started answering: prefill is done, the request now decodes."""
        if self._first or self._released:
            return
        self._first = True
        self._counters.pending_prefill_tokens -= self.predicted_uncached_tokens
        self._counters.decoding += 1

    def release(self) -> None:
        """Take the request out of the counters. Safe to call any number of times."""
        if self._released:
            return
        self._released = True
        c = self._counters
        if self._first:
            c.decoding -= 1
        else:
            c.pending_prefill_tokens -= self.predicted_uncached_tokens
        c.in_flight -= 1
        if self._on_release is not None:
            self._on_release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        phase = "released" if self._released else ("decoding" if self._first else "prefill")
        return f"LoadLease({self.replica!r}, {self.predicted_uncached_tokens}, {phase})"
