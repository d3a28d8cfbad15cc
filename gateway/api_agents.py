"""What the gateway checks and reads of the coding agents' own APIs' request bodies.

Claude Code speaks Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``),
Codex speaks OpenAI Responses (``POST /v1/responses``). ``gateway.context.build_context``
calls ``check`` (validation, the model name), ``render`` (the canonical rendering of
``gateway.conversation``, so the prefix chain is the same whichever API carried the
conversation) and ``session_field`` (the body's own session key).

Validation follows what SGLang 0.5.23 itself refuses with a 400 (checked against the
real server on the CPU): Messages need ``model`` (string), ``max_tokens`` (not for
count_tokens), a ``messages`` array (empty only with a ``system`` prompt, which SGLang
counts as a message) of objects whose ``role`` is ``user``, ``assistant`` or ``system``
and whose ``content`` is a string or an array; ``system`` is a string or an array of
blocks. Responses need ``model`` (string) and ``input`` (a
string or an array); ``previous_response_id`` must start with ``resp_``. Each failure
is an ``InvalidRequest``: the caller answers it in the API's own error shape
(``gateway.errors.api_of``), so nothing reaches a replica that the gateway could refuse.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway import conversation
from gateway.errors import InvalidRequest

ENDPOINTS = frozenset({"messages", "count_tokens", "responses"})
ANTHROPIC_ROLES = ("user", "assistant", "system")
RESPONSE_ID_PREFIX = "resp_"


def _model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if model is None:
        raise InvalidRequest("model: Field required", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: Input should be a non-empty string", param="model")
    return model


def _check_messages(data: Mapping[str, Any], need_max_tokens: bool, cached: int) -> None:
    if need_max_tokens and data.get("max_tokens") is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    messages = data.get("messages")
    if messages is None:
        raise InvalidRequest("messages: Field required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages: Input should be a valid list", param="messages")
    if not messages and not cached and not data.get("system"):  # SGLang counts the system prompt as a message
        raise InvalidRequest("Messages cannot be empty.", param="messages")
    _check_message_items(messages, cached)
    system = data.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise InvalidRequest("system: Input should be a string or an array of blocks", param="system")
    _check_object(data, "metadata")


def _check_message_items(messages: list[Any], cached: int) -> None:
    for i, msg in enumerate(messages, cached):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages.{i}: Input should be an object", param="messages")
        if msg.get("role") not in ANTHROPIC_ROLES:
            raise InvalidRequest(f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'",
                                 param="messages")
        if not isinstance(msg.get("content"), (str, list)):
            raise InvalidRequest(f"messages.{i}.content: Input should be a string or an array",
                                 param="messages")


def check_items(endpoint: str, items: list[Any], cached: int) -> None:
    """The per-message checks of ``check`` alone, for messages after ``cached`` checked ones
    whose body's other fields passed ``check`` (``gateway.context_turns``)."""
    if endpoint != "responses":  # Responses items are checked by their rendering
        _check_message_items(items, cached)


def _check_responses(data: Mapping[str, Any]) -> None:
    items = data.get("input")
    if items is None:
        raise InvalidRequest("input: Field required", param="input")
    if not isinstance(items, (str, list)):
        raise InvalidRequest("input: Input should be a string or an array", param="input")
    previous = data.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous.startswith(RESPONSE_ID_PREFIX)):
        raise InvalidRequest(f"Invalid 'previous_response_id': {previous!r}. Expected an ID that begins "
                             f"with '{RESPONSE_ID_PREFIX}'.", param="previous_response_id")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions: Input should be a string", param="instructions")


def _check_object(data: Mapping[str, Any], name: str) -> None:
    value = data.get(name)
    if value is not None and not isinstance(value, dict):
        raise InvalidRequest(f"{name}: Input should be an object", param=name)


def check(endpoint: str, data: Mapping[str, Any], cached: int = 0) -> str:
    """Validate a Messages / count_tokens / Responses body; returns its model name.

    ``cached``: how many messages (``input`` items) came before ``data``'s, checked already
    (``gateway.context_turns`` checks only a later turn's new ones)."""
    model = _model(data)
    if endpoint == "responses":
        _check_responses(data)
    else:
        _check_messages(data, need_max_tokens=endpoint == "messages", cached=cached)
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools: Input should be a valid list", param="tools")
    return model


def render(endpoint: str, data: Mapping[str, Any]) -> str:
    """The canonical rendering (``gateway.conversation``) of a checked body."""
    try:
        if endpoint == "responses":
            return conversation.render_responses(data)
        return conversation.render_messages(data)
    except conversation.ShapeError as exc:
        raise InvalidRequest(str(exc), param="input" if endpoint == "responses" else "messages") from exc


def session_field(endpoint: str, data: Mapping[str, Any]) -> Any:
    """The body's own session key: chat's ``user``, Anthropic's ``metadata.user_id``,
    Responses' ``prompt_cache_key`` (else ``user``)."""
    if endpoint in ("messages", "count_tokens"):
        metadata = data.get("metadata")
        return metadata.get("user_id") if isinstance(metadata, dict) else None
    if endpoint == "responses":
        return data.get("prompt_cache_key") or data.get("user")
    return data.get("user")


def previous_response_id(data: Mapping[str, Any] | None) -> str | None:
    """The checked ``previous_response_id`` of a Responses body, if any."""
    value = data.get("previous_response_id") if data is not None else None
    return value if isinstance(value, str) else None
