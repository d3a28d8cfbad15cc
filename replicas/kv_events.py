"""SGLang's KV-cache events: wire format, decoding, publisher discovery, sequence gaps.

A replica started with ``--kv-events-config '{"publisher":"zmq","endpoint":...}'``
publishes, from one scheduler per DP rank, what its radix cache stores and evicts:

    ZMQ multipart  [topic, seq (8-byte big-endian, from 0 per publisher), msgpack(batch)]
    batch          [ts: float, events: list, attn_dp_rank: int]          (array-like)
    event (>= 0.5.22, tagged maps)
        {"type": "BlockStored", "block_hashes": [i64...], "parent_block_hash": i64|nil,
         "token_ids": [...], "block_size": int, "lora_id": nil, "medium": "GPU"|"CPU_PINNED"|...}
        {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
        {"type": "AllBlocksCleared"}
    event (0.5.5 - 0.5.18, positional arrays, vLLM style)
        ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium?, metadata?]
        ["BlockRemoved", hashes, medium?]        ["AllBlocksCleared"]

Both shapes decode to the same frozen values. A missing ``medium`` means ``GPU``.
Discovery (``/server_info.kv_events``): ``{"publisher":"zmq","endpoint_host","endpoint_port_base",
"topic","block_size","dp_size","replay_endpoint_port_base"?}``; rank r publishes on
``endpoint_port_base + r``; a wildcard host (``*``, ``0.0.0.0``, ``::``) is replaced by the
replica's own host and the publisher *binds* (the subscriber connects); with a concrete
host the publisher *connects* (the subscriber must bind that address).
Replay: a DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` to the ROUTER at
``replay_endpoint_port_base + r``; replies are ``[b"", topic, seq, payload]`` per buffered
batch with seq >= start, then ``[b"", b"", seq=-1 (signed), b""]``.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import urlsplit

import msgspec

GPU = "GPU"
CPU_PINNED = "CPU_PINNED"
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
REPLAY_END = -1


class KvEventError(ValueError):
    """A message that is not a KV event batch of a known shape."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    dp_rank: int
    events: tuple[Event, ...]


def _is_int(value: Any) -> TypeGuard[int]:
    """msgpack integers only: a bool is an int to Python but never a hash, size or rank."""
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise KvEventError(f"{what} must be a list of integers")
    return tuple(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    """Unigram ids, or the flattened pairs of bigram (EAGLE) keys."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return tuple(t for pair in value for t in _ints(pair, "token_ids pair"))
    return _ints(value if value is not None else [], "token_ids")


def _medium(value: Any) -> str:
    """A storage tier name; missing (nil) means GPU. Any other type is a malformed event, not
    GPU: guessing the tier of a page would put it in the wrong table of the index."""
    if value is None or value == "":
        return GPU
    if not isinstance(value, str):
        raise KvEventError(f"medium must be a string, got {type(value).__name__}")
    return value


def _parent(value: Any) -> int | None:
    if value is None or _is_int(value):
        return value
    raise KvEventError(f"parent_block_hash must be an integer or nil, got {type(value).__name__}")


def _block_size(value: Any) -> int:
    """A page size in tokens (nil: unknown, 0). Checked here, since ``int("abc")`` raising a
    ValueError out of the decoder once killed the subscriber's task (issue 41)."""
    if value is None:
        return 0
    if not _is_int(value) or value < 0:
        raise KvEventError(f"block_size must be a non-negative integer, got {value!r:.40}")
    return int(value)


def _stored(hashes: Any, parent: Any, token_ids: Any, block_size: Any, medium: Any) -> BlockStored:
    return BlockStored(_ints(hashes, "block_hashes"), _parent(parent), _token_ids(token_ids),
                       _block_size(block_size), _medium(medium))


def _event_from_map(raw: dict[str, Any]) -> Event:
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw.get("block_hashes"), raw.get("parent_block_hash"), raw.get("token_ids"),
                       raw.get("block_size"), raw.get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved(_ints(raw.get("block_hashes"), "block_hashes"), _medium(raw.get("medium")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown event type {kind!r:.40}")


def _event_from_array(raw: list[Any]) -> Event:
    kind = raw[0] if raw else None
    if kind == "BlockStored" and len(raw) >= 5:
        return _stored(raw[1], raw[2], raw[3], raw[4], raw[6] if len(raw) > 6 else None)
    if kind == "BlockRemoved" and len(raw) >= 2:
        return BlockRemoved(_ints(raw[1], "block_hashes"), _medium(raw[2] if len(raw) > 2 else None))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown positional event {kind!r:.40}")


def decode_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        return _event_from_map(raw)
    if isinstance(raw, list):
        return _event_from_array(raw)
    raise KvEventError(f"an event is a map or an array, got {type(raw).__name__}")


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """One batch from its msgpack payload (``seq`` from the frame before it).

    Every value is type-checked, so anything malformed raises ``KvEventError`` and nothing
    else: the subscriber counts it as a decode error and skips the whole batch (one bad event
    makes the batch's other events suspect too). Its seq is then missing: the next batch shows
    a gap, replayed or else marking the replica uncertain (routed approximately), since the
    index no longer knows what the skipped batch changed."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise KvEventError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventError("a batch is [ts, events, attn_dp_rank]")
    rank = raw[2] if len(raw) > 2 else 0
    if rank is None:
        rank = 0
    if not _is_int(rank) or rank < 0:
        raise KvEventError(f"attn_dp_rank must be a non-negative integer, got {rank!r:.40}")
    ts = raw[0]
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise KvEventError(f"ts must be a number, got {type(ts).__name__}")
    return EventBatch(seq, float(ts or 0.0), rank, tuple(decode_event(e) for e in raw[1]))


def decode_seq(frame: bytes, *, signed: bool = False) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """``[topic, seq, payload]`` as received by a SUB socket."""
    if len(frames) != 3:
        raise KvEventError(f"a KV event message has 3 frames, got {len(frames)}")
    return decode_batch(decode_seq(frames[1]), frames[2])


def encode_batch(events: Sequence[Event], ts: float = 0.0, dp_rank: int = 0) -> bytes:
    """The 0.5.23 msgpack payload of ``events`` (what SGLang and the simulated replica send)."""
    def one(e: Event) -> dict[str, Any]:
        if isinstance(e, BlockStored):
            return {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                    "block_size": e.block_size, "lora_id": None, "medium": e.medium}
        if isinstance(e, BlockRemoved):
            return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        return {"type": "AllBlocksCleared"}

    return msgspec.msgpack.encode([ts, [one(e) for e in events], dp_rank])


class SeqStatus(enum.Enum):
    NEXT = "next"  # the expected batch
    FIRST = "first"  # the first batch seen from this publisher
    GAP = "gap"  # batches were lost between the last one and this one
    OLD = "old"  # the batch just applied, again (a duplicate)
    RESTART = "restart"  # seq went further back: the publisher (the replica) restarted


@dataclass(slots=True)
class SequenceTracker:
    """The next sequence number expected from one publisher (one replica DP rank)."""

    expected: int | None = None
    synced_through: int | None = None
    """Set after a replay on joining: live batches up to it were applied from the replay
    (OLD, not a restart) until the first live batch beyond it."""

    def observe(self, seq: int) -> tuple[SeqStatus, int]:
        """The status of ``seq`` and, for a GAP, the first missing seq."""
        if self.synced_through is not None:
            if seq <= self.synced_through:
                return SeqStatus.OLD, seq
            self.synced_through = None
        expected = self.expected
        if expected is None:
            self.expected = seq + 1
            return SeqStatus.FIRST, seq
        if seq == expected:
            self.expected = seq + 1
            return SeqStatus.NEXT, seq
        if seq > expected:
            self.expected = seq + 1
            return SeqStatus.GAP, expected
        if seq == expected - 1:
            return SeqStatus.OLD, seq  # the last batch again (a duplicate)
        # further back: the publisher started over (a restart whose first batches we missed too)
        self.expected = seq + 1
        return SeqStatus.RESTART, seq


@dataclass(frozen=True, slots=True)
class PublisherEndpoint:
    """Where one DP rank of one replica publishes (and replays) its events."""

    replica: str
    dp_rank: int
    endpoint: str  # tcp://host:port
    bind: bool  # True: the subscriber binds (the publisher connects to a concrete host)
    topic: bytes
    block_size: int
    replay_endpoint: str | None = None


def _host_of(replica_url: str) -> str:
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _ranks(dp_size: Any, max_dp_size: int | None) -> int:
    """The number of DP ranks (publisher sockets) to subscribe to: one socket each, so an
    unbounded advertisement (a ``dp_size`` of 200 once made a gateway bind ~190 sockets) is
    refused rather than honoured."""
    ranks = dp_size if _is_int(dp_size) and dp_size > 0 else 1
    if max_dp_size is not None and ranks > max_dp_size:
        raise KvEventError(f"dp_size {ranks} exceeds the bound of {max_dp_size} (index.event_max_dp_size)")
    return int(ranks)


def publishers(replica_url: str, server_info: Any, max_dp_size: int | None = None) -> list[PublisherEndpoint]:
    """The publisher endpoints a replica advertises in ``/server_info.kv_events`` (none: []).

    Raises ``KvEventError`` for an advertisement the gateway refuses (more than ``max_dp_size``
    ranks, a port past 65535, a non-integer block size): the replica is then routed approximately."""
    info = server_info.get("kv_events") if isinstance(server_info, dict) else None
    if not isinstance(info, dict) or info.get("publisher") != "zmq":
        return []
    base = info.get("endpoint_port_base")
    if not _is_int(base) or base <= 0:
        return []
    host = str(info.get("endpoint_host") or "*")
    wildcard = host in WILDCARD_HOSTS
    target = _host_of(replica_url) if wildcard else (f"[{host}]" if ":" in host else host)
    ranks = _ranks(info.get("dp_size"), max_dp_size)
    advertised = info.get("replay_endpoint_port_base")
    replay: int | None = advertised if _is_int(advertised) and advertised > 0 else None
    if base + ranks - 1 > 65535 or (replay is not None and replay + ranks - 1 > 65535):
        raise KvEventError(f"publisher ports from {base} for {ranks} rank(s) exceed 65535")
    topic = str(info.get("topic") or "").encode()
    block = _block_size(info.get("block_size"))
    return [
        PublisherEndpoint(
            replica=replica_url.rstrip("/"), dp_rank=r, endpoint=f"tcp://{target}:{base + r}",
            bind=not wildcard, topic=topic, block_size=block,
            replay_endpoint=f"tcp://{target}:{replay + r}" if replay is not None else None,
        )
        for r in range(ranks)
    ]
