"""One conversation, three APIs, one rendering (gateway.conversation)."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.conversation import render_chat, render_messages, render_responses

SYSTEM = "You are a coding agent. Follow the repository's conventions."
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def turns(n: int) -> list[dict[str, Any]]:
    """An abstract agent conversation: user asks, assistant calls a tool, tool answers..."""
    out: list[dict[str, Any]] = [{"kind": "user", "text": "Fix the failing test.", "image": True}]
    for i in range(n):
        out.append({"kind": "call", "text": f"Reading file {i}.", "name": "read_file",
                    "args": {"path": f"src/m{i}.py"}, "id": f"c{i}"})
        out.append({"kind": "result", "id": f"c{i}", "text": f"contents of m{i}"})
    return out


def as_chat(conv: list[dict[str, Any]]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in conv:
        if t["kind"] == "user":
            msgs.append({"role": "user", "content": [
                {"type": "text", "text": t["text"]},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]})
        elif t["kind"] == "call":
            msgs.append({"role": "assistant", "content": t["text"], "tool_calls": [
                {"id": "call_" + t["id"], "type": "function",
                 "function": {"name": t["name"], "arguments": json.dumps(t["args"], indent=1)}}]})
        else:
            msgs.append({"role": "tool", "tool_call_id": "call_" + t["id"], "content": t["text"]})
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": SCHEMA}}]
    return {"messages": msgs, "tools": tools}


def as_messages(conv: list[dict[str, Any]]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for t in conv:
        if t["kind"] == "user":
            msgs.append({"role": "user", "content": [
                {"type": "text", "text": t["text"], "cache_control": {"type": "ephemeral"}},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]})
        elif t["kind"] == "call":
            msgs.append({"role": "assistant", "content": [
                {"type": "text", "text": t["text"]},
                {"type": "tool_use", "id": "toolu_" + t["id"], "name": t["name"], "input": t["args"]}]})
        else:
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_" + t["id"], "content": t["text"]}]})
    return {"system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "read_file", "description": "Read a file", "input_schema": SCHEMA}],
            "messages": msgs}


def as_responses(conv: list[dict[str, Any]]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for t in conv:
        if t["kind"] == "user":
            items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": t["text"]},
                {"type": "input_image", "image_url": "data:image/png;base64," + PNG}]})
        elif t["kind"] == "call":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": t["text"]}]})
            items.append({"type": "function_call", "call_id": t["id"], "name": t["name"],
                          "arguments": json.dumps(t["args"])})
        else:
            items.append({"type": "function_call_output", "call_id": t["id"], "output": t["text"]})
    return {"instructions": SYSTEM, "input": items,
            "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
                       "parameters": SCHEMA}]}


def render_all(conv: list[dict[str, Any]]) -> tuple[str, str, str]:
    chat = as_chat(conv)
    return (render_chat(chat["messages"], chat["tools"]), render_messages(as_messages(conv)),
            render_responses(as_responses(conv)))


@pytest.mark.parametrize("n", [0, 1, 5])
def test_three_apis_render_the_same_conversation_alike(n: int) -> None:
    chat, messages, responses = render_all(turns(n))
    assert chat == messages == responses


def test_each_turn_extends_the_previous_rendering() -> None:
    previous = ""
    for n in range(6):
        for rendering in render_all(turns(n)):
            assert rendering.startswith(previous)
        previous = render_all(turns(n))[0]


@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5), max_size=5))
def test_arguments_as_string_or_object_render_alike(args: dict[str, Any]) -> None:
    as_string = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": json.dumps(args)}}]}]
    as_object = {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": args}]}]}
    assert render_chat(as_string) == render_messages(as_object)


def test_cache_control_and_ids_do_not_change_the_rendering() -> None:
    a = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    b = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "x"}}]}]}
    assert render_messages(a) == render_messages(b)


def test_tool_result_blocks_come_before_the_user_text() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "out"}]},
        {"type": "text", "text": "next"}]}]}
    assert render_messages(body) == render_chat([{"role": "tool", "content": "out"}, {"role": "user", "content": "next"}])


def test_bad_shapes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        render_messages({"messages": "x"})
    with pytest.raises(ValueError):
        render_responses({"input": 3})
    assert render_chat([{"role": "user"}], tools="x").startswith("\x01tools\x02\x06<tool:")


# ---- prefix chains through build_context: a Claude Code session over three APIs ---------


def _hashes(endpoint: str, body: dict[str, Any]) -> tuple[int, ...]:
    from gateway.context import ContextConfig, build_context

    full = {"model": "kimi-k2", "max_tokens": 8, **body}
    return build_context(endpoint, json.dumps(full).encode(), {}, "application/json", ContextConfig()).block_hashes


def long_turns(n: int) -> list[dict[str, Any]]:
    """Turns long enough to fill several 256-character blocks each."""
    out = turns(n)
    for t in out:
        t["text"] = (t["text"] + " ") * 40
    return out


def test_claude_code_session_chains_grow_alike_over_every_api() -> None:
    previous: tuple[int, ...] = ()
    for n in range(6):
        conv = long_turns(n)
        chat = as_chat(conv)
        chains = {_hashes("chat", chat), _hashes("messages", as_messages(conv)),
                  _hashes("responses", as_responses(conv))}
        assert len(chains) == 1  # the same blocks whichever API carried the turn
        chain = chains.pop()
        assert len(chain) > len(previous) and chain[:len(previous)] == previous  # turn T+1 extends turn T
        previous = chain


def test_claude_code_variants_render_alike() -> None:
    """System string or blocks, content string or one text block, cache_control anywhere
    (tools, system, the moving last-message marker), is_error on a tool result."""
    base = as_messages(long_turns(2))
    variant = json.loads(json.dumps(base))
    variant["system"] = SYSTEM
    variant["tools"][0]["cache_control"] = {"type": "ephemeral"}
    variant["messages"][-1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    variant["messages"][-1]["content"][0]["is_error"] = False
    assert render_messages(base) == render_messages(variant)
    text_block = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert render_messages(text_block) == render_messages({"messages": [{"role": "user", "content": "hi"}]})
