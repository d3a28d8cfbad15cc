"""Canonical rendering of a request and its chained block hashes (docs/design.md "Block hashing").

Rendering (one string, so that turn T's rendering is a prefix of turn T+1's):
- chat: ``gateway.conversation.render_chat``, the one canonical rendering of a conversation
  (the same for chat completions, Anthropic Messages and OpenAI Responses).
- completions / generate text: the prompt string (a list of strings: joined by ``\\x1e``).
- token ids (``prompt`` or ``input_ids`` as integer lists): the ids as 4-byte little-endian
  integers, so a 256-byte block is exactly 64 tokens.

Blocks are cut on the UTF-8 *bytes* of the rendering (``block_chars`` bytes each): slicing
256 bytes costs next to nothing, while cutting on characters would need a scan of the
string. For ASCII (code, English) bytes = characters; for other scripts a block covers
fewer characters, consistently for every request, which is all the chain needs. Only full
blocks are hashed, at most ``max_blocks`` of them. Chain: ``h_-1 = xxh3_64(model)``,
``h_k = xxh3_64(block_k, seed=h_{k-1})``, so block k's hash names the whole prefix 0..k.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

_xxh = xxhash.xxh3_64_intdigest
_CANON = orjson.OPT_SORT_KEYS


def model_seed(model: str) -> int:
    """``h_-1``: the chain's seed, so equal prompts for different models never match."""
    return _xxh(model.encode())


def chain_hashes(data: bytes, model: str, block_bytes: int, max_blocks: int) -> tuple[int, ...]:
    """Chained xxh3_64 hashes of the full ``block_bytes`` blocks of ``data`` (at most ``max_blocks``)."""
    if len(data) < block_bytes:  # (a short prompt: no full block, nothing to hash)
        return ()
    return tuple(extend_chain(model_seed(model), data, block_bytes, max_blocks))


def extend_chain(h: int, data: bytes, block_bytes: int, room: int) -> list[int]:
    """The chain continued from hash ``h`` over the full blocks of ``data`` (at most ``room``).

    ``chain_hashes`` is this from the model's seed; ``gateway.context_turns`` resumes a
    chain from a cached state (its last hash, and ``data`` starting with the state's
    unhashed tail), which gives the same hashes as hashing the whole rendering again."""
    n = min(len(data) // block_bytes, room) if block_bytes > 0 else 0
    out: list[int] = []
    append, xxh = out.append, _xxh
    # slicing bytes (a 256-byte copy) is cheaper than a memoryview slice object; ~25% faster
    for start in range(0, n * block_bytes, block_bytes):
        h = xxh(data[start:start + block_bytes], h)
        append(h)
    return out


def chat_routing_text(messages: Sequence[Any]) -> str:
    """SGLang router's routing text: the text content of all messages joined by single spaces."""
    texts: list[str] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return " ".join(texts)


def is_token_ids(value: Any) -> bool:
    """An integer list (or a list of them): a prompt given as token ids."""
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    return isinstance(first, int) or (isinstance(first, list) and bool(first) and isinstance(first[0], int))


def render_token_ids(value: list[Any]) -> tuple[bytes, int]:
    """Token ids (flat or a batch of lists) as 4-byte little-endian ints; and the count.

    Raises ValueError for anything but integers in [0, 2**32).
    """
    ids = array("I")
    rows = value if isinstance(value[0], list) else [value]
    try:
        for row in rows:
            ids.extend(row)
    except (TypeError, OverflowError) as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes(), len(ids)


def render_text_prompt(prompt: str | list[str]) -> str:
    """A completion/generate text prompt (a batch of strings is joined by ``\\x1e``)."""
    return prompt if isinstance(prompt, str) else "\x1e".join(prompt)
