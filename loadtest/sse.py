"""Cheap parsing of the three APIs' SSE streams, and the per-request record built from it.

Events are split on blank lines, content chunks are recognised by a byte search, and
only the usage-bearing events and error events go through ``orjson.loads``: the driver
must keep hundreds of concurrent streams on one core. ``StreamParser(api)``:

- ``chat``: ``data:`` chunks; a token chunk has non-empty ``content`` / ``reasoning_content``
  / ``text``; usage in the final chunk; ``data: [DONE]`` ends it.
- ``messages`` (Anthropic): ``event:`` + ``data:``; a token chunk is a
  ``content_block_delta``; the prompt and ``cache_read_input_tokens`` come in
  ``message_start``, the output tokens in ``message_delta``; ``message_stop`` ends it.
- ``responses``: a token chunk is ``response.output_text.delta``; usage in the final
  ``response.completed`` / ``response.incomplete`` (``input_tokens_details.cached_tokens``).

Usage is kept in chat's shape (``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``; Anthropic's prompt = ``input_tokens`` +
``cache_read_input_tokens``) so ``build_record`` reads one shape.
"""
from __future__ import annotations

from typing import Any

import orjson

from loadtest.percentile import percentile
from loadtest.results import RequestRecord


class StreamParser:
    """Feeds on raw SSE bytes; keeps token-chunk times, usage and errors."""

    __slots__ = ("api", "buf", "done", "error", "response_id", "times", "usage")

    def __init__(self, api: str = "chat") -> None:
        self.api = api
        self.buf = b""
        self.times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self.response_id: str | None = None  # responses: the id in response.created

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            ev = buf[start:end]
            if self.api == "chat":
                self._event(ev, now)
            else:
                self._agent_event(ev, now)
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

    def _agent_event(self, ev: bytes, now: float) -> None:
        """An Anthropic or Responses event: ``event: <name>\\ndata: <json>``."""
        name, _, data = ev.partition(b"\ndata: ")
        name = name.removeprefix(b"event: ").strip()
        if name in (b"content_block_delta", b"response.output_text.delta"):
            if b'"text":""' not in data and b'"delta":""' not in data:
                self.times.append(now)
        elif name in (b"message_start", b"message_delta", b"response.completed", b"response.incomplete"):
            doc = orjson.loads(data)
            inner = doc.get("message") or doc.get("response") or doc
            self._agent_usage(inner.get("usage") if isinstance(inner, dict) else None)
            self.done = self.done or name.startswith(b"response.")
        elif name == b"message_stop":
            self.done = True
        elif name == b"response.created":
            response = orjson.loads(data).get("response")
            self.response_id = response.get("id") if isinstance(response, dict) else None
        elif name in (b"error", b"response.failed"):
            doc = orjson.loads(data)
            err = doc.get("error") if isinstance(doc.get("error"), dict) else doc
            self.error = str(err.get("message", err))[:300]

    def _agent_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        out = self.usage if self.usage is not None else {}
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):  # responses: input_tokens includes the cached ones
            out["prompt_tokens_details"] = {"cached_tokens": details.get("cached_tokens")}
            out["prompt_tokens"] = usage.get("input_tokens")
        elif "input_tokens" in usage:  # anthropic: input_tokens excludes the cache read
            cached = int(usage.get("cache_read_input_tokens") or 0)
            out["prompt_tokens_details"] = {"cached_tokens": cached}
            out["prompt_tokens"] = int(usage["input_tokens"]) + cached + int(usage.get("cache_creation_input_tokens")
                                                                            or 0)
        if usage.get("output_tokens"):
            out["completion_tokens"] = usage["output_tokens"]
        self.usage = out


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
