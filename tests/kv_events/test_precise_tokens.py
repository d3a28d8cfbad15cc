"""Precise mode's tokenization and page hashing: cached segments and per-session chains give
exactly what a whole-prompt tokenization and hashing give."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.precise_tokens import ModelTokenizer, SessionHasher
from gateway.sglang_pages import page_hashes
from tests.kv_events.tokmodel import write_model

WORDS = st.sampled_from(["def ", "class", " the", "fox", "\n", "  ", "<|im_end|>", "KV", "é", "😀", "caching "])
TEXT = st.lists(WORDS, max_size=30).map("".join)
MESSAGES = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tok"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MESSAGES)
def test_segments_equal_whole_prompt_tokenization(model: Path, messages: list[tuple[str, str]]) -> None:
    tok = ModelTokenizer.from_dir(model)
    payload = {"messages": [{"role": r, "content": c} for r, c in messages]}
    text = tok.render_chat(payload)
    whole = tok.form.encode(text, prompt=False)
    for _ in range(2):  # the second time from the segment cache
        segments = tok.prompt_segments("chat", payload)
        assert segments is not None
        assert [t for s in segments for t in s.ids] == whole


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(MESSAGES, min_size=1, max_size=4), st.sampled_from([1, 2, 3, 16]), st.booleans())
def test_session_chains_equal_hashing_from_scratch(model: Path, turns: list[list[tuple[str, str]]],
                                                   page: int, bigram: bool) -> None:
    tok = ModelTokenizer.from_dir(model)
    hasher = SessionHasher(page, bigram)
    history: list[dict[str, str]] = []
    for turn in turns:
        history += [{"role": r, "content": c} for r, c in turn]
        segments = tok.prompt_segments("chat", {"messages": history})
        assert segments is not None
        ids = [t for s in segments for t in s.ids]
        got = hasher.hash(segments, "s1")
        keys = len(ids) - (1 if bigram else 0)
        expected = page_hashes(ids, page, bigram=bigram)[:max(keys - 1, 0) // page]
        assert got.tokens == len(ids) and list(got.hashes) == expected


def test_completions_and_token_prompts(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model(tmp_path, bos=True))
    segments = tok.prompt_segments("completions", {"prompt": "the quick fox"})
    assert segments is not None and segments[0].ids[0] == 0  # the post-processor's BOS, as SGLang's encode adds
    generate = tok.prompt_segments("generate", {"input_ids": [5, 6, 7]})
    assert generate is not None and generate[0].ids == (5, 6, 7)
    assert tok.prompt_segments("completions", {"prompt": ["a", "b"]}) is None  # a batch: not one prompt


def test_tool_call_arguments_reach_the_template_as_objects(model: Path) -> None:
    tok = ModelTokenizer.from_dir(model)
    assert tok.template is not None
    tok.template = tok.template.environment.from_string(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.path }}"
        "{% endfor %}{% endfor %}")
    text = tok.render_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "read", "arguments": '{"path": "/x"}'}}]}]})
    assert text == "/x"


def test_anthropic_messages_convert_as_sglang_does() -> None:
    from gateway.precise_chat import NotReproducible, anthropic_to_chat

    body = {"system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], "messages": [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}}]},
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                                     {"type": "text", "text": "then"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
        "tools": [{"name": "read", "input_schema": {"type": "object"}}]}
    chat = anthropic_to_chat(body)
    assert chat.messages == [
        {"role": "system", "content": "A\nB"}, {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]},
        {"role": "user", "content": "first"},  # text before a tool_result is flushed first, as SGLang does
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "user", "content": "then"},
        {"role": "assistant", "content": ""}]
    assert chat.tools == [{"type": "function", "defer_loading": None, "function": {
        "name": "read", "description": "", "parameters": {"type": "object"}, "strict": False}}]
    assert chat.tool_choice == "auto"
    image = {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    with pytest.raises(NotReproducible):
        anthropic_to_chat(image)


def test_a_first_turn_is_tokenized_whole_on_its_first_request(model: Path) -> None:
    """No per-request budget: the pool's deadline bounds the wait, not the text."""
    tok = ModelTokenizer.from_dir(model)
    payload = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 2000}
                            for i in range(9)]}  # ~100 KB
    segments = tok.prompt_segments("chat", payload)
    assert segments is not None
    assert [t for s in segments for t in s.ids] == tok.form.encode(tok.render_chat(payload), prompt=False)
