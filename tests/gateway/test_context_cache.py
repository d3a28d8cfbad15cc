"""The cache of earlier turns (gateway.context_cache, gateway.context_turns): the same
RequestContext and the same errors as the full path, for every body; bounded."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context import MAX_JSON_DEPTH, ContextConfig, HashingConfig, build_context
from gateway.context_cache import PER_KEY, ContextCache
from gateway.context_turns import LazyPayload
from gateway.errors import GatewayError

JSON = "application/json"
FIELD = {"chat": "messages", "messages": "messages", "count_tokens": "messages", "responses": "input"}


def cached(**hashing: Any) -> ContextConfig:
    """The cache on for bodies of any size (the default skips those under 16 KB)."""
    return ContextConfig(hashing=HashingConfig(prefix_cache_min_bytes=0, **hashing))


def off(cfg: ContextConfig) -> ContextConfig:
    """The same configuration without the cache."""
    return ContextConfig(hashing=cfg.hashing.model_copy(update={"prefix_cache_entries": 0}), sessions=cfg.sessions)


def outcome(kind: str, body: bytes, headers: dict[str, str], cfg: ContextConfig) -> Any:
    """The context's fields (payload as a dict), or the error's (type, status, param, message)."""
    try:
        ctx = build_context(kind, body, {"x-request-id": "r", **headers}, JSON, cfg)
    except GatewayError as exc:
        return type(exc).__name__, exc.status, getattr(exc, "param", None), str(exc)
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    fields["payload"] = dict(ctx.payload or {})
    return fields


def same(kind: str, body: bytes, headers: dict[str, str], cached: ContextConfig) -> Any:
    want = outcome(kind, body, headers, off(cached))
    got = outcome(kind, body, headers, cached)
    assert got == want
    return got


# ---- random conversations, in each API's shapes -------------------------------------
text = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(["", "x" * 300, "é😀\u2028" * 20])
cache_control = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])
scalar = st.none() | st.booleans() | st.integers(-2, 2 ** 40) | st.floats(allow_nan=False, allow_infinity=False) | text
json_value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
                          max_leaves=8)
image_url = st.builds(lambda d: {"type": "image_url", "image_url": {"url": "data:image/png;base64," + d}}, text)


@st.composite
def chat_message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]))
    part = st.builds(lambda t, c: {"type": "text", "text": t, **c}, text, cache_control) | image_url | \
        st.builds(lambda v: {"type": "input_audio", "data": v}, json_value)
    msg: dict[str, Any] = {"role": role, "content": draw(st.none() | text | st.lists(part, max_size=3))}
    if role == "assistant" and draw(st.booleans()):
        args = draw(text | st.builds(json.dumps, st.dictionaries(text, scalar, max_size=2)))
        msg["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": draw(text), "arguments": args}}]
    if role == "tool":
        msg["tool_call_id"] = draw(text)
    return msg


@st.composite
def anthropic_message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant"]))
    block = st.builds(lambda t, c: {"type": "text", "text": t, **c}, text, cache_control) | \
        st.builds(lambda n, i: {"type": "tool_use", "id": "toolu_1", "name": n, "input": i}, text,
                  st.dictionaries(text, json_value, max_size=2)) | \
        st.builds(lambda c, e: {"type": "tool_result", "tool_use_id": "toolu_1", "content": c, "is_error": e},
                  text | st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), max_size=2), st.booleans()) | \
        st.builds(lambda d: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}},
                  text) | st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, text)
    return {"role": role, "content": draw(text | st.lists(block, max_size=3))}


@st.composite
def responses_item(draw: st.DrawFn) -> Any:
    part = st.builds(lambda k, t: {"type": k, "text": t}, st.sampled_from(["input_text", "output_text"]), text) | \
        st.builds(lambda u: {"type": "input_image", "image_url": u}, text)
    return draw(st.one_of(
        text,
        st.builds(lambda r, c: {"type": "message", "role": r, "content": c},
                  st.sampled_from(["user", "assistant", "system", "developer"]), text | st.lists(part, max_size=2)),
        st.builds(lambda n, a: {"type": "function_call", "call_id": "c", "name": n, "arguments": a}, text, text),
        st.builds(lambda o: {"type": "function_call_output", "call_id": "c", "output": o}, text),
        st.builds(lambda s: {"type": "reasoning", "summary": s}, st.lists(text, max_size=2)),
    ))


ITEMS: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
    "chat": chat_message, "messages": anthropic_message, "count_tokens": anthropic_message,
    "responses": responses_item,
}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "d" * 200, "parameters": {"type": "object"}}}]
A_TOOLS = [{"name": "read", "description": "d" * 200, "input_schema": {"type": "object"}}]


def body_of(kind: str, items: list[Any], extra: dict[str, Any], style: int) -> bytes:
    """A request body; ``style`` varies where the list sits and how the JSON is spelled."""
    head: dict[str, Any] = {"model": "m"}
    if kind in ("messages", "count_tokens"):
        head |= {"max_tokens": 64, "system": [{"type": "text", "text": "sys " * 80}], "tools": A_TOOLS}
    elif kind == "responses":
        head |= {"instructions": "be brief " * 40, "tools": [{"type": "function", "name": "read"}]}
    else:
        head |= {"tools": TOOLS}
    doc = {FIELD[kind]: items, **head, **extra} if style % 2 else {**head, FIELD[kind]: items, **extra}
    if style == 2:
        return json.dumps(doc).encode()  # spaces, \u escapes
    if style == 3:
        return json.dumps(doc, indent=1, ensure_ascii=False).encode()
    return orjson.dumps(doc)


@st.composite
def conversation(draw: st.DrawFn) -> tuple[str, list[tuple[bytes, dict[str, str]]]]:
    """A growing conversation's turns, with edits of the last messages (a moved
    cache_control marker, a regenerated answer) and unrelated bodies in between."""
    kind = draw(st.sampled_from(sorted(ITEMS)))
    item = ITEMS[kind]()
    style = draw(st.integers(0, 3))
    headers = draw(st.sampled_from([{}, {"x-claude-code-session-id": "s1"}]))
    extras: list[dict[str, Any]] = [{}, {"stream": True}, {"metadata": {"user_id": "u"}, "temperature": 0.5}]
    extra = draw(st.sampled_from(extras))
    items: list[Any] = draw(st.lists(item, min_size=1, max_size=3))
    turns = []
    for _ in range(draw(st.integers(2, 5))):
        turns.append((body_of(kind, items, extra, style), headers))
        changed: bool = draw(st.booleans())
        if items and changed:  # the last message re-sent changed
            items = items[:-1] + [draw(item)]
        items = items + draw(st.lists(item, min_size=0, max_size=3))
        if draw(st.integers(0, 4)) == 0:  # an unrelated body on the same key
            turns.append((body_of(kind, draw(st.lists(item, min_size=1, max_size=3)), extra, style), headers))
    return kind, turns


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation())
def test_cached_contexts_equal_the_full_path(conv: tuple[str, list[tuple[bytes, dict[str, str]]]]) -> None:
    kind, turns = conv
    cfg = cached()
    for body, headers in turns:
        same(kind, body, headers, cfg)


def test_later_turns_hit_and_payload_is_lazy() -> None:
    cfg = cached()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s" * 3000}]
    for t in range(5):
        msgs += [{"role": "user", "content": f"turn {t} " * 100}, {"role": "assistant", "content": "ok " * 50}]
        got = same("chat", body_of("chat", msgs, {}, 0), {"x-kvgate-session": "a"}, cfg)
        assert got["payload"]["messages"] == msgs
    cache = cfg.hashing.context_cache()
    assert cache is not None and (cache.hits, cache.misses) == (4, 1)
    ctx = build_context("chat", body_of("chat", msgs, {"user": "u"}, 0), {"x-kvgate-session": "a"}, JSON, cfg)
    assert isinstance(ctx.payload, LazyPayload) and ctx.payload.get("user") == "u"
    assert ctx.payload["messages"] == msgs and len(ctx.payload) == 4


# ---- bad bodies, with their conversation's prefix cached -------------------------------
def _deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


BASE = [{"role": "user", "content": "hello " * 100}, {"role": "assistant", "content": "hi " * 100}]
BAD_TAILS: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("no role", lambda b: orjson.dumps({"model": "m", "messages": [*BASE, {"content": "x"}]})),
    ("int content", lambda b: orjson.dumps({"model": "m", "messages": [*BASE, {"role": "user", "content": 1}]})),
    ("not an object", lambda b: orjson.dumps({"model": "m", "messages": [*BASE, "x"]})),
    ("truncated", lambda b: b[:-3]),
    ("trailing garbage", lambda b: b + b"x"),
    ("garbage after", lambda b: b[:-2] + b",}" + b[-2:]),
    ("invalid utf-8", lambda b: b[:-2] + b',{"role":"user","content":"\xff"}' + b[-2:]),
    ("lone surrogate", lambda b: b[:-2] + b',{"role":"user","content":"\\ud800"}' + b[-2:]),
    ("bom", lambda b: b"\xef\xbb\xbf" + b),
    ("duplicate key after", lambda b: b[:-1] + b',"messages":[1]}'),
    ("duplicate key empty", lambda b: b[:-1] + b',"messages":[]}'),
    ("model type", lambda b: b[:-1] + b',"model":3}'),
    ("stream type", lambda b: b[:-1] + b',"stream":"yes"}'),
    ("max_tokens", lambda b: b[:-1] + b',"max_tokens":-1}'),
    ("deep new message", lambda b: orjson.dumps({"model": "m", "messages": [
        *BASE, {"role": "user", "content": [{"type": "x", "v": _deep(MAX_JSON_DEPTH - 3)}]}]})),
    ("deep elsewhere", lambda b: b[:-1] + b',"extra":' + orjson.dumps(_deep(MAX_JSON_DEPTH)) + b"}"),
    ("not deep enough", lambda b: b[:-1] + b',"extra":' + orjson.dumps(_deep(MAX_JSON_DEPTH - 1)) + b"}"),
    ("deep message at the limit", lambda b: orjson.dumps({"model": "m", "messages": [
        *BASE, {"role": "user", "content": [{"type": "x", "v": _deep(MAX_JSON_DEPTH - 4)}]}]})),
    ("array body", lambda b: b"[" + b + b"]"),
]


@pytest.mark.parametrize(("name", "make"), BAD_TAILS, ids=[n for n, _ in BAD_TAILS])
@pytest.mark.parametrize("headers", [{}, {"x-kvgate-session": "s"}])
def test_bad_bodies_with_a_cached_prefix_fail_alike(name: str, make: Callable[[bytes], bytes],
                                                     headers: dict[str, str]) -> None:
    cfg = cached()
    good = orjson.dumps({"model": "m", "messages": BASE})
    same("chat", good, headers, cfg)
    bad = make(good)
    same("chat", bad, headers, cfg)
    same("chat", good, headers, cfg)  # and the cache still answers the good one right


def test_a_body_that_spells_the_placeholder() -> None:
    cfg = cached()
    cache = cfg.hashing.context_cache()
    assert cache is not None
    good = orjson.dumps({"model": "m", "messages": BASE})
    same("chat", good, {}, cfg)
    forged = good[:-1] + b',"messages":[' + cache.nonce + b',{"role":"user","content":"x"}]}'
    same("chat", forged, {}, cfg)
    same("chat", good[:-2] + b"," + cache.nonce + b"]}", {}, cfg)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_later_turns_fail_alike(data: st.DataObject) -> None:
    cfg = cached()
    good = orjson.dumps({"model": "m", "messages": BASE, "stream": True})
    later = orjson.dumps({"model": "m", "messages": [*BASE, {"role": "user", "content": "more " * 20}], "stream": True})
    same("chat", good, {}, cfg)
    at = data.draw(st.integers(0, len(later) - 1))
    junk = data.draw(st.binary(min_size=0, max_size=3) | st.sampled_from([b"]", b"}", b",", b'"', b"\\", b"[{"]))
    cut = data.draw(st.integers(0, 3))
    same("chat", later[:at] + junk + later[at + cut:], {}, cfg)


# ---- bounds -----------------------------------------------------------------------------
def test_the_cache_stays_within_its_entries_and_bytes() -> None:
    cfg = cached(prefix_cache_entries=5, prefix_cache_bytes=40_000)
    cache = cfg.hashing.context_cache()
    assert cache is not None
    for i in range(60):
        msgs = [{"role": "user", "content": f"conversation {i} " * (20 + 17 * (i % 7))}]
        same("chat", body_of("chat", msgs, {}, 0), {"x-kvgate-session": f"s{i % 9}"}, cfg)
        assert cache.entries <= 5 and cache.bytes <= 40_000
        assert cache.entries == sum(len(v) for v in cache._keys.values())
        assert cache.bytes == sum(e.size for v in cache._keys.values() for e in v)
    assert cache.entries > 0


def test_per_key_and_oversized_entries() -> None:
    cache = ContextCache(max_entries=100, max_bytes=10_000)
    cfg = cached(prefix_cache_entries=100, prefix_cache_bytes=10_000)
    cfg.hashing._cache.cache = cache  # the slot of gateway.context_cache.CacheSlot
    for i in range(PER_KEY + 3):
        same("chat", body_of("chat", [{"role": "user", "content": f"c{i} " * 200}], {}, 0), {"x-kvgate-session": "k"},
             cfg)
    assert cache.entries == PER_KEY
    huge = [{"role": "user", "content": "y" * 400_000}]
    same("chat", body_of("chat", huge, {}, 0), {"x-kvgate-session": "h"}, cfg)  # ~1,600 hashes > 10 KB
    assert cache.entries == PER_KEY and cache.bytes <= 10_000


def test_disabled_and_reconfigured() -> None:
    for kw in ({"prefix_cache_entries": 0}, {"prefix_cache_bytes": 0}):
        cfg = cached(**kw)
        assert cfg.hashing.context_cache() is None
        for _ in range(2):
            same("chat", body_of("chat", BASE, {}, 0), {}, cfg)
    cfg = cached()
    first = cfg.hashing.context_cache()
    cfg.hashing.prefix_cache_entries = 10
    second = cfg.hashing.context_cache()
    assert first is not second and second is not None and second.max_entries == 10
    assert cached() == cfg.model_copy(update={"hashing": HashingConfig(prefix_cache_min_bytes=0)})  # slots equal


def test_max_blocks_and_routing_text_bypass_or_bound() -> None:
    long = [{"role": "user", "content": "z" * 5000}]
    for kw in ({"max_blocks": 3}, {"max_blocks": 0}, {"keep_routing_text": True}, {"block_chars": 7}):
        cfg = cached(**kw)
        for turn in range(3):
            same("chat", body_of("chat", long * (turn + 1), {}, 0), {"x-kvgate-session": "b"}, cfg)


def test_default_config_caches_only_large_bodies() -> None:
    cfg = ContextConfig()
    cache = cfg.hashing.context_cache()
    assert cache is not None
    same("chat", body_of("chat", BASE, {}, 0), {"x-kvgate-session": "d"}, cfg)
    assert (cache.hits, cache.misses, cache.entries) == (0, 0, 0)
    msgs = [{"role": "system", "content": "s" * 20_000}]
    for t in range(3):
        msgs += [{"role": "user", "content": f"t{t} " * 300}]
        same("chat", body_of("chat", msgs, {}, 1), {"x-kvgate-session": "d"}, cfg)
    assert (cache.hits, cache.misses) == (2, 1)


@pytest.mark.parametrize("kind", ["chat", "messages", "responses"])
def test_changed_surroundings_with_the_same_messages(kind: str) -> None:
    """Tools, system, model, max_tokens, stream or the session field change, messages do not."""
    cfg = cached()
    items: list[Any] = [{"role": "user", "content": "a " * 300}, {"role": "assistant", "content": "b " * 300}]
    if kind == "responses":
        items = [{"type": "message", **m} for m in items]
    variants: list[dict[str, Any]] = [{}, {"model": "other"}, {"max_tokens": 5}, {"stream": True},
                                      {"tools": [{"type": "function", "function": {"name": "x"}}]},
                                      {"system": "changed"}, {"instructions": "changed"}, {"user": "u2"},
                                      {"metadata": {"user_id": "u3"}}, {"prompt_cache_key": "k"}, {}]
    for style in (0, 1):
        for extra in variants:
            for more in (0, 1):
                body = body_of(kind, items + items[:more], {}, style)
                doc = orjson.loads(body) | extra
                same(kind, orjson.dumps(doc), {"x-kvgate-session": "c"}, cfg)


# ---- ids a client may not choose (issue 41): refused on the cached path as on the full one
@pytest.mark.parametrize("kind", ["chat", "messages", "responses"])
@pytest.mark.parametrize("field", ["rid", "request_id"])
def test_client_chosen_ids_are_refused_with_a_cached_prefix(kind: str, field: str) -> None:
    """A later turn that adds ``rid``/``request_id`` beside cached messages, before or after
    the list, or that keeps an accepted body's surroundings: 400 exactly as the full path."""
    cfg = cached()
    items: list[Any] = [{"role": "user", "content": "a " * 300}, {"role": "assistant", "content": "b " * 300}]
    if kind == "responses":
        items = [{"type": "message", **m} for m in items]
    headers = {"x-kvgate-session": "ids"}
    for style in (0, 1):
        same(kind, body_of(kind, items, {}, style), headers, cfg)  # cached, accepted
        more = items + [{"type": "message", "role": "user", "content": "c " * 50} if kind == "responses"
                        else {"role": "user", "content": "c " * 50}]
        for value in ("resp_victim", "x", 7):
            got = same(kind, body_of(kind, more, {field: value}, style), headers, cfg)
            assert got[:3] == ("InvalidRequest", 400, field)
        assert isinstance(same(kind, body_of(kind, more, {field: None}, style), headers, cfg), dict)
        assert isinstance(same(kind, body_of(kind, more, {}, style), headers, cfg), dict)
    cache = cfg.hashing.context_cache()
    assert cache is not None and cache.hits > 0
