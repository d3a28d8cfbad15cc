"""Precise mode in virtual time: the router matches from the engines' own KV events.

`kvgate simulate --index precise`: every simulated engine gets a
``loadtest.simulator.kv_publisher.KvEventRecorder`` (the one a real simulated replica
publishes over ZMQ) whose sink applies each step's batch, in process and at once, to one
``prefix_index.precise.EventBlockIndex`` through the gateway's own
``replicas.kv_subscriber.IndexSink``: the same event values and the same index code as a
gateway in precise mode, without sockets (a real stream lags by a socket hop; here the
index is current at every decision, see ``SimRouter.route``).

A request is looked up with SGLang's page hashes of the engine's token ids
(``gateway.sglang_pages``), as the gateway hashes a tokenized prompt. `SglangPages`
keeps, per session, the digests of the pages it shares turn to turn, so a turn only
hashes its new pages. Matches come back in tokens
(``prefix_index.precise.to_prefix_match(..., block_tokens=1)``), the unit of
``policies.routing.merge_matches`` / ``token_context``.
"""
from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.sglang_pages import to_int64
from loadtest.fleetsim.sync import finished
from loadtest.simulator.kv_publisher import KvEventRecorder
from prefix_index.base import PrefixMatch, ReplicaId
from prefix_index.precise import EventBlockIndex, to_prefix_match
from replicas.kv_events import Event, EventBatch, PublisherEndpoint
from replicas.kv_subscriber import IndexSink

INDEX_MODES = ("approximate", "precise")


def digests(tokens: npt.NDArray[Any], page_size: int, prior: bytes = b"") -> list[bytes]:
    """SGLang's chained page digests of the full pages of ``tokens`` (after ``prior``)."""
    data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    step = page_size * 4
    out: list[bytes] = []
    for start in range(0, (len(data) // step) * step, step):
        prior = hashlib.sha256(prior + data[start:start + step]).digest()
        out.append(prior)
    return out


class SglangPages:
    """One session's page digests over its shared tokens (``SessionPrompt.tokens``)."""

    __slots__ = ("digests", "page_size")

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.digests: list[bytes] = []

    def truncate(self, kept_tokens: int) -> None:
        """The session kept only its first ``kept_tokens`` tokens (a new turn)."""
        del self.digests[kept_tokens // self.page_size:]

    def hashes(self, prompt: npt.NDArray[Any], shared: npt.NDArray[Any]) -> list[int]:
        """Published hashes of ``prompt``'s full pages; ``shared`` is the session's token
        prefix (whose digests are kept), ``prompt`` agrees with it up to ``len(prompt)``."""
        ps, known = self.page_size, self.digests
        common = min(len(prompt), len(shared)) // ps
        if len(known) < common:
            known += digests(shared[len(known) * ps:common * ps], ps, known[-1] if known else b"")
        out = known[:common]
        rest = prompt[common * ps:]
        if len(rest) >= ps:
            out = out + digests(rest, ps, out[-1] if out else b"")
        return [to_int64(d) for d in out]


class PreciseFleetIndex:
    """One EventBlockIndex fed by every engine's recorder (module docstring)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.index = EventBlockIndex()
        self.sink = IndexSink(self.index, slice_hashes=sys.maxsize)  # no event loop to yield to
        self.batches = 0

    def recorder(self, replica: ReplicaId) -> KvEventRecorder:
        endpoint = PublisherEndpoint(replica=str(replica), dp_rank=0, endpoint=f"inproc://{replica}",
                                     bind=False, topic=b"", block_size=self.page_size)
        seq = itertools.count()

        def apply(events: tuple[Event, ...], ts: float) -> None:
            self.batches += 1
            finished(self.sink.apply(endpoint, EventBatch(next(seq), ts, 0, events)))

        return KvEventRecorder(self.page_size, apply, keep_token_ids=False)

    def matches(self, hashes: Sequence[int], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        """Per replica whose stream is certain: the match in tokens (device, then host)."""
        raw = self.index.match(hashes, replicas)
        uncertain = self.index.uncertain
        return {r: to_prefix_match(m.device_blocks, m.host_blocks, self.page_size)
                for r, m in raw.items() if r not in uncertain}
