"""Where a request body's messages are, in bytes (for ``gateway.context_turns``).

A cached state is reused only where a later body has the same bytes at the same offsets,
so recording a body needs the offset of its first message and the offsets just after its
last few, and of the list's closing bracket. Three ways, cheapest first:

- ``spelled``: the body is ``orjson.dumps`` of what it parsed to, byte for byte (compact
  JSON, as JSON.stringify writes it; the depth check's serialization says so): the offsets
  follow from the lengths of the other top-level entries' spellings.
- ``located``: the list is spelled as orjson spells it: one search for those bytes. Any
  place they occur is an array of exactly these items, but not necessarily the winning
  one (a duplicate key): the caller pins the place (a hit's known start) or does not
  trust it for more than that.
- ``spans``: msgspec's ``list[msgspec.Raw]`` spans are zero-copy views into the parsed
  buffer; their addresses give the offsets, for any spelling (one scan of the list).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import orjson


class _Messages(msgspec.Struct):
    messages: list[msgspec.Raw]


class _Input(msgspec.Struct):
    input: list[msgspec.Raw]


_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "messages": msgspec.json.Decoder(_Messages), "input": msgspec.json.Decoder(_Input)}
_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_CLOSE = re.compile(rb"[ \t\r\n]*\]")


@dataclass(frozen=True, slots=True)
class Spans:
    start: int  # offset of the first item (-1: none)
    close: int  # offset of the list's "]" (-1: not known)
    ends: list[int]  # offsets just after each of the last items asked for


def _close_after(buf: bytes, pos: int) -> int:
    m = _CLOSE.match(buf, pos)
    return m.end() - 1 if m else -1


def _backwards(items: list[Any], close: int, last: int) -> list[int]:
    """Ends of the last ``last`` items of a compact list whose "]" is at ``close``."""
    end, ends = close, []
    for item in reversed(items[len(items) - last:] if last else []):
        ends.append(end)
        end -= len(orjson.dumps(item)) + 1
    ends.reverse()
    return ends


def spelled(parsed: dict[str, Any], field: str, body: bytes, last: int) -> Spans | None:
    """For a body that is ``orjson.dumps(parsed)``: counted from the other entries' spellings."""
    keys = list(parsed)
    if field not in parsed:
        return None
    i = keys.index(field)

    def entry(k: str) -> int:  # "k":v
        return len(orjson.dumps(k)) + 1 + len(orjson.dumps(parsed[k]))

    opening = 1 + sum(entry(k) + 1 for k in keys[:i]) + len(orjson.dumps(field)) + 1
    close = len(body) - 2 - sum(1 + entry(k) for k in keys[i + 1:])
    if not (0 < opening <= close < len(body)) or body[opening] != 0x5B or body[close] != 0x5D:
        return None
    items = parsed[field]
    ends = _backwards(items, close, last)
    if any(body[e] not in b",]" for e in ends):
        return None
    return Spans(opening + 1 if items else -1, close, ends)


def located(buf: bytes, listed: list[Any], last: int) -> Spans | None:
    """Where orjson's spelling of ``listed`` first occurs in ``buf``."""
    spelling = orjson.dumps(listed)
    probe = spelling[:64]
    at = buf.find(probe)
    while at >= 0 and not buf.startswith(spelling, at):
        at = buf.find(probe, at + 1)
    if at < 0:
        return None
    close = at + len(spelling) - 1
    return Spans(at + 1 if listed else -1, close, _backwards(listed, close, last))


def spans(buf: bytes, field: str | None, skip: int, count: int, last: int) -> Spans:
    """From msgspec's spans of ``buf[field]`` (``field`` None: ``buf`` is the list), after
    ``skip`` leading items; raises ValueError unless ``count`` items follow them."""
    items: list[msgspec.Raw] = _LIST.decode(buf) if field is None else getattr(_DECODERS[field].decode(buf), field)
    if len(items) != skip + count:
        raise ValueError("msgspec and orjson disagree on the items")
    base = np.frombuffer(buf, np.uint8).ctypes.data

    def at(span: msgspec.Raw) -> int:
        offset = int(np.frombuffer(span, np.uint8).ctypes.data) - base
        if not 0 <= offset <= len(buf) - len(span):
            raise ValueError("msgspec copied a span")
        return offset

    ends = [at(s) + len(s) for s in items[len(items) - last:]] if last else []
    first = at(items[skip]) if count else -1
    close = _close_after(buf, at(items[-1]) + len(items[-1])) if items else -1
    return Spans(first, close, ends)
