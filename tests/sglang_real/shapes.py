"""JSON shapes for differential tests: key sets and value types, never values.

``shape(obj)`` maps a JSON value to its skeleton (objects keep their keys, lists keep the
shape of their first element, scalars become ``"number" | "string" | "bool" | "null"``);
``differences(real, sim)`` lists the paths where two skeletons disagree, as
``"path: real X, sim Y"`` strings, so an assertion message shows every difference at once.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson


def shape(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    if isinstance(obj, bool):
        return "bool"
    if isinstance(obj, (int, float)):
        return "number"
    if obj is None:
        return "null"
    return "string"


def differences(real: Any, sim: Any, path: str = "", allowed: Iterable[str] = ()) -> list[str]:
    """Paths where the skeletons of ``real`` and ``sim`` differ, minus ``allowed`` paths
    (``a.b`` for a key, ``a[]`` for list elements) and everything below them."""
    skip = set(allowed)
    return _diff(shape(real), shape(sim), path, skip)


def _diff(a: Any, b: Any, path: str, skip: set[str]) -> list[str]:
    if path in skip:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if sub in skip:
                continue
            if key not in b:
                out.append(f"{sub}: only in real ({_short(a[key])})")
            elif key not in a:
                out.append(f"{sub}: only in sim ({_short(b[key])})")
            else:
                out += _diff(a[key], b[key], sub, skip)
        return out
    if isinstance(a, list) and isinstance(b, list) and a and b:
        return _diff(a[0], b[0], path + "[]", skip)
    return [] if a == b else [f"{path}: real {_short(a)}, sim {_short(b)}"]


def _short(skeleton: Any) -> str:
    text = orjson.dumps(skeleton).decode()
    return text if len(text) <= 120 else text[:117] + "..."


def sse_events(body: bytes) -> list[Any]:
    """``data:`` payloads of an SSE body: parsed JSON, or the string ``"[DONE]"``."""
    events: list[Any] = []
    for block in body.split(b"\n\n"):
        line = block.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events
