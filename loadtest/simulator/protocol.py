"""SGLang 0.5.23 wire shapes, as bytes: responses, SSE chunks and error bodies.

Every builder here reproduces the exact serialisation of the real server (key order and
null fields included), as recorded in the reference contract (sglang-0.5.23-contract.md
§1.8-1.11) and the 0.5.23 pydantic/msgspec models:

- chat chunks (msgspec, ``omit_defaults``): no ``usage`` key on content/finish chunks;
  the first chunk carries ``role`` and empty content; the finish chunk has an empty
  delta; the usage chunk (``choices: []``) keeps nulls (``model_dump_json``);
- completions chunks (pydantic): ``"usage":null`` on every chunk, ``finish_reason`` on
  the last text chunk, usage chunk serialised with ``exclude_none``;
- ``/generate``: cumulative ``text``/``output_ids`` per update and ``meta_info``;
- errors: ``ErrorResponse`` ``{"object","message","type","param","code"}`` for 400s,
  ``{"error": {...}}`` mid-stream.

Nothing here touches the engine: callers pass plain values (a :class:`Finish`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.simulator.requests import RequestResult

DONE = b"data: [DONE]\n\n"
EOS_TOKEN_ID = 163586  # Kimi K2's <|im_end|>: the ``matched_stop`` of a natural stop
SSE_HEADERS = {"cache-control": "no-cache"}


@dataclass(frozen=True, slots=True)
class Finish:
    """The outcome of one request, in the terms the wire shapes need."""

    reason: str  # "stop" | "length" | "abort"
    matched_stop: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_device: int
    cached_host: int
    spec_verify_ct: int = 0


def finish_of(r: RequestResult) -> Finish:
    """An engine result in the terms the wire shapes need."""
    matched = EOS_TOKEN_ID if r.finish_reason == "stop" else None
    return Finish(r.finish_reason, matched, r.prompt_tokens, r.completion_tokens,
                  r.cached_tokens, r.cached_device, r.cached_host, r.spec_verify_ct)


def refused(r: RequestResult) -> bool:
    """Aborted before any output: the engine could not take it (too long for the pool)."""
    return r.finish_reason == "abort" and r.completion_tokens == 0


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(f: Finish) -> dict[str, Any]:
    """``UsageInfo`` as with ``--enable-cache-report`` (cached_tokens always present)."""
    return {
        "prompt_tokens": f.prompt_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "completion_tokens": f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def metadata(f: Finish) -> dict[str, Any]:
    """The response ``metadata`` of chat and completions (weights never change here)."""
    return {"weight_version": "default",
            "weight_versions": [{"version": "default", "start": 0, "end": f.completion_tokens}]}


def cached_details(f: Finish) -> dict[str, int]:
    return {"device": f.cached_device, "host": f.cached_host}


# ---- chat -----------------------------------------------------------------------------


def chat_response(rid: str, created: int, model: str, text: str, f: Finish,
                  with_sglext: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None},
            "logprobs": None, "finish_reason": f.reason, "matched_stop": f.matched_stop,
        }],
        "usage": usage(f),
        "metadata": metadata(f),
    }
    if with_sglext:
        body["sglext"] = {"cached_tokens_details": cached_details(f)}
    return body


def _chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any],
                finish: str | None = None, matched: int | None = None,
                logprobs: dict[str, Any] | None = None) -> bytes:
    return sse({
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish, "matched_stop": matched}],
    })


def chat_first_chunk(rid: str, created: int, model: str) -> bytes:
    delta = {"reasoning_content": None, "role": "assistant", "content": ""}
    return _chat_chunk(rid, created, model, delta)


def chat_content_chunk(rid: str, created: int, model: str, text: str,
                       logprobs: dict[str, Any] | None = None) -> bytes:
    return _chat_chunk(rid, created, model, {"reasoning_content": None, "content": text}, logprobs=logprobs)


def chat_tail(rid: str, created: int, model: str, f: Finish, with_sglext: bool,
              include_usage: bool) -> list[bytes]:
    """The finish chunk, the sglext and usage chunks when asked, then ``[DONE]``."""
    out = [_chat_chunk(rid, created, model, {"reasoning_content": None}, f.reason, f.matched_stop)]
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": []}
    if with_sglext:
        out.append(sse({**head, "usage": None, "sglext": {"cached_tokens_details": cached_details(f)}}))
    if include_usage:
        out.append(sse({**head, "usage": usage(f)}))
    out.append(DONE)
    return out


# ---- completions ----------------------------------------------------------------------


def completion_response(rid: str, created: int, model: str, text: str, f: Finish,
                        with_sglext: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": f.reason, "matched_stop": f.matched_stop}],
        "usage": usage(f),
        "metadata": metadata(f),
    }
    if with_sglext:
        body["sglext"] = {"cached_tokens_details": cached_details(f)}
    return body


def completion_chunk(rid: str, created: int, model: str, text: str,
                     f: Finish | None) -> bytes:
    return sse({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": f.reason if f else None,
                     "matched_stop": f.matched_stop if f else None}],
        "usage": None,
    })


def completion_tail(rid: str, created: int, model: str, f: Finish, with_sglext: bool,
                    include_usage: bool) -> list[bytes]:
    """The sglext and usage chunks when asked (usage with ``exclude_none``), then ``[DONE]``."""
    head = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": []}
    out = []
    if with_sglext:
        out.append(sse({**head, "usage": None, "sglext": {"cached_tokens_details": cached_details(f)}}))
    if include_usage:
        u = usage(f)
        del u["completion_tokens_details"]  # exclude_none
        out.append(sse({**head, "usage": u}))
    out.append(DONE)
    return out


# ---- /generate ------------------------------------------------------------------------


def generate_meta(rid: str, f: Finish | None, prompt_tokens: int, completion_tokens: int,
                  e2e_latency_s: float, spec_draft_tokens: int) -> dict[str, Any]:
    """``meta_info`` in the tokenizer manager's key order; finish fields when finished."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": None, "prompt_tokens": prompt_tokens,
        "weight_version": "default", "num_retractions": 0,
        "reasoning_tokens": 0, "completion_tokens": completion_tokens, "cached_tokens": 0,
        "weight_versions": [{"version": "default", "start": 0, "end": completion_tokens}],
    }
    if f is None:
        return meta
    meta["finish_reason"] = finish_reason_obj(f)
    meta["cached_tokens"] = f.cached_tokens
    if f.cached_tokens:
        meta["cached_tokens_details"] = cached_details(f)
    meta["dp_rank"] = None
    meta["e2e_latency"] = e2e_latency_s
    if spec_draft_tokens > 1 and f.spec_verify_ct > 0:
        verify = f.spec_verify_ct
        correct = max(f.completion_tokens - verify, 0)
        proposed = verify * (spec_draft_tokens - 1)
        meta.update({
            "spec_accept_rate": correct / proposed, "spec_accept_length": f.completion_tokens / verify,
            "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify,
        })
    return meta


def finish_reason_obj(f: Finish) -> dict[str, Any]:
    if f.reason == "length":
        return {"type": "length", "length": f.completion_tokens}
    if f.reason == "abort":
        return {"type": "abort", "message": "Abort before prefill"}
    return {"type": "stop", "matched": f.matched_stop}


# ---- errors ---------------------------------------------------------------------------


def error_response(message: str, type_: str = "BadRequestError", code: int = 400,
                   param: str | None = None) -> dict[str, Any]:
    """``ErrorResponse.model_dump()`` (the OpenAI-serving error body of SGLang)."""
    return {"object": "error", "message": message, "type": type_, "param": param, "code": code}


def validation_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """What SGLang's ``RequestValidationError`` handler returns (400, "Bad Request")."""
    plural = "s" if len(errors) != 1 else ""
    text = f"{len(errors)} validation error{plural}:\n" + "".join(f"  {e}\n" for e in errors)
    return error_response(f"{text.rstrip()} {errors}", "Bad Request", 400)


def media_type_error() -> dict[str, Any]:
    return validation_error([{
        "loc": ["header", "content-type"],
        "msg": "Unsupported Media Type: Only 'application/json' is allowed",
        "type": "value_error",
    }])


def json_error(detail: str) -> dict[str, Any]:
    return validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                              "input": {}, "ctx": {"error": detail}}])


def missing_field(field: str) -> dict[str, Any]:
    return validation_error([{"type": "missing", "loc": ("body", field), "msg": "Field required",
                              "input": "..."}])


def stream_error(message: str, type_: str, code: int) -> bytes:
    """The mid-stream error event, followed by ``[DONE]``."""
    return sse({"error": error_response(message, type_, code)}) + DONE


def model_not_found(model: str) -> dict[str, Any]:
    return {"error": {"message": f"The model '{model}' does not exist",
                      "type": "invalid_request_error", "param": "model",
                      "code": "model_not_found"}}
