"""Precise mode for the TikToken tokenizer form (Kimi K2's) against a REAL SGLang CPU server (issue 42).

The server loads the tiny TikToken-form model (``loadtest/sglang_cpu/kimi_model.py``:
``tiktoken.model``, ``tokenization_kimi.TikTokenTokenizer`` written here, loaded with
``--trust-remote-code`` as SGLang loads Kimi's; a chat template in Kimi's structure) and
publishes KV events; one gateway process (``kvgate serve``) subscribes. The model declares
tools as Kimi K2.5+ does (TypeScript style, ``tools_ts_str``). Multi-turn sessions over the
three APIs an agent speaks, tool calls and tool results included:

- ``/v1/chat/completions`` with ``tools``, assistant ``tool_calls`` and ``tool`` messages;
- ``/v1/messages`` with tools, ``tool_use`` and ``tool_result`` blocks;
- ``/v1/responses`` with function tools, ``function_call`` and ``function_call_output`` items.

Asserted: the gateway's predicted cached tokens (``x-kvgate-expected-cached-tokens``) equal
the engine's reported cached tokens within one page for >= 99% of the requests, every
prediction made precisely (``kvgate_prediction_error_tokens_count{mode="precise"}``), and
the caches hit (a later turn reuses its earlier turns). A wrong token id anywhere (the
template, the tools' dump, the tokenizer) shifts every later page hash: the next turn is
then predicted ~0 against hundreds cached, so the bound is a proof of exact ids. The
server is the package's ``tiktoken_server`` (conftest.py; page size 4, KV pool large enough
that nothing is evicted: eviction is covered by test_precise.py), shared with
test_two_models.py; this module's gateway is its own.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.sglang_cpu.cli import TIKTOKEN_MODEL_NAME
from loadtest.sglang_cpu.server import SGLangServer
from tests.integration.conftest import Gateway, metric_value, start_gateway, wait_until
from tests.sglang_real.conftest import TIKTOKEN_PAGE

pytestmark = pytest.mark.sglang_real

MODEL = TIKTOKEN_MODEL_NAME
PAGE = TIKTOKEN_PAGE
TURNS = 4
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                            "parameters": {"type": "object", "required": ["path"],
                                                           "properties": {"path": {"type": "string"}}}}},
         {"type": "function", "function": {"parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                                            "name": "grep", "strict": True}},
         {"type": "function", "function": {  # shaped like a coding agent's: every part of the TypeScript form
             "name": "Bash", "description": "Run a command.\n\nUse with care.",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["command"],
                            "$defs": {"Env": {"type": "object", "description": "variables",
                                              "additionalProperties": {"type": "string"}}},
                            "properties": {
                                "command": {"type": "string", "description": "the command", "maxLength": 2000},
                                "timeout": {"type": "integer", "minimum": 1, "default": 120},
                                "mode": {"type": "string", "enum": ["fg", "bg"]},
                                "env": {"$ref": "#/$defs/Env"},
                                "files": {"type": "array", "items": {"type": "string", "description": "a path"}},
                                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}]
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
                   {"name": "bash", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
RESPONSE_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SYSTEM = "You are a coding agent in a repository of a cache-aware gateway. Use the tools. " * 3


@pytest.fixture(scope="module")
def gateway(tiktoken_server: SGLangServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway([tiktoken_server.url], Path(tmp_path_factory.mktemp("gw-tiktoken")) / "gateway.log")
    try:
        wait_until(lambda: 'kvgate_precise_replicas{state="precise"} 1.0' in gw.metrics(), 60.0, "precise")
        yield gw
    finally:
        gw.proc.stop()


def post(gw: Gateway, path: str, body: dict[str, Any], session: str) -> tuple[httpx.Response, int]:
    r = httpx.post(gw.url + path, json=body, headers={"x-kvgate-session": session}, timeout=120.0,
                   trust_env=False)
    assert r.status_code == 200, r.text
    return r, int(r.headers["x-kvgate-expected-cached-tokens"])


def events_settle(gw: Gateway, timeout_s: float = 10.0) -> None:
    """Until the applied-events counter stops moving (the last request's stores arrived)."""
    deadline = time.monotonic() + timeout_s
    last, since = gw.metric("kvgate_kv_events_applied_total"), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.3:
        time.sleep(0.05)
        now = gw.metric("kvgate_kv_events_applied_total")
        if now != last:
            last, since = now, time.monotonic()


def chat_session(gw: Gateway, n: int) -> list[tuple[int, int, int]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Session {n}: find the page hash code."}]
    out = []
    for i in range(TURNS):
        r, expected = post(gw, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": TOOLS,
                                                         "max_tokens": 4, "temperature": 0.0}, f"chat-{n}")
        usage = r.json()["usage"]
        out.append((expected, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
        call_id = f"functions.read_file:{i}"
        messages.append({"role": "assistant", "content": "Reading." if i % 2 else None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": f"gateway/m{i}.py", "n": i})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": [{"type": "text", "text": f"def f{i}(x):\n    return x * {i}\n"},
                                     {"type": "text", "text": "# 中文 comment é"}] if i % 2 else f"result {i} ok"})
        messages.append({"role": "user", "content": f"Now step {i + 1}."})
        events_settle(gw)
    return out


def messages_session(gw: Gateway, n: int) -> list[tuple[int, int, int]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": f"Session {n}: fix it."}]}]
    out = []
    for i in range(TURNS):
        r, expected = post(gw, "/v1/messages", {"model": MODEL, "max_tokens": 4, "system": SYSTEM,
                                                "tools": ANTHROPIC_TOOLS, "messages": messages}, f"msg-{n}")
        usage = r.json()["usage"]
        cached = usage.get("cache_read_input_tokens") or 0
        out.append((expected, cached, usage["input_tokens"] + cached))
        use_id = f"toolu_{n}_{i}"
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Let me look ({i})."},
            {"type": "tool_use", "id": use_id, "name": "bash", "input": {"cmd": f"grep -n page gateway/{i}.py"}}]})
        result: Any = (f"gateway/{i}.py:1: page" if i % 2 else
                       [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}])
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": result},
                                                     {"type": "text", "text": f"Continue with {i}."}]})
        events_settle(gw)
    return out


def responses_session(gw: Gateway, n: int) -> list[tuple[int, int, int]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "input_text",
                                                                 "text": f"Session {n}: read the router."}]}]
    out = []
    for i in range(TURNS):
        r, expected = post(gw, "/v1/responses", {"model": MODEL, "instructions": SYSTEM, "input": items,
                                                 "tools": RESPONSE_TOOLS, "max_output_tokens": 4}, f"resp-{n}")
        usage = r.json()["usage"]
        out.append((expected, usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]))
        call = f"call_{n}_{i}"
        items.append({"type": "function_call", "call_id": call, "name": "read_file",
                      "arguments": json.dumps({"path": f"gateway/router{i}.py"})})
        items.append({"type": "function_call_output", "call_id": call, "output": f"class Router{i}: ..."})
        items.append({"role": "user", "content": f"And step {i + 1}?"})
        events_settle(gw)
    return out


def test_predictions_equal_the_engine_for_chat_messages_and_responses_with_tools(gateway: Gateway) -> None:
    results: dict[str, list[tuple[int, int, int]]] = {}
    for n in range(2):
        results[f"chat-{n}"] = chat_session(gateway, n)
        results[f"messages-{n}"] = messages_session(gateway, n)
        results[f"responses-{n}"] = responses_session(gateway, n)
    flat = [(k, *r) for k, rows in results.items() for r in rows]
    close = [abs(expected - cached) <= PAGE for _, expected, cached, _ in flat]
    print("precise tiktoken real:", flat)
    assert sum(close) >= 0.99 * len(flat), [row for row, ok in zip(flat, close, strict=True) if not ok]
    assert all(cached > 100 for key, rows in results.items() for _, cached, _ in rows[1:]), results  # turns reuse
    precise = metric_value(gateway.metrics(), 'kvgate_prediction_error_tokens_count{mode="precise"}')
    assert precise >= len(flat), precise  # every request was predicted precisely, none fell back
    assert metric_value(gateway.metrics(), 'kvgate_precise_tokenize_total{outcome="ok"}') >= len(flat)


def test_the_admin_view_shows_the_tiktoken_form(gateway: Gateway, tiktoken_server: SGLangServer) -> None:
    replica = gateway.replicas()[tiktoken_server.url]
    assert replica["precise"]["mode"] == "precise" and replica["precise"]["tokenizer"] == "tiktoken", replica
    assert replica["precise"]["tool_declaration"] == "typescript", replica  # Kimi K2.5+'s tools_ts_str
