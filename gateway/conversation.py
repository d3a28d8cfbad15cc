"""One canonical rendering of a conversation, whatever API carried it.

Coding agents speak three APIs: OpenAI chat completions, Anthropic Messages (Claude
Code) and OpenAI Responses (Codex). The prefix index only works across them if the same
conversation renders to the same text in each, and if turn T's rendering is a prefix of
turn T+1's. So every API is first read as the same sequence of *turns*, then rendered:

    tools   -> "\\x01tools\\x02" + per tool "\\x06" name "\\x07" description "\\x07" parameters + "\\x03"
    turn    -> "\\x01" role "\\x02" parts "\\x03"       role: system | user | assistant | tool
    parts   -> text as is; a tool call "\\x04" name "\\x05" arguments; an image "<image:digest>";
               anything else "<type:digest>" (xxh3 of its canonical JSON: a 2 MB image costs one hash)

How each API maps onto turns:

| | chat completions | Anthropic Messages | OpenAI Responses |
|---|---|---|---|
| system | ``messages[role=system/developer]`` | top-level ``system`` (string or text blocks) | ``instructions``, ``input`` items of role system/developer |
| user text | ``content`` string or text parts | text blocks | ``input`` string, ``input_text`` parts |
| assistant | ``content`` + ``tool_calls`` | text + ``tool_use`` blocks | ``output_text`` messages + the ``function_call`` items after them |
| tool result | ``role: tool`` messages | ``tool_result`` blocks (each its own tool turn, before the user turn's other blocks) | ``function_call_output`` items |
| tools | ``{"type":"function","function":{...}}`` | ``{"name","description","input_schema"}`` | ``{"type":"function","name",...}`` |

What is left out on purpose: tool-call ids (``call_...`` vs ``toolu_...`` name the same
call differently), ``cache_control`` markers, ``is_error``; tool-call arguments are
compared as canonical JSON (sorted keys), so a JSON string (chat, Responses) equals the
same object (Anthropic). Text blocks of one turn are concatenated without a separator.
A structure this module cannot read raises ``ShapeError`` (a ``ValueError``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

_xxh = xxhash.xxh3_64_intdigest
_CANON = orjson.OPT_SORT_KEYS
TEXT_TYPES = frozenset({"text", "input_text", "output_text"})


class ShapeError(ValueError):
    """A request structure this module cannot read (the gateway answers 400)."""


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool", "function": "tool"}


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces; ValueError for what JSON cannot hold (or nests too deep)."""
    try:
        return orjson.dumps(value, option=_CANON).decode()
    except orjson.JSONEncodeError as exc:
        raise ShapeError(f"cannot render as JSON: {exc}") from exc


def _digest(value: Any) -> str:
    data = value.encode() if isinstance(value, str) else canonical_json(value).encode()
    return f"{_xxh(data):016x}"


def _arguments(value: Any) -> str:
    """Tool-call arguments as canonical JSON: a JSON string and its object render alike."""
    if isinstance(value, str):
        return _canonical_string(value)
    return canonical_json(value)


@functools.lru_cache(maxsize=16384)
def _canonical_string(text: str) -> str:
    """A JSON string's canonical form; memoized, since every turn re-sends the whole
    history and so the same arguments strings (bounded: 16k entries)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text  # not JSON: the text itself
    return canonical_json(value)


def _image_digest(part: Mapping[str, Any]) -> str | None:
    """The identity of an image part in any of the three APIs (its data, else its URL)."""
    kind = part.get("type")
    url: Any = None
    if kind == "image_url":  # chat: {"image_url": {"url": "data:...;base64,XXX" | "https://..."}}
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
    elif kind == "input_image":  # responses: {"image_url": "...", "file_id": ...}
        url = part.get("image_url") or part.get("file_id")
    elif kind == "image":  # anthropic: {"source": {"type": "base64", "data"} | {"type": "url", "url"}}
        source = part.get("source")
        if isinstance(source, dict):
            url = source.get("data") or source.get("url") or source.get("file_id")
    else:
        return None
    if not isinstance(url, str):
        return _digest(part)
    if url.startswith("data:") and "," in url:
        url = url.split(",", 1)[1]
    return _digest(url)


def _part(part: Any, out: list[str]) -> None:
    """One content part/block of a user, system, assistant or tool turn."""
    if isinstance(part, str):
        out.append(part)
        return
    if not isinstance(part, dict):
        out.append(f"<part:{_digest(part)}>")
        return
    kind = part.get("type")
    text = part.get("text")
    if kind in TEXT_TYPES and isinstance(text, str):
        out.append(text)
    elif kind == "tool_use":  # anthropic assistant block
        out += ["\x04", str(part.get("name", "")), "\x05", _arguments(part.get("input", {}))]
    elif (image := _image_digest(part)) is not None:
        out.append(f"<image:{image}>")
    else:
        clean = {k: v for k, v in part.items() if k != "cache_control"}
        out.append(f"<{kind if isinstance(kind, str) else 'part'}:{_digest(clean)}>")


def _content(content: Any, out: list[str]) -> None:
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            _part(part, out)
    elif content is not None:
        out.append(f"<content:{_digest(content)}>")


def _open(role: str, out: list[str]) -> None:
    out += ["\x01", role, "\x02"]


def _tools(tools: Any, out: list[str]) -> None:
    """The tools, in the order given, whichever API's shape they come in (an entry of no
    known shape is rendered by its digest: validating it is the replica's business)."""
    if not tools:
        return
    out.append("\x01tools\x02")
    for tool in tools if isinstance(tools, list) else [tools]:
        inner = tool.get("function") if isinstance(tool, dict) else None
        spec: dict[str, Any] = inner if isinstance(inner, dict) else tool if isinstance(tool, dict) else {}
        params = spec.get("parameters", spec.get("input_schema"))
        name = spec.get("name")
        if isinstance(name, str) and (params is not None or spec.get("type") in (None, "function")):
            description = spec.get("description")
            out += ["\x06", name, "\x07", description if isinstance(description, str) else "", "\x07",
                    canonical_json(params) if params is not None else ""]
        else:  # a server/built-in tool (web search, computer use, ...) or an unknown shape
            out += ["\x06", f"<tool:{_digest(tool)}>"]
    out.append("\x03")


def _chat_tool_calls(calls: Any, out: list[str]) -> None:
    if not isinstance(calls, list):
        return
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out += ["\x04", str(fn.get("name", "")), "\x05", _arguments(fn.get("arguments", ""))]
        else:
            out += ["\x04", f"<call:{_digest(call)}>"]


def _tools_head(tools: Any) -> str:
    out: list[str] = []
    _tools(tools, out)
    return "".join(out)


def chat_head(body: Mapping[str, Any]) -> str:
    """What chat renders before its ``messages``: the tools."""
    return _tools_head(body.get("tools"))


def chat_item(msg: Any, out: list[str], state: str | None = None) -> None:
    """One chat message (see ``Layout.item``)."""
    if not isinstance(msg, dict):
        raise ShapeError("'messages' entries must be objects")
    role = msg.get("role")
    _open(ROLES.get(role, str(role)) if isinstance(role, str) else "", out)
    content = msg.get("content")
    if isinstance(content, str):  # (most turns: ``_content``'s first case, without the call)
        out.append(content)
    else:
        _content(content, out)
    if "tool_calls" in msg:
        _chat_tool_calls(msg["tool_calls"], out)
    if isinstance(msg.get("function_call"), dict):
        _chat_tool_calls([{"function": msg["function_call"]}], out)
    out.append("\x03")


def render_chat(messages: Sequence[Any], tools: Any = None) -> str:
    """OpenAI chat completions: ``tools``, then each message."""
    out: list[str] = [_tools_head(tools)]
    for msg in messages:
        chat_item(msg, out)
    return "".join(out)


def _anthropic_user(blocks: list[Any], out: list[str]) -> None:
    """A user turn: each tool_result first as its own tool turn, then the other blocks."""
    rest = []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            _open("tool", out)
            _content(block.get("content"), out)
            out.append("\x03")
        else:
            rest.append(block)
    if rest:
        _open("user", out)
        for block in rest:
            _part(block, out)
        out.append("\x03")


def messages_head(body: Mapping[str, Any]) -> str:
    """What Anthropic Messages render before ``messages``: the tools, the top-level ``system``."""
    out: list[str] = [_tools_head(body.get("tools"))]
    system = body.get("system")
    if system:
        _open("system", out)
        _content(system, out)
        out.append("\x03")
    return "".join(out)


def messages_item(msg: Any, out: list[str], state: str | None = None) -> None:
    """One Anthropic message (see ``Layout.item``)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ShapeError("'messages' entries must be objects with a string 'role'")
    content = msg.get("content")
    if msg["role"] == "user" and isinstance(content, list):
        _anthropic_user(content, out)
        return
    role: str = msg["role"]
    _open(ROLES.get(role, role), out)
    _content(content, out)
    out.append("\x03")


def render_messages(body: Mapping[str, Any]) -> str:
    """Anthropic Messages: ``tools``, the top-level ``system``, then each message."""
    out: list[str] = [messages_head(body)]
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ShapeError("'messages' must be an array")
    for msg in messages:
        messages_item(msg, out)
    return "".join(out)


def responses_item(item: Any, out: list[str], open_role: str | None) -> str | None:
    """One Responses ``input`` item; returns the turn left open (function calls join the
    assistant turn before them, so a message's turn closes only when the next item starts)."""
    if isinstance(item, str):
        item = {"type": "message", "role": "user", "content": item}
    if not isinstance(item, dict):
        raise ShapeError("'input' items must be objects or strings")
    kind = item.get("type", "message")
    if kind == "function_call":
        if open_role != "assistant":
            responses_end(open_role, out)
            _open("assistant", out)
        out += ["\x04", str(item.get("name", "")), "\x05", _arguments(item.get("arguments", ""))]
        return "assistant"
    responses_end(open_role, out)
    if kind == "function_call_output":
        _open("tool", out)
        _content(item.get("output"), out)
        out.append("\x03")
        return None
    if kind == "message":
        role = item.get("role", "user")
        opened = ROLES.get(role, str(role)) if isinstance(role, str) else "user"
        _open(opened, out)
        _content(item.get("content"), out)
        return opened
    _open("item", out)  # reasoning, web_search_call, ...: opaque but part of the prefix
    out += [f"<{kind}:{_digest(item)}>", "\x03"]
    return None


def responses_end(open_role: str | None, out: list[str]) -> None:
    """Close the turn ``responses_item`` left open, if any."""
    if open_role is not None:
        out.append("\x03")


def responses_head(body: Mapping[str, Any]) -> str:
    """What Responses render before ``input``: the tools, ``instructions`` as the system turn."""
    out: list[str] = [_tools_head(body.get("tools"))]
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out += ["\x01system\x02", instructions, "\x03"]
    return "".join(out)


def render_responses(body: Mapping[str, Any]) -> str:
    """OpenAI Responses: ``tools``, ``instructions`` as the system turn, then ``input``."""
    out: list[str] = [responses_head(body)]
    items = body.get("input")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list):
        raise ShapeError("'input' must be a string or an array")
    state: str | None = None
    for item in items:
        state = responses_item(item, out, state)
    responses_end(state, out)
    return "".join(out)


def _no_end(state: str | None, out: list[str]) -> None:
    return None


@dataclass(frozen=True)
class Layout:
    """How one API's body renders, piece by piece: ``head(body)``, then each item of
    ``body[field]`` appended by ``item(item, out, state) -> state`` (the state is the turn
    a Responses item leaves open, else None), then ``end(state, out)``. The ``render_*``
    functions above are exactly this sequence, so a rendering resumed at an item boundary
    (``gateway.context_turns``) equals the whole one."""

    field: str
    head: Callable[[Mapping[str, Any]], str]
    item: Callable[[Any, list[str], str | None], str | None]
    end: Callable[[str | None, list[str]], None]


LAYOUTS: dict[str, Layout] = {
    "chat": Layout("messages", chat_head, chat_item, _no_end),
    "messages": Layout("messages", messages_head, messages_item, _no_end),
    "count_tokens": Layout("messages", messages_head, messages_item, _no_end),
    "responses": Layout("input", responses_head, responses_item, responses_end),
}
