"""Request bodies in: parse and validate once, build the :class:`Job` the engine runs.

Pure functions over the raw body (orjson; no pydantic on the hot path). Errors are
:class:`BadRequest` carrying SGLang 0.5.23's 400 body: the ``RequestValidationError``
shape (``ErrorResponse``, type "Bad Request") for a wrong content type, invalid JSON or a
missing field on the OpenAI routes, ``{"error": ...}`` on ``/generate``.

Defaults follow SGLang 0.5.23: chat has no ``max_tokens`` default (the rest of the
context), completions 16, ``/generate`` 128. ``ignore_eos`` is read from the body
(chat, completions) or ``sampling_params`` (generate). The response id is ``rid`` or a
bare ``uuid4().hex``. Prompts: chat renders the simulator's chat template
(``tokenizer.render_chat``) then encodes it, and a chat request without ``tools`` is
*prose* (``Job.prose``: the profile's prose accept length; agent-shaped otherwise, and
completions and ``/generate`` too); completions take a string or token ids
(a one-element batch of either); ``/generate`` takes ``text`` or ``input_ids``.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from loadtest.simulator import protocol, tokenizer

CHAT, COMPLETION, GENERATE = "chat", "completion", "generate"


class BadRequest(Exception):
    """A request body SGLang would refuse; carries the 400 body."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", ""))
        self.body = body


@dataclass(frozen=True, slots=True)
class Job:
    """One generation request, as the engine and the wire shapes need it."""

    kind: str  # CHAT | COMPLETION | GENERATE
    rid: str
    model: str
    prompt_ids: Any  # numpy uint32 array
    max_new_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    sglext: bool
    seed: int
    created: int
    prose: bool = False  # a chat without tools: decoded at the profile's prose accept length


@dataclass(frozen=True, slots=True)
class Limits:
    """What a job's defaults depend on: the model name and context, the rids in flight."""

    served_model_name: str
    context_length: int
    in_flight: Container[str]


def parse_openai_body(content_type: str, raw: bytes) -> dict[str, Any]:
    """The JSON object of an OpenAI-route body (content type must be application/json)."""
    ctype = content_type.lower().split(";", 1)[0].strip()
    if ctype != "application/json":
        raise BadRequest(protocol.media_type_error())
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(protocol.json_error(str(e))) from e
    if not isinstance(body, dict):
        raise BadRequest(protocol.validation_error([{
            "type": "model_attributes_type", "loc": ("body",),
            "msg": "Input should be a valid dictionary or object to extract fields from"}]))
    return body


def int_field(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(protocol.error_response(f"{key} must be a non-negative integer"))
            return value
    return None


def completion_prompt_ids(prompt: Any) -> Any:
    """Completions ``prompt``: a string, token ids, or a one-element batch of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return token_ids(prompt, "prompt")
    raise BadRequest(protocol.error_response(
        "prompt must be a string or a list of token ids (batches are not simulated)", param="prompt"))


def token_ids(ids: list[Any], field: str) -> Any:
    if not all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
        raise BadRequest(protocol.error_response(f"{field} must be a list of token ids", param=field))
    return np.asarray(ids, dtype=np.uint32)


def make_job(kind: str, body: dict[str, Any], prompt_ids: Any, max_new: int | None,
             ignore_eos: object, limits: Limits) -> Job:
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        rid = uuid.uuid4().hex
    if rid in limits.in_flight:
        raise BadRequest(protocol.error_response(f"Duplicate request ID: {rid}"))
    options = body.get("stream_options") or {}
    seed = body.get("seed")
    room = max(limits.context_length - len(prompt_ids), 1)
    return Job(
        kind=kind, rid=rid, model=str(body.get("model") or limits.served_model_name),
        prompt_ids=prompt_ids, max_new_tokens=room if max_new is None else max_new,
        ignore_eos=bool(ignore_eos), stream=bool(body.get("stream")),
        include_usage=kind != GENERATE and isinstance(options, dict)
        and bool(options.get("include_usage")),
        sglext=bool(body.get("return_cached_tokens_details")),
        seed=seed if isinstance(seed, int) else 0, created=int(time.time()))


def chat_job(content_type: str, raw: bytes, limits: Limits) -> Job:
    body = parse_openai_body(content_type, raw)
    messages = body.get("messages")
    if messages is None:
        raise BadRequest(protocol.missing_field("messages"))
    if not isinstance(messages, list):
        raise BadRequest(protocol.validation_error([{
            "type": "list_type", "loc": ("body", "messages"), "msg": "Input should be a valid list"}]))
    tools = body.get("tools")
    tools = tools if isinstance(tools, list) else None
    ids = tokenizer.encode(tokenizer.render_chat(messages, tools))
    job = make_job(CHAT, body, ids, int_field(body, "max_completion_tokens", "max_tokens"),
                   body.get("ignore_eos", False), limits)
    return job if tools else dataclasses.replace(job, prose=True)


def completion_job(content_type: str, raw: bytes, limits: Limits) -> Job:
    body = parse_openai_body(content_type, raw)
    if "prompt" not in body:
        raise BadRequest(protocol.missing_field("prompt"))
    max_new = int_field(body, "max_tokens")
    return make_job(COMPLETION, body, completion_prompt_ids(body["prompt"]),
                    16 if max_new is None else max_new, body.get("ignore_eos", False), limits)


def generate_job(raw: bytes, limits: Limits) -> Job:
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as e:
        raise BadRequest({"error": f"invalid JSON body: {e}"}) from e
    if not isinstance(body, dict):
        raise BadRequest({"error": "request body must be a JSON object"})
    if isinstance(body.get("text"), str):
        ids: Any = tokenizer.encode(body["text"])
    elif isinstance(body.get("input_ids"), list):
        ids = token_ids(body["input_ids"], "input_ids")
    else:
        raise BadRequest({"error": "Either text or input_ids should be provided."})
    params = body.get("sampling_params") or {}
    max_new = int_field(params, "max_new_tokens")
    return make_job(GENERATE, body, ids, 128 if max_new is None else max_new,
                    params.get("ignore_eos", False), limits)
