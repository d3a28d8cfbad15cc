"""build_context: validation (4xx), session keys, hashing, sizes."""
from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers

from gateway import prefix_hash as ph
from gateway.context import (
    MAX_JSON_DEPTH,
    ContextConfig,
    HashingConfig,
    SessionConfig,
    build_context,
    session_keys,
)
from gateway.conversation import render_chat
from gateway.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType

CFG = ContextConfig()
JSON = "application/json"


def ctx_of(body: Any, endpoint: str = "chat", headers: dict[str, str] | None = None, cfg: ContextConfig = CFG) -> Any:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return build_context(endpoint, raw, headers or {}, JSON, cfg)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}], **extra}


def test_chat_context() -> None:
    ctx = ctx_of(chat(stream=True, max_tokens=7), headers={"x-request-id": "rid-1"})
    assert (ctx.endpoint, ctx.model, ctx.stream, ctx.max_tokens, ctx.request_id) == ("chat", "m", True, 7, "rid-1")
    text = render_chat([{"role": "user", "content": "x" * 1000}])
    assert ctx.block_hashes == ph.chain_hashes(text.encode(), "m", 256, 8192) and len(ctx.block_hashes) == 3
    assert ctx.prompt_chars == len(text) and ctx.est_prompt_tokens == len(text) // 4 and ctx.block_tokens == 64
    assert ctx.routing_key == f"p:{ctx.block_hashes[0]:016x}" and ctx.routing_text == ""
    assert ctx_of(chat(max_completion_tokens=9)).max_tokens == 9
    assert ctx_of(chat()).request_id != ctx_of(chat()).request_id


def test_missing_model_is_default() -> None:
    body = chat()
    del body["model"]
    assert ctx_of(body).model == "default"


def test_routing_text_only_when_asked() -> None:
    cfg = ContextConfig(hashing=HashingConfig(keep_routing_text=True))
    body = {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}
    assert ctx_of(body, cfg=cfg).routing_text == "a b"
    assert ctx_of({"prompt": ["p", "q"]}, "completions", cfg=cfg).routing_text == "p q"


def test_completions_and_generate() -> None:
    c = ctx_of({"model": "m", "prompt": "y" * 600, "max_tokens": 3}, "/v1/completions")
    assert c.endpoint == "completions" and len(c.block_hashes) == 2 and c.max_tokens == 3
    ids = ctx_of({"prompt": list(range(200))}, "completions")
    assert ids.est_prompt_tokens == 200 and len(ids.block_hashes) == 3 and ids.prompt_chars == 800
    g = ctx_of({"text": "z" * 300, "sampling_params": {"max_new_tokens": 5}, "stream": False}, "generate")
    assert g.endpoint == "generate" and g.max_tokens == 5 and len(g.block_hashes) == 1
    gi = ctx_of({"input_ids": [[1] * 64, [2] * 64]}, "/generate")
    assert gi.est_prompt_tokens == 128 and len(gi.block_hashes) == 2
    short = ctx_of({"prompt": "hi"}, "completions")
    assert short.block_hashes == () and short.routing_key and short.routing_key.startswith("p:")


@pytest.mark.parametrize(
    ("body", "endpoint", "param"),
    [
        (b"{not json", "chat", None),
        (b"[1, 2]", "chat", None),
        ({"model": "m"}, "chat", "messages"),
        ({"messages": []}, "chat", "messages"),
        ({"messages": "hi"}, "chat", "messages"),
        ({"messages": [{"content": "x"}]}, "chat", "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "chat", "messages"),
        (chat(model=3), "chat", "model"),
        (chat(max_tokens="5"), "chat", "max_tokens"),
        (chat(max_tokens=1.5), "chat", "max_tokens"),
        (chat(max_tokens=True), "chat", "max_tokens"),
        (chat(max_tokens=-1), "chat", "max_tokens"),
        (chat(stream="yes"), "chat", "stream"),
        ({"model": "m"}, "completions", "prompt"),
        ({"prompt": ""}, "completions", "prompt"),
        ({"prompt": []}, "completions", "prompt"),
        ({"prompt": [1, "a"]}, "completions", "prompt"),
        ({"prompt": [-1]}, "completions", "prompt"),
        ({"prompt": {"a": 1}}, "completions", "prompt"),
        ({"sampling_params": {}}, "generate", "text"),
        ({"text": "a", "sampling_params": []}, "generate", "sampling_params"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "generate", "max_new_tokens"),
    ],
)
def test_bad_input_is_400(body: Any, endpoint: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        ctx_of(body, endpoint)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_content_type_and_size() -> None:
    raw = orjson.dumps(chat())
    for ok in (None, "application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        build_context("chat", raw, {}, ok, CFG)
    with pytest.raises(UnsupportedMediaType) as err:
        build_context("chat", raw, {}, "text/plain", CFG)
    assert err.value.status == 415
    small = ContextConfig(hashing=HashingConfig(max_body_bytes=100))
    with pytest.raises(PayloadTooLarge) as err2:
        build_context("chat", raw, {}, JSON, small)
    assert err2.value.status == 413
    with pytest.raises(ValueError):
        build_context("embeddings", raw, {}, JSON, CFG)


def test_max_blocks_bounds_the_chain() -> None:
    cfg = ContextConfig(hashing=HashingConfig(max_blocks=4))
    assert len(ctx_of(chat(messages=[{"role": "user", "content": "x" * 100_000}]), cfg=cfg).block_hashes) == 4


S = SessionConfig()


@pytest.mark.parametrize(
    ("headers", "user", "session", "parent"),
    [
        ({}, None, None, None),
        ({}, "alice", "user:alice", None),
        ({"x-kvgate-session": "k", "x-session-id": "o"}, "alice", "k", None),
        ({"x-claude-code-session-id": "S"}, None, "S", None),
        ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A"}, None, "A", "S"),
        ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A", "x-claude-code-parent-agent-id": "P"},
         None, "A", "P"),
        ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "S"}, None, "S", None),
        ({"session-id": "codex"}, "u", "codex", None),
        ({"x-session-id": "oc", "x-parent-session-id": "ocp"}, None, "oc", "ocp"),
    ],
)
def test_session_keys(headers: dict[str, str], user: Any, session: str | None, parent: str | None) -> None:
    keys = session_keys(headers, user, S)
    assert (keys.session, keys.parent) == (session, parent)


def test_session_keys_configurable_and_bounded() -> None:
    cfg = SessionConfig(headers=["x-mine"], parent_headers=[], use_user_field=False)
    assert session_keys({"x-mine": "m", "x-kvgate-session": "k"}, "u", cfg).session == "m"
    assert session_keys({}, "u", cfg).session is None
    long = session_keys({"x-kvgate-session": "z" * 1000}, None, S).session
    assert long is not None and len(long) < 50
    ctx = ctx_of(chat(), headers={"x-kvgate-session": "k"})
    assert ctx.routing_key == "k@m" and ctx.session.session == "k@m"  # per model (gateway.context.per_model)


def _depth(value: object) -> int:
    """Reference nesting depth (arrays and objects), recursive."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _nested(shape: list[int]) -> object:
    """A value nested len(shape) levels deep: 0 wraps in a list, 1 in an object."""
    value: object = "leaf"
    for kind in reversed(shape):
        value = [value, 1] if kind == 0 else {"k": value, "n": None}
    return value


@settings(max_examples=60, deadline=None, derandomize=True)
@example([0] * (MAX_JSON_DEPTH - 1), "x_extra")  # exactly at the limit
@example([1] * MAX_JSON_DEPTH, "x_extra")  # one beyond
@example([0] * 300, "tools")  # beyond what orjson can re-serialize
@given(st.lists(st.integers(0, 1), min_size=0, max_size=400), st.sampled_from(["x_extra", "tools", "content"]))
def test_deep_nesting_is_a_400_beyond_the_limit_never_a_500(shape: list[int], where: str) -> None:
    nested = _nested(shape)
    message: dict[str, object] = {"role": "user", "content": [{"type": "image", "data": nested}]
                                  if where == "content" else "hi"}
    doc: dict[str, object] = {"model": "m", "messages": [message]}
    if where == "tools":
        doc["tools"] = [nested]
    elif where == "x_extra":
        doc["x_extra"] = nested
    body = json.dumps(doc).encode()  # orjson itself refuses to write beyond 254 levels
    if _depth(doc) > MAX_JSON_DEPTH:
        with pytest.raises(InvalidRequest, match="nested deeper"):
            build_context("chat", body, {}, "application/json", ContextConfig())
    else:
        assert build_context("chat", body, {}, "application/json", ContextConfig()).model == "m"


# ---- the agents' APIs: Anthropic Messages, count_tokens, OpenAI Responses ---------------


def message_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "system": "s" * 600, "messages": [{"role": "user", "content": "x" * 600}],
            **extra}


def test_messages_context_hashes_like_the_same_chat() -> None:
    ctx = ctx_of(message_body(stream=True), "messages", headers={"x-claude-code-session-id": "cc"})
    assert (ctx.endpoint, ctx.model, ctx.stream, ctx.max_tokens, ctx.session.session) == ("messages", "m", True, 5, "cc@m")
    same = ctx_of({"model": "m", "messages": [{"role": "system", "content": "s" * 600},
                                              {"role": "user", "content": "x" * 600}]})
    assert ctx.block_hashes == same.block_hashes and len(ctx.block_hashes) == 4
    counted = ctx_of({k: v for k, v in message_body().items() if k != "max_tokens"}, "count_tokens")
    assert counted.block_hashes == ctx.block_hashes and counted.max_tokens is None


def test_responses_context() -> None:
    ctx = ctx_of({"model": "m", "instructions": "s" * 600, "input": "x" * 600, "max_output_tokens": 9,
                  "previous_response_id": "resp_1"}, "responses")
    assert (ctx.endpoint, ctx.max_tokens) == ("responses", 9)
    assert ctx.block_hashes == ctx_of(message_body(), "messages").block_hashes
    assert ctx.payload is not None and ctx.payload["previous_response_id"] == "resp_1"


@pytest.mark.parametrize(("endpoint", "body", "message"), [
    ("messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, "model: Field required"),
    ("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    ("messages", {"model": "m", "max_tokens": 1}, "messages: Field required"),
    ("messages", {"model": "m", "max_tokens": 1, "messages": {}}, "messages: Input should be a valid list"),
    ("messages", {"model": "m", "max_tokens": 1, "messages": []}, "Messages cannot be empty."),
    ("messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user"}]}, "content"),
    ("messages", {"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("messages", {**message_body(), "system": 3}, "system"),
    ("messages", {**message_body(), "metadata": "u"}, "metadata"),
    ("messages", {**message_body(), "stream": "yes"}, "stream"),
    ("count_tokens", {"model": "m"}, "messages: Field required"),
    ("responses", {"model": "m"}, "input: Field required"),
    ("responses", {"input": "x"}, "model: Field required"),
    ("responses", {"model": "m", "input": 3}, "input"),
    ("responses", {"model": "m", "input": "x", "previous_response_id": "abc"}, "resp_"),
    ("responses", {"model": "m", "input": "x", "instructions": 1}, "instructions"),
    ("responses", {"model": "m", "input": "x", "max_output_tokens": -2}, "max_output_tokens"),
    ("responses", {"model": "m", "input": [3]}, "input"),
    ("responses", {"model": "m", "input": "x", "tools": {}}, "tools"),
])
def test_agent_api_validation(endpoint: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace(".", r"\.")) as err:
        ctx_of(body, endpoint)
    assert err.value.status == 400
    if endpoint != "responses":
        assert err.value.body("anthropic")["error"]["type"] == "invalid_request_error"


def test_agent_session_keys_from_the_body() -> None:
    claude = ctx_of(message_body(metadata={"user_id": "user_abc_account_x_session_s1"}), "messages")
    assert claude.session.session == "user:user_abc_account_x_session_s1@m"
    headers_win = ctx_of(message_body(metadata={"user_id": "u"}), "messages", {"x-claude-code-session-id": "h"})
    assert headers_win.session.session == "h@m"
    codex = ctx_of({"model": "m", "input": "x", "prompt_cache_key": "conv-1", "user": "u"}, "responses")
    assert codex.session.session == "user:conv-1@m"
    assert ctx_of({"model": "m", "input": "x", "user": "u"}, "responses").session.session == "user:u@m"
    assert ctx_of({"model": "m", "input": "x"}, "responses", {"session_id": "cx"}).session.session == "cx@m"


SESSION_CFG = SessionConfig()
HEADER_NAMES = st.sampled_from(sorted(SESSION_CFG.named) + ["x-request-id", "user-agent", "content-type"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(headers=st.dictionaries(HEADER_NAMES, st.sampled_from(["", "s1", "s2", "p" * 200])),
       user=st.sampled_from([None, "", "u1", 7]))
def test_session_keys_without_a_session_header_are_the_full_rules(headers: dict[str, str], user: Any) -> None:
    """A request naming no session header skips the header lookups; the answer is the full
    rules' (an empty ``x-kvgate-session`` sends a request down them and changes nothing)."""
    full = session_keys({"x-kvgate-session": "", **headers}, user, SESSION_CFG)
    assert session_keys(headers, user, SESSION_CFG) == full
    # a Starlette ``Headers`` (the count_tokens route passes the request's): the same answer
    raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
    assert session_keys(Headers(raw=raw), user, SESSION_CFG) == full


def test_request_ids_are_unique_and_a_forked_process_has_its_own() -> None:
    import os

    from gateway.context import new_request_id

    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 24 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids, sent back
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert child[:16] != ids[0][:16] and child not in ids


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("generate", {"text": "hello"}),
        ("completions", {"prompt": "hello"}),
        ("chat", chat()),
        ("messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
        ("responses", {"model": "m", "input": "x"}),
    ],
)
@pytest.mark.parametrize("field", ["rid", "request_id"])
def test_client_chosen_upstream_ids_are_refused(endpoint: str, body: dict[str, Any], field: str) -> None:
    """``rid`` / ``request_id`` would become the request's or the stored response's id
    upstream (issue 41: B sending A's response id as its request_id re-pinned it): 400 in
    the API's own shape, whatever the value; ``null`` (the default) passes."""
    for value in ("resp_victim", ["a", "b"], 3):
        with pytest.raises(InvalidRequest) as err:
            ctx_of({**body, field: value}, endpoint)
        assert err.value.status == 400 and err.value.param == field
        shape = err.value.body("anthropic" if endpoint == "messages" else "openai")
        assert shape["error"]["type"] == "invalid_request_error"
    assert ctx_of({**body, field: None}, endpoint).payload[field] is None
