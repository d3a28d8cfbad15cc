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
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeGuard
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


def _block_size(value: Any) -> int:
    """A page size in tokens advertised in ``/server_info`` (nil: unknown, 0)."""
    if value is None:
        return 0
    if not _is_int(value) or value < 0:
        raise KvEventError(f"block_size must be a non-negative integer, got {value!r:.40}")
    return int(value)


# The wire schema, decoded and type-checked by msgspec in C (where checking each value in
# Python blocked the event loop ~75 ms per 200,000-hash batch: issue 41). msgspec never takes
# a bool for an int, nor a float with a fraction, nor bytes for a string. Page hashes and
# token ids stay raw msgpack here and are decoded apart (``_int_chunks``, ``_token_ids``).
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
NIL = msgspec.Raw(b"\xc0")  # a msgpack nil: an absent optional field
DECODE_CHUNK = 16384
"""Page hashes decoded at once (~0.5 ms) by ``decode_steps`` before it yields, so a caller on
the event loop can let requests run between the chunks of a huge batch."""


class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = NIL  # unigram ids or bigram pairs
    block_size: NonNegative | None = None
    medium: str | None = None


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: msgspec.Raw
    medium: str | None = None


class _ClearedMap(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: NonNegative | None
    lora_id: msgspec.Raw = NIL
    medium: str | None = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: msgspec.Raw
    medium: str | None = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float | None
    events: list[msgspec.Raw]  # each decoded by its shape: a map or a positional array
    attn_dp_rank: NonNegative | None = 0


_BATCH = msgspec.msgpack.Decoder(_Batch)
_MAP_EVENT = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | _ClearedMap)
_ARRAY_EVENT = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)
_INTS = msgspec.msgpack.Decoder(tuple[int, ...])
_TOKENS = msgspec.msgpack.Decoder(tuple[int, ...] | None)
_PAIRS = msgspec.msgpack.Decoder(tuple[tuple[int, ...], ...])
_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # the first byte of a msgpack map
_ARRAY_FIRST = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_INT_WIDTHS = ((9, b"\xcf\xd3"), (5, b"\xce\xd2"), (3, b"\xcd\xd1"), (2, b"\xcc\xd0"),
               (1, bytes([*range(0x80), *range(0xE0, 0x100)])))  # an int's bytes -> its type bytes


def _int_chunks(raw: msgspec.Raw, chunk: int) -> Iterator[tuple[int, ...]]:
    """The integers of the msgpack array ``raw``, ``chunk`` at a time when every element has
    the same width (64-bit page hashes do: 9 bytes each), else all at once. Same width means
    every width-th byte is a type byte of that width, so the chunks' bounds are elements'
    bounds (checked at C speed: ``translate`` deletes the type bytes, nothing may be left)."""
    data = memoryview(raw)
    head = data[0] if len(data) else -1
    count, body = {0xDC: (int.from_bytes(data[1:3], "big"), 3),
                   0xDD: (int.from_bytes(data[1:5], "big"), 5)}.get(head, (head & 0x0F, 1))
    if count > chunk and head in _ARRAY_FIRST:
        items = bytes(data[body:])
        for width, types in _INT_WIDTHS:
            if len(items) == width * count and not items[::width].translate(None, types):
                for i in range(0, count, chunk):
                    n = min(chunk, count - i)
                    yield _INTS.decode(b"\xdd" + n.to_bytes(4, "big") + items[i * width:(i + n) * width])
                return
    yield _INTS.decode(raw)


def _token_ids(raw: msgspec.Raw) -> tuple[int, ...]:
    """Unigram ids, or the flattened pairs of bigram (EAGLE) keys; nil: none."""
    try:
        return _TOKENS.decode(raw) or ()
    except msgspec.ValidationError:
        return tuple(t for pair in _PAIRS.decode(raw) for t in pair)


def _event(raw: msgspec.Raw) -> Any:
    """One event's struct, a tagged map (>= 0.5.22) or a positional array (0.5.5 - 0.5.18)."""
    view = memoryview(raw)
    first = view[0] if len(view) else -1
    if first in _MAP_FIRST:
        return _MAP_EVENT.decode(raw)
    if first in _ARRAY_FIRST:
        return _ARRAY_EVENT.decode(raw)
    raise KvEventError("an event is a map or an array")


def decode_steps(seq: int, payload: bytes, *, token_ids: bool = True) -> Generator[None, None, EventBatch]:
    """``decode_batch``, yielding after each ``DECODE_CHUNK`` page hashes (its result is the
    generator's return value). ``token_ids=False``: a ``BlockStored``'s token ids are not
    decoded (``()``; the gateway never reads them, it hashes prompts itself, and at page size
    16 they are 16 times the work of the hashes), only checked to be well-formed msgpack."""
    try:
        batch = _BATCH.decode(payload)
        events: list[Event] = []
        for raw in batch.events:
            event = _event(raw)
            if isinstance(event, (_ClearedMap, _ClearedArray)):
                events.append(AllBlocksCleared())
                continue
            hashes: list[int] = []
            for part in _int_chunks(event.block_hashes, DECODE_CHUNK):
                hashes.extend(part)
                yield
            medium = event.medium or GPU  # missing (nil or empty) means GPU
            if isinstance(event, (_RemovedMap, _RemovedArray)):
                events.append(BlockRemoved(tuple(hashes), medium))
            else:
                tokens = _token_ids(event.token_ids) if token_ids else ()
                events.append(BlockStored(tuple(hashes), event.parent_block_hash, tokens, event.block_size or 0,
                                          medium))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise KvEventError(f"malformed batch: {exc}"[:300]) from exc
    return EventBatch(seq, batch.ts or 0.0, batch.attn_dp_rank or 0, tuple(events))


def decode_batch(seq: int, payload: bytes, *, token_ids: bool = True) -> EventBatch:
    """One batch from its msgpack payload (``seq`` from the frame before it).

    Every value is type-checked, so anything malformed raises ``KvEventError`` and nothing
    else: the subscriber counts it as a decode error and skips the whole batch (one bad event
    makes the batch's other events suspect too). Its seq is then missing: the next batch shows
    a gap, replayed or else marking the replica uncertain (routed approximately), since the
    index no longer knows what the skipped batch changed. (A ``block_size: "abc"`` raising a
    ValueError out of the decoder once killed the subscriber's task: issue 41.)"""
    steps = decode_steps(seq, payload, token_ids=token_ids)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: EventBatch = done.value
            return result


def decode_seq(frame: bytes, *, signed: bool = False) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)


def message_steps(frames: Sequence[bytes], *, token_ids: bool = True) -> Generator[None, None, EventBatch]:
    """``decode_steps`` of ``[topic, seq, payload]`` as received by a SUB socket."""
    if len(frames) != 3:
        raise KvEventError(f"a KV event message has 3 frames, got {len(frames)}")
    return decode_steps(decode_seq(frames[1]), frames[2], token_ids=token_ids)


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
