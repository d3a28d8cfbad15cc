"""Response bodies and stream events of the agents' APIs on the simulated replica.

Wire side, as the real server serialises it:

- Messages: ``{"id":"msg_..","type":"message","role":"assistant","content":[text block],
  "model","stop_reason":"end_turn"|"max_tokens","usage":{"input_tokens" (uncached),
  "output_tokens", "cache_read_input_tokens" (only when > 0)}}``; streams are
  ``event: message_start`` (usage with the cache read), ``content_block_start``,
  ``content_block_delta`` (text_delta) per update, ``content_block_stop``,
  ``message_delta`` (stop_reason, output_tokens), ``message_stop``; no ``[DONE]``.
- Responses: the ``response`` object (``usage.input_tokens`` includes
  ``input_tokens_details.cached_tokens``; ``status`` "incomplete" with
  ``incomplete_details.reason = max_output_tokens`` on a length stop); streams are
  ``response.created``, ``response.in_progress``, ``output_item.added``,
  ``content_part.added``, ``output_text.delta`` per update, ``output_text.done``,
  ``content_part.done``, ``output_item.done``, then ``response.completed`` or
  ``response.incomplete``, each with a ``sequence_number``; no ``[DONE]``.
"""
from __future__ import annotations

from typing import Any

import orjson

from loadtest.simulator.intake import Job
from loadtest.simulator.protocol import Finish


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def anthropic_usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    usage = {"input_tokens": prompt - cached, "output_tokens": output}
    if cached:
        usage["cache_read_input_tokens"] = cached
    return usage


def _stop_reason(f: Finish) -> str:
    return "max_tokens" if f.reason == "length" else "end_turn"


def message_body(job: Job, text: str, f: Finish) -> dict[str, Any]:
    return {"id": job.rid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": job.model, "stop_reason": _stop_reason(f),
            "usage": anthropic_usage(f.prompt_tokens, f.cached_tokens, f.completion_tokens)}


def message_head(job: Job, cached: int) -> bytes:
    message = {"id": job.rid, "type": "message", "role": "assistant", "content": [], "model": job.model,
               "usage": anthropic_usage(len(job.prompt_ids), cached, 0)}
    return (_event("message_start", {"type": "message_start", "message": message})
            + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}))


def message_delta(text: str) -> bytes:
    return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": text}})


def message_tail(f: Finish) -> bytes:
    return (_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": _stop_reason(f)},
                                       "usage": {"output_tokens": f.completion_tokens}})
            + _event("message_stop", {"type": "message_stop"}))


def _output_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [_part(text)]
    return {"id": item_id, "content": content, "role": "assistant",
            "status": "in_progress" if text is None else "completed", "type": "message", "phase": "final_answer"}


def _part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def response_object(job: Job, body: dict[str, Any], text: str | None, f: Finish | None) -> dict[str, Any]:
    """The ``response`` object; ``f`` None: in progress (``response.created``)."""
    done = f is not None
    incomplete = f is not None and f.reason == "length"
    usage = None if f is None else {
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f.prompt_tokens + f.completion_tokens}
    return {
        "id": job.rid, "object": "response", "created_at": job.created, "model": job.model,
        "output": [_output_item("msg_" + job.rid[5:], text)] if done and text is not None else [],
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True) is not False, "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}} if done else None, "top_p": body.get("top_p"),
        "truncation": "disabled", "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


class ResponseEvents:
    """The numbered events of one Responses stream."""

    def __init__(self, job: Job, body: dict[str, Any]) -> None:
        self.job = job
        self.body = body
        self.seq = 0
        self.item_id = "msg_" + job.rid[5:]

    def _ev(self, name: str, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self.seq
        self.seq += 1
        return _event(name, data)

    def head(self) -> bytes:
        obj = response_object(self.job, self.body, None, None)
        return (self._ev("response.created", {"type": "response.created", "response": obj})
                + self._ev("response.in_progress", {"type": "response.in_progress", "response": dict(obj)})
                + self._ev("response.output_item.added", {"item": _output_item(self.item_id, None),
                                                          "output_index": 0, "type": "response.output_item.added"})
                + self._ev("response.content_part.added", {
                    "content_index": 0, "item_id": self.item_id, "output_index": 0, "part": _part(""),
                    "type": "response.content_part.added"}))

    def delta(self, text: str) -> bytes:
        return self._ev("response.output_text.delta", {
            "content_index": 0, "delta": text, "item_id": self.item_id, "logprobs": [], "output_index": 0,
            "type": "response.output_text.delta"})

    def tail(self, text: str, f: Finish) -> tuple[bytes, dict[str, Any]]:
        obj = response_object(self.job, self.body, text, f)
        name = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
        ids = {"item_id": self.item_id, "output_index": 0}
        events = (self._ev("response.output_text.done", {"content_index": 0, **ids, "logprobs": [], "text": text,
                                                         "type": "response.output_text.done"})
                  + self._ev("response.content_part.done", {"content_index": 0, **ids, "part": _part(text),
                                                            "type": "response.content_part.done"})
                  + self._ev("response.output_item.done", {"item": _output_item(self.item_id, text),
                                                           "output_index": 0, "type": "response.output_item.done"})
                  + self._ev(name, {"type": name, "response": obj}))
        return events, obj
