"""Canonical rendering and chained block hashes (docs/design.md "Block hashing")."""
from __future__ import annotations

import xxhash

from gateway import prefix_hash as ph
from gateway.conversation import render_chat


def test_chain_is_xxh3_seeded_by_previous_hash_and_model() -> None:
    data = b"a" * 256 + b"b" * 256 + b"c" * 100  # the partial third block is not hashed
    got = ph.chain_hashes(data, "m", 256, 100)
    h0 = xxhash.xxh3_64_intdigest(b"a" * 256, seed=xxhash.xxh3_64_intdigest(b"m"))
    h1 = xxhash.xxh3_64_intdigest(b"b" * 256, seed=h0)
    assert got == (h0, h1)
    assert ph.chain_hashes(data, "other", 256, 100)[0] != h0
    assert ph.chain_hashes(data, "m", 256, 1) == (h0,)
    assert ph.chain_hashes(b"short", "m", 256, 100) == ()


def test_same_block_at_another_position_hashes_differently() -> None:
    chain = ph.chain_hashes(b"x" * 512, "m", 256, 10)
    assert chain[0] != chain[1]


def test_turn_rendering_is_a_prefix_of_the_next_turn() -> None:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"b": 1, "a": 2}}}]
    turn1 = [{"role": "system", "content": "sys " * 100}, {"role": "user", "content": "hi " * 100}]
    turn2 = turn1 + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "bash", "arguments": "{\"c\": 1}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "out"}]},
    ]
    r1, r2 = render_chat(turn1, tools), render_chat(turn2, tools)
    assert r2.startswith(r1) and "bash" in r2[len(r1):] and '{"c":1}' in r2
    h1 = ph.chain_hashes(r1.encode(), "m", 64, 1000)
    h2 = ph.chain_hashes(r2.encode(), "m", 64, 1000)
    assert h1 and h2[: len(h1)] == h1


def test_tools_are_canonical_and_first() -> None:
    a = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    b = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, a) == render_chat(msgs, b)
    assert render_chat(msgs, a).startswith("\x01tools\x02")
    assert render_chat(msgs, a) != render_chat(msgs, None)


def test_roles_and_parts_are_rendered() -> None:
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}]}]
    plain = [{"role": "user", "content": "hello world"}]
    assert render_chat(text_parts) == render_chat(plain)
    assert render_chat(plain) != render_chat([{"role": "system", "content": "hello world"}])
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10000}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "B" * 10000}}
    r1 = render_chat([{"role": "user", "content": [img]}])
    r2 = render_chat([{"role": "user", "content": [other]}])
    assert r1 != r2 and len(r1) < 100 and "<image:" in r1


def test_token_ids_are_4_bytes_each() -> None:
    raw, n = ph.render_token_ids(list(range(128)))
    assert n == 128 and len(raw) == 512
    assert len(ph.chain_hashes(raw, "m", 256, 10)) == 2  # 256 bytes = 64 tokens
    raw2, n2 = ph.render_token_ids([[1, 2], [3]])
    assert n2 == 3 and raw2 == ph.render_token_ids([1, 2, 3])[0]
    assert ph.is_token_ids([1, 2]) and ph.is_token_ids([[1]]) and not ph.is_token_ids(["a"])
    assert not ph.is_token_ids([])


def test_routing_text_is_message_text_joined_by_spaces() -> None:
    msgs = [
        {"role": "system", "content": "a b"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "x", "arguments": "{}"}}]},
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert ph.chat_routing_text(msgs) == "a b c"
    assert ph.render_text_prompt(["a", "b"]) == "a\x1eb"
