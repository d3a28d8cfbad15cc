"""Cheap parsing of an OpenAI-style SSE stream, and the per-request record built from it.

Events are split on blank lines, content chunks are recognised by a byte search, and
only the usage chunk and error events go through ``orjson.loads``: the driver must keep
hundreds of concurrent streams on one core.
"""
from __future__ import annotations

from typing import Any

import orjson

from loadtest.percentile import percentile
from loadtest.results import RequestRecord


class StreamParser:
    """Feeds on raw SSE bytes; keeps token-chunk times, usage and errors."""

    __slots__ = ("buf", "done", "error", "times", "usage")

    def __init__(self) -> None:
        self.buf = b""
        self.times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._event(buf[start:end], now)
            start = end + 2
        self.buf = buf[start:]

    def _event(self, ev: bytes, now: float) -> None:
        if not ev.startswith(b"data: "):
            return
        if (b'"content":"' in ev and b'"content":""' not in ev) or b'"reasoning_content":"' in ev \
                or (b'"text":"' in ev and b'"text":""' not in ev):
            self.times.append(now)
        if b'"usage":{' in ev:
            doc = orjson.loads(ev[6:])
            self.usage = doc.get("usage")
        elif ev.startswith(b'data: {"error"'):
            doc = orjson.loads(ev[6:])
            self.error = str(doc["error"].get("message", doc["error"]))[:300]
        elif ev.startswith(b"data: [DONE]"):
            self.done = True


def build_record(base: dict[str, Any], p: StreamParser, t_send: float, t_end: float, scale: float,
            replica: str | None, keep_itl: bool) -> RequestRecord:
    """One request's record from its parsed stream; times are wall seconds x ``scale``."""
    usage = p.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    n_out = int(usage.get("completion_tokens") or len(p.times))
    ttft = (p.times[0] - t_send) * scale if p.times else None
    gaps = [(b - a) * scale for a, b in zip(p.times, p.times[1:])]
    decode_s = (p.times[-1] - p.times[0]) * scale if len(p.times) > 1 else 0.0
    error = p.error or (None if p.done else "stream ended without [DONE]")
    return RequestRecord(
        **base, status=200, ttft_s=ttft, e2e_s=(t_end - t_send) * scale, output_tokens=n_out,
        output_tps=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None,
        itl_mean_s=sum(gaps) / len(gaps) if gaps else None, itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99), prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"), replica=replica, error=error,
        itl_s=tuple(gaps) if keep_itl else None)
