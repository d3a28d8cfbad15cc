"""The coding agents' APIs on the simulated replica: Anthropic Messages and OpenAI Responses.

Request side (pure functions): a body becomes the same :class:`~.intake.Job` chat makes
(the prompt is the chat template of the equivalent chat messages, so a conversation
sent through ``/v1/messages``, ``/v1/responses`` or ``/v1/chat/completions`` hits the
same prefix cache), plus the chat messages themselves (the Responses store keeps them).
Validation and error bodies as SGLang 0.5.23 answers them (checked on the real CPU
server): Anthropic's ``{"type":"error","error":{"type":"invalid_request_error",...}}``
for Messages; OpenAI's nested ``{"error":{"message","type","param","code":<status>}}``
for Responses, whose ``model`` must be the served one (404 otherwise).

Wire side (response bodies and stream events): :mod:`.api_wire`.
"""
from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadtest.simulator import intake, tokenizer
from loadtest.simulator.intake import BadRequest, Job, Limits

MESSAGES, RESPONSES = "messages", "responses"
STORE_MAX = 10_000  # stored responses per replica (oldest forgotten)


def anthropic_error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def responses_error(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}


class AgentBadRequest(BadRequest):
    """A refused agent-API body, with its status (400, or 404 for a model / previous id)."""

    def __init__(self, body: dict[str, Any], status: int = 400) -> None:
        super().__init__(body)
        self.status = status


def _json_body(raw: bytes, error: Any) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise AgentBadRequest(error("0: JSON decode error")) from None
    if not isinstance(body, dict):
        raise AgentBadRequest(error("Input should be a valid dictionary or object"))
    return body


# ---- request side: bodies -> chat messages -----------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(p) if not isinstance(p, dict) else str(p.get("text", "")) if p.get("type") in
                       ("text", "input_text", "output_text") else tokenizer._part_text(p) for p in content)
    return "" if content is None else str(content)


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    return {"function": {"name": str(name or ""), "arguments": arguments}}


def anthropic_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic system + messages as chat messages (tool_result blocks become tool turns)."""
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"])})
    for msg in body["messages"]:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append({"role": msg["role"], "content": _text(content)})
            continue
        calls = [_call(b.get("name"), b.get("input", {})) for b in content
                 if isinstance(b, dict) and b.get("type") == "tool_use"]
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                out.append({"role": "tool", "content": _text(b.get("content"))})
        rest = [b for b in content if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result"))]
        if rest or calls:
            out.append({"role": msg["role"], "content": _text(rest), **({"tool_calls": calls} if calls else {})})
    return out


def responses_chat(items: Any) -> list[dict[str, Any]]:
    """Responses ``input`` items as chat messages (function calls join an assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            item = {"role": "user", "content": item}
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "function_call":
            out.append({"role": "assistant", "content": "",
                        "tool_calls": [_call(item.get("name"), item.get("arguments", ""))]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _text(item.get("output"))})
        elif kind == "message":
            role = item.get("role", "user")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"))})
    return out


def _check_anthropic(body: dict[str, Any], need_max_tokens: bool) -> None:
    for name in ("model", *(("max_tokens",) if need_max_tokens else ()), "messages"):
        if body.get(name) is None:
            raise AgentBadRequest(anthropic_error(f"{name}: Field required"))
    messages = body["messages"]
    if not isinstance(messages, list):
        raise AgentBadRequest(anthropic_error("messages: Input should be a valid list"))
    if not messages and not body.get("system"):  # the system prompt counts as a message
        raise AgentBadRequest(anthropic_error("Messages cannot be empty."))
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise AgentBadRequest(anthropic_error(
                f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'"))


def messages_job(raw: bytes, limits: Limits) -> Job:
    body = _json_body(raw, anthropic_error)
    _check_anthropic(body, need_max_tokens=True)
    try:
        max_new = intake.int_field(body, "max_tokens")
    except BadRequest:
        raise AgentBadRequest(anthropic_error("max_tokens: Input should be a non-negative integer")) from None
    tools = body.get("tools")
    ids = tokenizer.encode(tokenizer.render_chat(anthropic_chat(body), tools if isinstance(tools, list) else None))
    return intake.make_job(MESSAGES, {**body, "rid": "msg_" + uuid.uuid4().hex}, ids, max_new,
                           body.get("ignore_eos", False), limits)


def count_tokens(raw: bytes) -> dict[str, int]:
    body = _json_body(raw, anthropic_error)
    _check_anthropic(body, need_max_tokens=False)
    tools = body.get("tools")
    return {"input_tokens": tokenizer.count_tokens(
        tokenizer.render_chat(anthropic_chat(body), tools if isinstance(tools, list) else None))}


@dataclass
class ReplicaResponseStore:
    """The replica's own Responses store (SGLang ``--enable-response-store``), bounded."""

    responses: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    pending: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = field(default_factory=dict)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        rid = response["id"]
        self.responses[rid] = response
        self.conversations[rid] = conversation
        while len(self.responses) > STORE_MAX:
            old, _ = self.responses.popitem(last=False)
            self.conversations.pop(old, None)

    def delete(self, rid: str) -> bool:
        self.conversations.pop(rid, None)
        return self.responses.pop(rid, None) is not None


def responses_job(raw: bytes, limits: Limits, store: ReplicaResponseStore) -> Job:
    """A Responses body -> a Job; its request body and conversation wait in ``store.pending``."""
    body = _json_body(raw, responses_error)
    if body.get("input") is None:
        raise AgentBadRequest(responses_error("input: Field required", param="input"))
    model = body.get("model")
    if not isinstance(model, str):
        raise AgentBadRequest(responses_error("model: Input should be a valid string", param="model"))
    if model != limits.served_model_name:
        raise AgentBadRequest(responses_error(f"The model '{model}' does not exist", 404, "model"), 404)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in store.conversations:
            raise AgentBadRequest(responses_error(f"Response with id '{previous}' not found.", 404,
                                                  "response_id"), 404)
        history = store.conversations[previous]
    if not isinstance(body["input"], (str, list)):
        raise AgentBadRequest(responses_error("input: Input should be a valid string or list", param="input"))
    conversation = [*history, *responses_chat(body["input"])]
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    tools = body.get("tools")
    ids = tokenizer.encode(tokenizer.render_chat([*system, *conversation], tools if isinstance(tools, list) else None))
    try:
        max_new = intake.int_field(body, "max_output_tokens")
    except BadRequest as e:
        raise AgentBadRequest(responses_error(str(e))) from None
    job = intake.make_job(RESPONSES, {**body, "rid": "resp_" + uuid.uuid4().hex}, ids, max_new,
                          body.get("ignore_eos", False), limits)
    store.pending[job.rid] = (body, conversation)
    return job
