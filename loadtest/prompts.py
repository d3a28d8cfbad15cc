"""Hash ids -> deterministic prompt text, rendered as chat messages that share prefixes.

Block text. Every (namespace, hash id) becomes the same ``block_size * chars_per_token``
characters (4 chars per token by default) in every run and process: a slice of a fixed
pool of English/code-like words (built once per process by ``random.Random(POOL_SEED)``,
whose output is stable across Python versions), starting at a word chosen by
``xxh3_64(namespace + id)`` (no Python ``hash()``, which is salted per process). Two
requests therefore share exactly the text prefix their hash ids share: equal ids, equal
text; different ids at one position, different text (barring a 1-in-~150k offset clash).
Block texts are memoised in an LRU; a slice plus a hash is ~0.3 us, so a 100k-token
prompt of 64-token blocks renders in well under a millisecond amortised.

Message scheme (the text of block k is always in the same place). For a prompt of blocks
``b_0 .. b_{n-1}`` plus ``in_tokens - n * block_size`` tail tokens:

- ``system``: blocks ``[0, S)`` where ``S = session.system_blocks`` (tool + system
  prompt tokens // block_size), or all blocks if fewer.
- history: blocks ``[S, n)`` cut into messages of ``G = message_tokens // block_size``
  blocks (message ``j`` holds blocks ``[S + jG, S + (j+1)G)``), roles alternating
  ``user``, ``assistant``, ``user``, ... Turn T+1 extends turn T's blocks, so its
  messages extend turn T's messages (the last, partial, message grows in place).
- when ``in_tokens < n * block_size`` (Mooncake's last block is partial) the last block
  is cut to fit: still a prefix of the full block's text.
- tail: ``in_tokens - n * block_size`` tokens of fresh text keyed by (session, turn),
  appended to the last history message if it is a ``user`` message, else sent as a new
  ``user`` message; a prompt that would end on an ``assistant`` message gets a one-word
  ``user`` message. The tail is never shared, as in the trace (partial blocks are not
  hashed).

The chat template adds a few tokens per message (~1% at G = 16 blocks of 64 tokens).

``request_body(api, ...)`` turns one turn's messages into the request of an API
(``API_PATHS``: chat completions; Anthropic Messages, the system message as ``system``;
OpenAI Responses, as ``instructions`` + ``input`` message items).
"""
from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

POOL_SEED = 0x6B7667617465  # "kvgate"
POOL_CHARS = 1 << 21
_WORD_TEXT = (  # English and code-like words, split on spaces
    "the of and to in is for on that with as by this from be are at or an it not we can "
    "return def class self import if else elif while for yield async await lambda None "
    "True False int str list dict tuple value key index cache block token prefix session "
    "request response replica router gateway policy score filter load queue latency "
    "throughput model prompt context message user assistant system tool result error "
    "status config file path line test assert expected actual function method module "
    "package build run update create delete read write open close start stop wait "
    "timeout retry count total size length offset buffer stream chunk event handler "
    "callback state report metric const let var fn impl struct enum match Some Ok Err "
    "unwrap pub use mod crate trait #include std vector string map auto void template "
    "typename namespace {} () [] => -> == != <= >= += && || :: // /* */ # 0 1 2 42 100 "
    "1024 0x1f"
)


def _build_pool() -> tuple[str, list[int]]:
    rng = random.Random(POOL_SEED)
    words = rng.choices(_WORD_TEXT.split(), k=POOL_CHARS // 4)
    pool = " ".join(words)
    starts: list[int] = []
    pos = 0
    for w in words:
        starts.append(pos)
        pos += len(w) + 1
    return pool, starts


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[str, list[int]]:
    return _build_pool()


@dataclass(frozen=True)
class PromptSpec:
    namespace: str
    session_id: str
    block_size: int
    system_blocks: int


class PromptRenderer:
    """Renders (hash ids, token counts) into chat messages; see the module docstring."""

    def __init__(self, chars_per_token: int = 4, message_tokens: int = 1024,
                 cache_blocks: int = 1 << 18) -> None:
        self.chars_per_token = chars_per_token
        self.message_tokens = message_tokens
        pool, starts = _pool()
        self._pool = pool
        self._starts = starts
        self._limit = len(pool) - 8192  # room for the longest block (2048 tokens)
        self.block_text = functools.lru_cache(maxsize=cache_blocks)(self._block_text)

    def _block_text(self, namespace: str, hash_id: int, chars: int) -> str:
        h = xxhash.xxh3_64_intdigest(f"{namespace}\x00{hash_id}".encode())
        start = self._starts[h % len(self._starts)]
        if start > self._limit:
            start = start % self._limit
        return self._pool[start:start + chars - 1] + " "

    def fresh_text(self, key: str, tokens: int) -> str:
        """Deterministic text of ``tokens`` tokens that no other key shares."""
        chars = tokens * self.chars_per_token
        h = xxhash.xxh3_64_intdigest(key.encode())
        parts = [f"[{h:016x}] "]
        size = len(parts[0])
        block_chars = 256
        i = 0
        while size < chars:
            part = self._block_text(key, i, block_chars)
            parts.append(part)
            size += len(part)
            i += 1
        return "".join(parts)[:chars]

    def messages(self, spec: PromptSpec, hash_ids: Sequence[int], in_tokens: int,
                 turn_index: int) -> list[dict[str, str]]:
        bs = spec.block_size
        chars = bs * self.chars_per_token
        n = len(hash_ids)
        texts = [self.block_text(spec.namespace, h, chars) for h in hash_ids]
        if n and in_tokens < n * bs:  # partial last block (Mooncake): cut, stays a prefix
            keep = max(0, in_tokens - (n - 1) * bs) * self.chars_per_token
            texts[-1] = texts[-1][:keep]
        s = min(spec.system_blocks, n)
        out: list[dict[str, str]] = []
        if s:
            out.append({"role": "system", "content": "".join(texts[:s])})
        group = max(1, self.message_tokens // bs)
        for j, lo in enumerate(range(s, n, group)):
            role = "user" if j % 2 == 0 else "assistant"
            out.append({"role": role, "content": "".join(texts[lo:lo + group])})
        tail_tokens = in_tokens - n * bs
        if tail_tokens > 0:
            tail = self.fresh_text(f"{spec.namespace}\x00{spec.session_id}\x00{turn_index}",
                                   tail_tokens)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += tail
            else:
                out.append({"role": "user", "content": tail})
        elif not out or out[-1]["role"] != "user":
            out.append({"role": "user", "content": "Continue."})
        return out


API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def request_body(api: str, model: str, messages: list[dict[str, str]], out_tokens: int,
                 extra: dict[str, Any], previous: str | None = None) -> dict[str, Any]:
    """One turn's streaming request body in ``api``'s shape (see the module docstring)."""
    if api == "chat":
        return {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": out_tokens, "ignore_eos": True, **extra}
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else messages
    if api == "messages":
        body: dict[str, Any] = {"model": model, "messages": rest, "max_tokens": out_tokens, "stream": True,
                                "ignore_eos": True}
        if system is not None:
            body["system"] = system
        return {**body, **extra}
    if api != "responses":
        raise ValueError(f"unknown api {api!r}; expected one of {tuple(API_PATHS)}")
    items = [{"type": "message", "role": m["role"], "content": m["content"]} for m in rest]
    body = {"model": model, "input": items, "max_output_tokens": out_tokens, "stream": True, "ignore_eos": True}
    if system is not None:
        body["instructions"] = system
    if previous is not None:
        body["previous_response_id"] = previous
    return {**body, **extra}
