"""What SGLang 0.5.23 hands the chat template, for chat, Anthropic Messages and Responses bodies.

Precise mode must render the prompt text the engine renders, so this mirrors, field by
field, the engine's path from a request body to ``apply_chat_template(messages,
tools=..., add_generation_prompt=True, **kwargs)`` (facts from the installed sglang
package: ``entrypoints/openai/serving_chat.py``, ``protocol.py``,
``entrypoints/anthropic/serving.py``, ``entrypoints/openai/serving_responses.py``,
``parser/jinja_template_utils.py``):

- ``anthropic_to_chat`` / ``responses_to_chat``: the two agent APIs converted to a chat
  request as the engine converts them, tools, tool calls and tool results included;
- ``template_inputs``: the chat request as the template sees it: each message as its
  pydantic dump with ``None`` fields dropped, ``content`` ``None`` -> ``""``, list content
  kept as text parts (a template that loops over ``message.content``: "openai" format)
  or joined with spaces ("string" format), a tool message's text parts joined with
  spaces, assistant tool-call ``arguments`` parsed to objects; the tools as the engine's
  ``Tool.model_dump()`` (``{"type", "function": {...client's keys in order, then missing
  description/parameters as null}, "defer_loading"}``), none when ``tool_choice`` is
  ``"none"``, only the named one for a named choice, their keys sorted when the tokenizer
  class sorts them (Kimi's ``deep_sort_dict``).

``NotReproducible`` (a ``ValueError``) marks what is left to approximate routing, with a
short reason: images, thinking blocks, server-side tools, a body the engine would refuse.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.nodes

MESSAGE_FIELDS = ("role", "content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools",
                  "prefix")
FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
MEDIA_KEYWORDS = ("image", "audio", "video", "vision")


class NotReproducible(ValueError):
    """This request's prompt cannot be reproduced exactly (it is routed approximately)."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    tool_choice: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs (+ reasoning_effort)


def chat_request(endpoint: str, payload: Mapping[str, Any]) -> ChatRequest:
    if endpoint == "messages":
        return anthropic_to_chat(payload)
    if endpoint == "responses":
        raise NotReproducible("responses: needs the template (responses_to_chat)")
    kwargs = dict(payload.get("chat_template_kwargs") or {})
    if payload.get("reasoning_effort") is not None:
        kwargs = {"reasoning_effort": payload["reasoning_effort"], **kwargs}
    messages = payload.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise NotReproducible("messages")
    return ChatRequest(list(messages), payload.get("tools"), payload.get("tool_choice"), kwargs)


# ---------------------------------------------------------------------- the template's view
def content_format(template: str) -> str:
    """ "openai" when the template loops over a message's content (or names a medium), else "string"."""
    if any(word in template for word in MEDIA_KEYWORDS):
        return "openai"
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, var, "content") for var in ("message", "msg", "m")):
            return "openai"
    return "string"


def _accesses(node: jinja2.nodes.Node, var: str, key: str) -> bool:
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _accesses(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.node, jinja2.nodes.Name) and node.node.name == var
                and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return isinstance(node.node, jinja2.nodes.Name) and node.node.name == var and node.attr == key
    return False


def _text_parts(content: list[Any]) -> list[dict[str, Any]]:
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind is not None:
            raise NotReproducible(f"content part {kind}")
        else:
            raise NotReproducible("content part")
    return parts


def _template_message(message: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    fields = ("role", "content") if message.get("role") == "user" else MESSAGE_FIELDS  # the engine's user model
    out = {k: message[k] for k in fields if message.get(k) is not None}
    if "role" not in out:
        raise NotReproducible("message without a role")
    content = message.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        parts = _text_parts(content)
        out["content"] = " ".join(p["text"] for p in parts) if fmt == "string" else parts
    if out["role"] == "tool" and isinstance(out["content"], list):
        out["content"] = " ".join(p["text"] for p in out["content"])
    calls = message.get("tool_calls")
    if isinstance(calls, list) and out["role"] == "assistant":
        out["tool_calls"] = [_tool_call(c) for c in calls]
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise NotReproducible("tool call")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise NotReproducible("tool call arguments are not JSON") from exc
        if not isinstance(arguments, dict):
            raise NotReproducible("tool call arguments are not an object")
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": arguments}}


def tool_dump(tool: Any) -> dict[str, Any]:
    """A tool as SGLang's ``Tool.model_dump()`` gives it to the template."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise NotReproducible("tool")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise NotReproducible("tool without a name")
    values = {k: fn.get(k) for k in FUNCTION_FIELDS}
    if values["defer_loading"] is None and tool.get("defer_loading") is not None:
        values["defer_loading"] = tool["defer_loading"]
    for k in ("strict", "defer_loading"):
        if values[k] is None:
            del values[k]
    order = [k for k in fn if k in values] + [k for k in values if k not in fn]
    return {"type": tool.get("type", "function"), "function": {k: values[k] for k in order},
            "defer_loading": tool.get("defer_loading")}


def deep_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def template_tools(request: ChatRequest, sort: bool) -> list[dict[str, Any]] | None:
    tools = request.tools
    if not tools or request.tool_choice == "none":
        return None
    if not isinstance(tools, list):
        raise NotReproducible("tools")
    dumped = [tool_dump(t) for t in tools]
    choice = request.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        dumped = [t for t in dumped if t["function"]["name"] == name] or []
    if not dumped:
        return None
    return deep_sorted(dumped) if sort else dumped


def template_messages(request: ChatRequest, fmt: str) -> list[dict[str, Any]]:
    return [_template_message(m, fmt) for m in request.messages]


# ---------------------------------------------------------------------- Anthropic Messages
def _tool_result_contents(content: Any) -> list[Any]:
    """A ``tool_result``'s content as the engine splits it into tool messages."""
    if not isinstance(content, list):
        return [str(content) if content else ""]
    parts = []
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            if item.get("text"):
                parts.append({"type": "text", "text": item["text"]})
        elif kind is not None:
            raise NotReproducible(f"tool_result block {kind}")
    if not parts:
        return [""]
    return [parts[0]["text"]] if len(parts) == 1 else [parts]


def anthropic_to_chat(payload: Mapping[str, Any]) -> ChatRequest:
    """An Anthropic Messages body as the engine converts it to a chat request (text,
    ``tool_use``, text ``tool_result``, custom tools, ``tool_choice``)."""
    raw = payload.get("messages")
    if not isinstance(raw, list) or any(not isinstance(m, dict) or m.get("role") == "system" for m in raw):
        raise NotReproducible("messages: inline system messages or malformed")
    system = payload.get("system")
    parts = [system] if isinstance(system, str) and system.strip() else (
        [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text" and b.get("text")]
        if isinstance(system, list) else [])
    out: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(parts)}] if parts else []
    for msg in raw:
        _anthropic_message(msg, out)
    tools, choice = _anthropic_tools(payload)
    return ChatRequest(out, tools, choice)


def _anthropic_message(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    role, content = msg.get("role"), msg.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise NotReproducible("message content")
    message: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and block.get("text") is not None:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            if not block.get("id"):
                raise NotReproducible("tool_use without an id (the engine makes one up)")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if parts:
                out.append({"role": "user", "content": parts[0]["text"]} if len(parts) == 1 and
                           parts[0]["type"] == "text" else {"role": "user", "content": list(parts)})
                parts = []
            call_id = block.get("tool_use_id") or block.get("id") or ""
            out.extend({"role": "tool", "tool_call_id": call_id, "content": c}
                       for c in _tool_result_contents(block.get("content")))
        else:
            raise NotReproducible(f"content block {kind}")
    if calls:
        message["tool_calls"] = calls
    if parts:
        message["content"] = parts[0]["text"] if len(parts) == 1 else parts
        out.append(message)
    elif calls:
        out.append(message)
    elif role != "user":
        message["content"] = ""
        out.append(message)


def _anthropic_tools(payload: Mapping[str, Any]) -> tuple[list[Any] | None, Any]:
    raw = payload.get("tools")
    tools = []
    for tool in raw if isinstance(raw, list) else []:
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise NotReproducible("server-side Anthropic tool")
        schema = tool.get("input_schema")
        if isinstance(schema, dict) and "type" not in schema:
            schema = {**schema, "type": "object"}  # the engine's validator adds it
        function = {"name": tool.get("name"), "description": tool.get("description") or "",
                    "parameters": schema, "strict": tool.get("strict", False)}
        tools.append({"type": "function", "function": function, "defer_loading": tool.get("defer_loading")})
    choice: Any = "auto" if tools else None
    tc = payload.get("tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        choice = {"none": "none", "auto": "auto", "any": "required"}.get(str(kind), choice)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
    return tools or None, choice


# ---------------------------------------------------------------------- Responses
def responses_to_chat(payload: Mapping[str, Any], inline_system: bool) -> ChatRequest:
    """A Responses body (stateless: no ``previous_response_id``) as the engine converts it:
    ``instructions`` first, input messages, ``function_call`` items as assistant tool calls
    (consecutive assistant items merged), ``function_call_output`` items as tool messages,
    the system messages merged into one leading message unless the template renders them
    inline (``inline_system``)."""
    if payload.get("previous_response_id") is not None:
        raise NotReproducible("previous_response_id (the engine's response store)")
    messages: list[dict[str, Any]] = []
    if payload.get("instructions"):
        messages.append({"role": "system", "content": payload["instructions"]})
    items = payload.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list):
        raise NotReproducible("input")
    for item in items:
        messages.append(_response_item(item))
    messages = _merge_assistants(messages)
    if not inline_system:
        system = [m for m in messages if m.get("role") == "system"]
        if system:
            chunks = [c if isinstance(c, str) else "" for c in (m.get("content") for m in system)]
            messages = [{"role": "system", "content": "\n\n".join(chunks)},
                        *(m for m in messages if m.get("role") != "system")]
    tools = [_response_tool(t) for t in payload.get("tools") or []]
    choice = payload.get("tool_choice", "auto")
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        choice = {"type": "function", "function": {"name": name}} if choice.get("type") == "function" else "auto"
    kwargs = dict(payload.get("chat_template_kwargs") or {})
    effort = (payload.get("reasoning") or {}).get("effort") if isinstance(payload.get("reasoning"), dict) else None
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **kwargs}
    return ChatRequest(messages, tools or None, choice if tools else "none", kwargs)


def _response_item(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise NotReproducible("input item")
    kind = item.get("type")
    if kind == "function_call":
        raw = item.get("arguments")
        if isinstance(raw, str):
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = None
            raw = raw if isinstance(parsed, dict) else "{}"
        else:
            raise NotReproducible("function_call arguments")
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id") or item.get("id"), "type": "function",
                                                    "function": {"name": item.get("name"), "arguments": raw}}]}
    if kind == "function_call_output":
        output = item.get("output", "")
        if isinstance(output, list):
            output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind not in (None, "message") or item.get("role") == "developer":
        raise NotReproducible(f"input item {kind or item.get('role')}")
    content = item.get("content")
    out = {k: v for k, v in item.items() if v is not None and k not in ("id", "status", "type")}
    if isinstance(content, list):
        out["content"] = [_response_part(p) for p in content]
    return out


def _response_part(part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text", "")}
    raise NotReproducible(f"input part {kind}")


def _merge_assistants(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for msg in messages:
        prev = merged[-1] if merged else None
        if msg.get("role") == "assistant" and prev is not None and prev.get("role") == "assistant" and (
                prev.get("phase") == msg.get("phase")):
            prev = merged[-1] = dict(prev)
            new, old = msg.get("content"), prev.get("content")
            if new is not None and new != "":
                if old is None or old == "":
                    prev["content"] = new
                elif isinstance(old, str) and isinstance(new, str):
                    prev["content"] = old + "\n\n" + new
                else:
                    raise NotReproducible("merged assistant content parts")
            if msg.get("tool_calls"):
                prev["tool_calls"] = list(prev.get("tool_calls") or []) + list(msg["tool_calls"])
            continue
        merged.append(msg)
    return merged


def _response_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
        raise NotReproducible("a non-function Responses tool")
    function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters"),
                "strict": tool.get("strict", False), "defer_loading": None}
    return {"type": "function", "function": function}
