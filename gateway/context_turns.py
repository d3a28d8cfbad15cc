"""A later turn's request context from the cached state of the turn before (issue 15).

``gateway.context.build_context`` calls ``resume`` for chat, Messages, count_tokens and
Responses bodies when the cache (``gateway.context_cache``) is on. The result is the
same as the full path's (parse, validate, render, hash everything) for every body; the
property tests of ``tests/gateway/test_context_cache.py`` compare them field by field.

**A hit.** The cache found a boundary: the new body's bytes ``start:end`` are, byte for
byte, messages 0..k-1 of a body that was accepted before, at the same place. The
*skeleton* ``body[:start] + NONCE + body[end:]`` (NONCE: a random JSON integer) is parsed
instead of the body: it holds everything else, the head (tools, system) and the new
messages. It is valid JSON exactly when the body is: JSON parsing is a left-to-right state
machine, the cut replaces complete values inside the same array by one value, and the
values cut were parsed in that state before. Nesting: the cut values passed the depth
check at the same depth, so the skeleton's check is the body's. The placeholder must be
element 0 of the skeleton's winning ``messages``/``input`` array, and its digits must occur
once in the skeleton (a JSON integer has one spelling), which also rules out a duplicate
key taking the array's place. The head is rendered again and must equal the entry's; the
new messages are validated (the same checks, per message, as the full path; the cut ones
passed them before), rendered from the boundary's state, and the chain continued from
its last hash over its unhashed tail plus the new bytes (``prefix_hash.extend_chain``).

**A miss.** The whole body is parsed and rendered as on the full path, message by message
(``conversation.LAYOUTS``), so that the state at each message boundary is known.

**A hit with the same surroundings.** When the bytes before the first message and from
the list's closing bracket on are also the same as the cached body's (``Outer``: one
more digest, over those bytes), not even the skeleton is parsed: what those bytes parse
to (model, max_tokens, stream, the session field, the head) is the entry's, and only the
new messages ``body[end:close]`` are, as ``[0`` + them + ``]`` (valid exactly when the
body is: the bytes before are those of an accepted body in the same parser state, and so
are the bytes after; an ``Outer`` is recorded only where the list's place is known to be
the winning ``messages`` array's). Chat and Messages only (a Responses body's
``previous_response_id`` is read from the payload on every request).

Either way the new body is recorded: ``gateway.context_spans`` finds the byte offsets of
its (new) messages, and the digests of ``body[start:end]`` at its last boundaries
continue the hit's hasher. Anything unexpected (a validation error, a shape the renderer
refuses, offsets that cannot be found) returns None: the caller then runs the full path,
which gives the exact error or the same result. "Byte for byte" is a 128-bit xxh3 digest
under a random per-process seed: equal results unless someone finds a collision for a
seed they cannot see. ``payload`` after a hit is ``LazyPayload``: the top-level values from the
skeleton, the message list parsed from the whole body the first time it is read.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
import xxhash

from gateway import context_spans, conversation, prefix_hash
from gateway.context_cache import BOUNDARIES, FINGERPRINT, Boundary, ContextCache, Entry, Hit, Outer
from gateway.errors import InvalidRequest

# validate(parsed skeleton, top-level values with the field holding only the new items,
#          items cached before them, the skeleton) -> (model, max_tokens, stream,
#          whether the skeleton is orjson.dumps(parsed) byte for byte)
Validate = Callable[[Any, dict[str, Any], int, bytes], tuple[str, int | None, bool, bool]]
_FAILED = (InvalidRequest, ValueError, TypeError, UnicodeError)  # ValueError: JSON, ShapeError
_MAX_SESSION_FIELD = 1024  # a longer body session key is not kept in an Outer


@dataclass(frozen=True, slots=True)
class Checks:
    """The full path's checks, from ``gateway.context``: the whole skeleton's, and the
    per-message ones of new messages alone (``items(items, cached)``) plus the depth
    check of a list at the messages' depth (``depth(list)``)."""

    validate: Validate
    items: Callable[[list[Any], int], None]
    depth: Callable[[list[Any]], None]
    session_field: Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class Resumed:
    """What ``gateway.context`` needs to finish the request's context."""

    session_field: Any  # the body's own session key
    payload: Mapping[str, Any]
    model: str
    max_tokens: int | None
    stream: bool
    hashes: tuple[int, ...]
    chars: int
    short_raw: bytes  # the whole rendering when no block was hashed (the routing key), else b""


class LazyPayload(Mapping[str, Any]):
    """The parsed body: top-level values from the skeleton (if parsed), the rest parsed
    from the whole body the first time it is read."""

    def __init__(self, body: bytes, top: dict[str, Any] | None, field: str) -> None:
        self._body, self._top, self._field = body, top, field
        self._full: dict[str, Any] | None = None

    def _all(self) -> dict[str, Any]:
        if self._full is None:
            self._full = orjson.loads(self._body)
        return self._full

    def __getitem__(self, key: str) -> Any:
        return self._top[key] if self._top is not None and key != self._field else self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._top if self._top is not None else self._all())

    def __len__(self) -> int:
        return len(self._top if self._top is not None else self._all())


@dataclass(frozen=True, slots=True)
class _Turn:
    """One body being resumed: where, from what, and what its surroundings parsed to."""

    cache: ContextCache
    key: Hashable
    body: bytes
    layout: conversation.Layout
    block: int
    max_blocks: int
    hit: Hit | None
    head_id: int
    model: str
    max_tokens: int | None
    stream: bool
    session_field: Any
    keep_outer: bool  # record what the surroundings parse to (not for Responses)
    same_outer: Outer | None  # the hit's, when the surroundings are the same bytes


@dataclass(frozen=True, slots=True)
class _Rendered:
    out: list[str]
    skipped: int  # new items before the marked ones
    marks: list[int]  # len(out) after each of the last BOUNDARIES new items
    roles: list[str | None]  # the turn each of them left open
    end: str


def _render(layout: conversation.Layout, head: str, items: list[Any], hit: Hit | None) -> _Rendered:
    out: list[str] = [] if hit is not None else [head]
    role = hit.boundary.open_role if hit is not None else None
    marks: list[int] = []
    roles: list[str | None] = []
    render, skipped = layout.item, max(0, len(items) - BOUNDARIES)
    for item in items[:skipped]:
        role = render(item, out, role)
    for item in items[skipped:]:  # only the last boundaries are kept: mark those
        role = render(item, out, role)
        marks.append(len(out))
        roles.append(role)
    end: list[str] = []
    layout.end(role, end)
    return _Rendered(out, skipped, marks, roles, "".join(end))


def _head_id(kind: str, model: str, block: int, max_blocks: int, head: str, seed: int) -> int:
    return xxhash.xxh3_128_intdigest(orjson.dumps([kind, model, block, max_blocks, head]), seed)


def resume(kind: str, body: bytes, key: Hashable, cache: ContextCache, block: int, max_blocks: int,
           checks: Checks) -> Resumed | None:
    """The context's parts for ``body`` (None: use the full path), recording its state."""
    hit = cache.find(key, body)
    if hit is not None:
        done = _outer(kind, body, key, cache, block, max_blocks, checks, hit) if hit.entry.outer else None
        if done is None:  # the surroundings changed, or something is off: parse the skeleton
            done = _skeleton(kind, body, key, cache, block, max_blocks, checks, hit)
        if done is not None:
            return done
    return _skeleton(kind, body, key, cache, block, max_blocks, checks, None)


def _outer(kind: str, body: bytes, key: Hashable, cache: ContextCache, block: int, max_blocks: int,
           checks: Checks, hit: Hit) -> Resumed | None:
    outer, start, end = hit.entry.outer, hit.entry.start, hit.boundary.end
    assert outer is not None
    close = len(body) - outer.suffix
    if close < end or body[close] != 0x5D:
        return None
    h = cache.hasher()
    h.update(memoryview(body)[:start])
    h.update(memoryview(body)[close:])
    if h.intdigest() != outer.digest:
        return None
    wrapped = b"[0" + body[end:close] + b"]"
    try:
        listed = orjson.loads(wrapped)
        checks.depth(listed)
        items = listed[1:]
        checks.items(items, hit.boundary.count)
        layout = conversation.LAYOUTS[kind]
        r = _render(layout, "", items, hit)
    except _FAILED:
        return None
    turn = _Turn(cache, key, body, layout, block, max_blocks, hit, hit.entry.head_id, outer.model,
                 outer.max_tokens, outer.stream, outer.session_field, True, outer)

    def spans(last: int) -> context_spans.Spans | None:
        found = context_spans.located(wrapped, listed, last)
        if found is None or found.start != 1:  # the whole of "[0" + ... + "]"
            found = context_spans.spans(wrapped, None, 1, len(items), last)
        shift = end - 2  # wrapped -> body offsets
        return context_spans.Spans(start, close, [e + shift for e in found.ends])

    return _finish(turn, r, spans, LazyPayload(body, None, layout.field))


def _skeleton(kind: str, body: bytes, key: Hashable, cache: ContextCache, block: int, max_blocks: int,
              checks: Checks, hit: Hit | None) -> Resumed | None:
    layout = conversation.LAYOUTS[kind]
    field, nonce = layout.field, cache.nonce
    try:
        skeleton = body if hit is None else body[:hit.entry.start] + nonce + body[hit.boundary.end:]
        parsed = orjson.loads(skeleton)
        listed = parsed.get(field) if type(parsed) is dict else None
        if type(listed) is not list:
            raise ValueError("no item list")
        if hit is not None and (not listed or type(listed[0]) is not int or listed[0] != int(nonce)
                                or skeleton.count(nonce) != 1):
            raise ValueError("the cached messages are not where the entry says")
        items = listed if hit is None else listed[1:]
        top = parsed if hit is None else {**parsed, field: items}
        cached = hit.boundary.count if hit is not None else 0
        model, max_tokens, stream, own = checks.validate(parsed, top, cached, skeleton)
        head = layout.head(top)
        head_id = _head_id(kind, model, block, max_blocks, head, cache.seed)
        if hit is not None and hit.entry.head_id != head_id:
            return None
        r = _render(layout, head, items, hit)
    except _FAILED:
        return None
    session = checks.session_field(top)
    keep_outer = kind != "responses" and (session is None or (type(session) is str
                                                              and len(session) <= _MAX_SESSION_FIELD))
    turn = _Turn(cache, key, body, layout, block, max_blocks, hit, head_id, model, max_tokens, stream, session,
                 keep_outer, None)

    def spans(last: int) -> context_spans.Spans | None:
        if hit is None:
            found = context_spans.spelled(parsed, field, body, last) if own else None
            if found is not None:
                return found
            return context_spans.spans(body, field, 0, len(items), last)  # ("located" may not be the winner)
        found = context_spans.located(skeleton, listed, last)
        if found is None or found.start != hit.entry.start:
            found = context_spans.spans(skeleton, field, 1, len(items), last)
        shift = hit.boundary.end - hit.entry.start - len(nonce)  # skeleton -> body offsets
        close = found.close + shift if found.close >= 0 else -1
        return context_spans.Spans(hit.entry.start, close, [e + shift for e in found.ends])

    payload = parsed if hit is None else LazyPayload(body, parsed, field)
    return _finish(turn, r, spans, payload)


def _finish(t: _Turn, r: _Rendered, spans: Callable[[int], context_spans.Spans | None],
            payload: Mapping[str, Any]) -> Resumed:
    """Continue the chain from the hit's boundary over the new rendering; record the body."""
    text = "".join(r.out)
    items_raw = text.encode()
    b0 = t.hit.boundary if t.hit is not None else None
    count0 = b0.blocks(t.block, t.max_blocks) if b0 is not None else 0
    chain = t.hit.entry.hashes[:count0] if t.hit is not None else array("Q")
    buf = (b0.tail if b0 is not None else b"") + items_raw + r.end.encode()  # from block count0 on
    h = chain[-1] if chain else prefix_hash.model_seed(t.model)
    chain.extend(prefix_hash.extend_chain(h, buf, t.block, t.max_blocks - count0))
    hashes = tuple(chain)
    chars = (b0.chars if b0 is not None else 0) + len(text)
    state = _Chain(t.head_id, chain, buf, b0, t.block, t.max_blocks, (b0.rendered if b0 else 0) + len(items_raw),
                   chars)
    _record(t, state, r, spans)
    return Resumed(t.session_field, payload, t.model, t.max_tokens, t.stream, hashes, chars + len(r.end),
                   b"" if hashes else buf)


@dataclass(frozen=True, slots=True)
class _Chain:
    head_id: int
    hashes: array[int]
    buf: bytes  # the rendering from the resumed boundary's last hashed block on
    b0: Boundary | None
    block: int
    max_blocks: int
    rendered: int  # bytes rendered up to the end of the last item (without the end's close)
    chars: int  # characters of it

    def boundary(self, end: int, digest: int, fingerprint: bytes, count: int, rendered: int, chars: int,
                 role: str | None) -> Boundary:
        base = (self.b0.rendered - len(self.b0.tail)) if self.b0 is not None else 0
        n = min(rendered // self.block, self.max_blocks)
        tail = b"" if n == self.max_blocks else self.buf[n * self.block - base:rendered - base]
        return Boundary(end, digest, fingerprint, count, rendered, chars, tail, role)


def _record(t: _Turn, chain: _Chain, r: _Rendered, spans: Callable[[int], context_spans.Spans | None]) -> None:
    """Keep the state at the body's last message boundaries (nothing when they cannot be found)."""
    n_new = min(len(r.marks), BOUNDARIES)
    try:
        found = spans(n_new)
    except (msgspec.MsgspecError, ValueError):
        return
    if found is None or len(found.ends) != n_new or found.start < 0:
        return
    at_bytes, at_chars = [chain.rendered], [chain.chars]  # after each of the last n_new items, last first
    for j in range(len(r.marks) - 1, len(r.marks) - n_new, -1):
        seg = "".join(r.out[r.marks[j - 1]:r.marks[j]])
        at_bytes.append(at_bytes[-1] - len(seg.encode()))
        at_chars.append(at_chars[-1] - len(seg))
    at_bytes.reverse()
    at_chars.reverse()
    hit, start, body = t.hit, found.start, t.body
    hasher = hit.hasher if hit is not None else t.cache.hasher()
    pos = hit.boundary.end if hit is not None else start
    view = memoryview(body)
    cached = hit.boundary.count if hit is not None else 0
    new: list[Boundary] = []
    for i, end in enumerate(found.ends):
        hasher.update(view[pos:end])
        pos = end
        j = len(r.marks) - n_new + i
        new.append(chain.boundary(end, hasher.intdigest(), body[max(start, end - FINGERPRINT):end],
                                  cached + r.skipped + j + 1, at_bytes[i], at_chars[i], r.roles[j]))
    kept = [b for b in hit.entry.boundaries if b.end <= hit.boundary.end] if hit is not None else []
    boundaries = tuple((kept + new)[-BOUNDARIES:])
    if boundaries:
        entry = Entry.make(t.head_id, start, chain.hashes, boundaries, _outer_of(t, found))
        t.cache.record(t.key, entry, hit.entry if hit is not None else None)


def _outer_of(t: _Turn, found: context_spans.Spans) -> Outer | None:
    """The body's surroundings, digested, when the list's place is exactly known."""
    if t.same_outer is not None:
        return t.same_outer
    if not t.keep_outer or found.close < 0:
        return None
    h = t.cache.hasher()
    h.update(memoryview(t.body)[:found.start])
    h.update(memoryview(t.body)[found.close:])
    return Outer(len(t.body) - found.close, h.intdigest(), t.model, t.max_tokens, t.stream, t.session_field)
