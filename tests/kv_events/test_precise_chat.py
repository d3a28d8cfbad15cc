"""What the chat template sees (gateway/precise_chat.py), as SGLang 0.5.23 builds it: tools as
its ``Tool.model_dump()``, messages as their dumps, Responses items as chat messages."""
from __future__ import annotations

import pytest

from gateway.precise_chat import (
    ChatRequest,
    NotReproducible,
    content_format,
    responses_to_chat,
    template_messages,
    template_tools,
    tool_dump,
)


def test_tool_dump_keeps_the_clients_key_order_then_the_missing_fields() -> None:
    tool = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f", "x-extra": 1}}
    assert list(tool_dump(tool)["function"]) == ["parameters", "name", "description"]
    assert tool_dump(tool) == {"type": "function", "defer_loading": None,
                               "function": {"parameters": {"type": "object"}, "name": "f", "description": None}}
    deferred = tool_dump({"type": "function", "defer_loading": True, "function": {"name": "g", "strict": False}})
    assert deferred["function"] == {"name": "g", "strict": False, "defer_loading": True, "description": None,
                                    "parameters": None}


def test_tool_choice_selects_the_tools_the_template_sees() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    assert template_tools(ChatRequest([], tools, "none"), sort=False) is None
    named = template_tools(ChatRequest([], tools, {"type": "function", "function": {"name": "b"}}), sort=False)
    assert named is not None and [t["function"]["name"] for t in named] == ["b"]
    sorted_tools = template_tools(ChatRequest([], tools, "auto"), sort=True)
    assert sorted_tools is not None and list(sorted_tools[0]) == ["defer_loading", "function", "type"]


def test_messages_as_the_template_sees_them() -> None:
    request = ChatRequest([
        {"role": "assistant", "content": None, "name": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"b": 1, "a": [2]}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "user", "content": [{"type": "text", "text": "p"}, {"type": "input_text", "text": "q"}]}])
    openai = template_messages(request, "openai")
    assert openai[0] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "index": None, "type": "function", "function": {"name": "read", "arguments": {"b": 1, "a": [2]}}}]}
    assert openai[1]["content"] == "x y"  # a tool message's text parts joined with spaces
    assert openai[2]["content"] == [{"type": "text", "text": "p"}, {"type": "text", "text": "q"}]
    assert template_messages(request, "string")[2]["content"] == "p q"
    with pytest.raises(NotReproducible):  # the engine refuses arguments that are not a JSON object
        template_messages(ChatRequest([{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]), "openai")
    with pytest.raises(NotReproducible):
        template_messages(ChatRequest([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                          "openai")


def test_content_format_follows_the_templates_loops() -> None:
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert content_format("{% for message in messages %}{% for c in message['content'] %}{{ c.text }}"
                          "{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% macro r(msg) %}{% for c in msg.content %}{% endfor %}{% endmacro %}") == "openai"
    assert content_format("{{ 'image' }}") == "openai"


def test_responses_convert_as_the_engine_does() -> None:
    body = {"instructions": "Be brief.", "tools": [
        {"type": "function", "name": "read", "description": "Read.", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"p": 1}', "id": "fc_1",
             "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "t"},
                                                                          {"type": "input_text", "text": "wo"}]},
            {"role": "system", "content": "Later."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}],
             "status": "completed", "id": "msg_1"}]}
    chat = responses_to_chat(body, inline_system=False)
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\nLater."},
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]
    assert chat.tools == [{"type": "function", "function": {
        "name": "read", "description": "Read.", "parameters": {"type": "object"}, "strict": False,
        "defer_loading": None}}]
    assert chat.tool_choice == "auto"
    inline = responses_to_chat(body, inline_system=True)
    assert [m["role"] for m in inline.messages][:2] == ["system", "user"] and inline.messages[-2]["role"] == "system"
    assert responses_to_chat({"input": "hi"}, False) == ChatRequest([{"role": "user", "content": "hi"}], None, "none")
    with pytest.raises(NotReproducible):
        responses_to_chat({"input": "hi", "previous_response_id": "resp_1"}, False)
