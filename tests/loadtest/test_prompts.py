"""Prompt rendering: deterministic across processes, prefixes shared exactly as the ids say."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import orjson
import pytest

from loadtest.prompts import PromptRenderer, PromptSpec
from loadtest.simulator.tokenizer import render_chat

SPEC = PromptSpec(namespace="ns", session_id="s1", block_size=64, system_blocks=3)
SNIPPET = (
    "from loadtest.prompts import PromptRenderer, PromptSpec\n"
    "import hashlib, orjson\n"
    "spec = PromptSpec('ns', 's1', 64, 3)\n"
    "m = PromptRenderer().messages(spec, list(range(40)) + [99, 100], 42 * 64 + 30, 5)\n"
    "print(hashlib.sha256(orjson.dumps(m)).hexdigest())\n"
)


def _digest(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(orjson.dumps(messages)).hexdigest()


def test_same_ids_same_text_across_processes() -> None:
    here = _digest(PromptRenderer().messages(SPEC, list(range(40)) + [99, 100], 42 * 64 + 30, 5))
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == here


def test_block_text_size_and_namespacing() -> None:
    r = PromptRenderer()
    a = r.block_text("ns", 7, 256)
    assert len(a) == 256 and a == r.block_text("ns", 7, 256)
    assert a != r.block_text("other", 7, 256)
    assert a != r.block_text("ns", 8, 256)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_extension_keeps_the_rendered_prompt_a_prefix() -> None:
    r = PromptRenderer()
    ids = list(range(100, 160))
    for n_prev, n_next in [(10, 11), (20, 37), (3, 60), (2, 5)]:
        prev = render_chat(r.messages(SPEC, ids[:n_prev], n_prev * 64, 0))
        nxt = render_chat(r.messages(SPEC, ids[:n_next], n_next * 64 + 17, 1))
        # turn T's whole hashed content reappears at the same place in turn T+1
        hashed = sum(len(r.block_text("ns", h, 256)) for h in ids[:n_prev])
        assert _common(prev, nxt) >= hashed


@pytest.mark.parametrize("shared", [0, 2, 3, 10, 17, 30])
def test_divergence_exactly_at_the_first_different_id(shared: int) -> None:
    r = PromptRenderer()
    a = list(range(40))
    b = a[:shared] + [1000 + i for i in range(40 - shared)]
    ta = render_chat(r.messages(SPEC, a, 40 * 64, 0))
    tb = render_chat(r.messages(SPEC, b, 40 * 64, 1))
    shared_chars = shared * 256
    common = _common(ta, tb)
    assert common >= shared_chars
    assert common < shared_chars + 256 + 64  # role markers at most, never the next block


def test_message_scheme() -> None:
    r = PromptRenderer(message_tokens=256)  # 4 blocks of 64 tokens per message
    msgs = r.messages(SPEC, list(range(12)), 12 * 64 + 10, 0)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert len(msgs[0]["content"]) == 3 * 256
    assert len(msgs[1]["content"]) == 4 * 256 and len(msgs[2]["content"]) == 4 * 256
    assert len(msgs[3]["content"]) == 1 * 256 + 40  # last block + the fresh tail
    # ending on an assistant message: a short user message follows
    msgs = r.messages(SPEC, list(range(11)), 11 * 64, 0)
    assert [m["role"] for m in msgs][-2:] == ["assistant", "user"]
    # partial last block (Mooncake): the text is cut, total ~ in_tokens * 4 chars
    msgs = r.messages(SPEC, list(range(5)), 4 * 64 + 10, 0)
    assert sum(len(m["content"]) for m in msgs) == (4 * 64 + 10) * 4


def test_tail_is_fresh_per_turn() -> None:
    r = PromptRenderer()
    a = r.messages(SPEC, [1, 2, 3, 4], 4 * 64 + 50, 0)
    b = r.messages(SPEC, [1, 2, 3, 4], 4 * 64 + 50, 1)
    assert a[-1]["content"] != b[-1]["content"]
    assert a == r.messages(SPEC, [1, 2, 3, 4], 4 * 64 + 50, 0)
