"""``event:`` + ``data:`` SSE events (Anthropic Messages, OpenAI Responses) as (name, JSON)."""
from __future__ import annotations

from typing import Any

import orjson


def agent_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        name, _, data = block.strip().partition(b"\ndata: ")
        if name.startswith(b"event: "):
            out.append((name[7:].decode(), orjson.loads(data)))
    return out
