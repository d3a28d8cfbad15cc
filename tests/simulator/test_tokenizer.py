"""Tokenizer: stable ids, ~4 chars/token, chat-template prefix property, seeded output."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.simulator import kvcache, tokenizer

PROSE = (
    "The quick brown fox jumps over the lazy dog. In the beginning of the project the team "
    "wrote down what they wanted the router to do, and then argued for a week about whether "
    "session affinity or prefix matching mattered more for coding agents that resend their "
    "whole history on every turn. "
) * 20


def test_ids_are_stable_across_processes() -> None:
    code = (
        "from loadtest.simulator.tokenizer import encode; import sys; "
        "sys.stdout.write(','.join(map(str, encode(sys.stdin.read()).tolist())))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=PROSE,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [int(x) for x in proc.stdout.split(",")] == tokenizer.encode(PROSE).tolist()


def test_about_four_characters_per_token_on_prose_and_code() -> None:
    code = inspect.getsource(kvcache)
    for text in (PROSE, code):
        ids = tokenizer.encode(text)
        assert ids.dtype == np.uint32
        assert 3.8 <= len(text) / len(ids) <= 4.0
        assert len(ids) == tokenizer.count_tokens(text)
        assert int(ids.max()) < tokenizer.VOCAB_SIZE


def test_equal_byte_prefixes_give_equal_token_prefixes() -> None:
    a = tokenizer.encode(PROSE[:1000])
    b = tokenizer.encode(PROSE[:1000] + "more text")
    assert (a == b[: len(a)]).all()
    assert tokenizer.encode(b"abcd").tolist() == tokenizer.encode("abcd").tolist()


def test_decode_is_deterministic_text() -> None:
    ids = tokenizer.encode(PROSE[:200])
    assert tokenizer.decode(ids) == tokenizer.decode(ids.tolist())
    assert 3.0 <= len(tokenizer.decode(ids)) / len(ids) <= 6.0
    assert tokenizer.decode([]) == ""


_text = st.text(max_size=40)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _text})
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(_text, st.lists(_part, max_size=3), st.none()),
    }
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_message, min_size=1, max_size=5), st.lists(_message, min_size=1, max_size=4))
def test_turn_prompt_is_a_byte_prefix_of_the_next_turn(
    first: list[dict[str, Any]], more: list[dict[str, Any]]
) -> None:
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    prompt = tokenizer.render_chat(first, tools).encode()
    longer = tokenizer.render_chat(first + more, tools).encode()
    assert longer.startswith(prompt)
    assert prompt.endswith(tokenizer.GENERATION_HEADER.encode())


def test_render_chat_renders_tools_first_and_tool_calls() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "ls", "arguments": {"path": "/"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a b c"},
    ]
    out = tokenizer.render_chat(messages, [{"name": "ls"}])
    assert out.index("tool_declare") < out.index("hi")
    assert '<|tool_call|>ls:{"path":"/"}' in out
    assert "<|image_url:" in out and "tool:call_1" in out


def test_seeded_output_is_deterministic_and_sliceable() -> None:
    prompt = tokenizer.encode(PROSE)
    key = tokenizer.request_key(prompt, seed=7)
    assert key == tokenizer.request_key(prompt.copy(), seed=7)
    assert key != tokenizer.request_key(prompt, seed=8)
    whole = tokenizer.output_token_ids(key, 0, 50)
    assert (whole[10:20] == tokenizer.output_token_ids(key, 10, 20)).all()
    assert int(whole.max()) < tokenizer.VOCAB_SIZE


def test_natural_output_length_has_the_requested_mean() -> None:
    lengths = [tokenizer.natural_output_length(k * 7919, 300) for k in range(4000)]
    assert min(lengths) >= 1
    assert 280 <= sum(lengths) / len(lengths) <= 320
