"""A deterministic, download-free stand-in tokenizer for the simulated replica.

``encode`` (defined in ``gateway/word_tokens.py``, so that the gateway's precise mode can
reproduce the ids) views the UTF-8 bytes of a text as little-endian 4-byte words (zero-padded
to a multiple of 4), mixes each word with a fixed 32-bit multiply-xorshift and maps it
into a vocabulary of ``VOCAB_SIZE`` ids. So a token is 4 bytes: about 4 characters per
token on English prose and on code, ids are stable across processes and runs (no
``hash()``), equal byte prefixes give equal token prefixes (except the last, partial
word), and a 400 KB prompt encodes in a fraction of a millisecond (one numpy pass).

``decode`` does not invert ``encode``: it renders ids as deterministic pseudo-words
(used for the simulated output text). ``render_chat`` is the chat template;
``output_token_ids`` / ``natural_output_length`` give the deterministic output of a
request from a seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import xxhash

from gateway import word_tokens
from gateway.word_tokens import BYTES_PER_TOKEN, TokenIds

_MIX_64 = np.uint64(0x9E3779B97F4A7C15)
encode = word_tokens.encode  # this tokenizer's ids (defined in the gateway: see its docstring)
VOCAB_SIZE = word_tokens.VOCAB_SIZE

# Chat template markers (Kimi-like). The turn header is role-neutral: the role name comes
# right after it, so a prompt ending with the generation header is a byte prefix of the
# prompt of ANY extension of its messages (assistant reply, tool result or user turn).
TURN_START = "<|im_start|>"
ROLE_END = "<|im_middle|>"
TURN_END = "<|im_end|>"
GENERATION_HEADER = TURN_START


def _syllables() -> tuple[str, ...]:
    consonants = "bcdfghjklmnprstvwz"
    vowels = "aeiou"
    return tuple(c + v for c in consonants for v in vowels)


_SYLLABLES = _syllables()  # immutable: 90 two-letter syllables


def count_tokens(text: str | bytes) -> int:
    """Number of tokens ``encode`` would return, without encoding."""
    n = len(text.encode("utf-8")) if isinstance(text, str) else len(text)
    return -(-n // BYTES_PER_TOKEN)


def decode(ids: Iterable[int] | npt.NDArray[Any]) -> str:
    """Deterministic text for ids: a pseudo-word of ~4 characters (with a space) per id."""
    out: list[str] = []
    n = len(_SYLLABLES)
    for raw in ids:
        i = int(raw)
        word = _SYLLABLES[i % n] + _SYLLABLES[(i // n) % n][0]
        out.append(word if i % 7 else word + ".")
    return " ".join(out) + (" " if out else "")


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        if part.get("type") == "text":
            return str(part.get("text", ""))
        payload = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
        return f"<|{part.get('type', 'part')}:{xxhash.xxh3_64_hexdigest(payload)}|>"
    return str(part)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return _part_text(content)


def _tool_calls_text(calls: Any) -> str:
    if not calls:
        return ""
    rendered: list[str] = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = orjson.dumps(args, option=orjson.OPT_SORT_KEYS).decode()
        rendered.append(f"<|tool_call|>{fn.get('name', '')}:{args}<|tool_call_end|>")
    return "".join(rendered)


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> str:
    """The chat prompt: tools first, then each message, then the generation header.

    The prompt of turn T is a byte prefix of the prompt of turn T+1 whenever T+1's
    messages extend T's messages (same tools).
    """
    parts: list[str] = []
    if tools:
        schema = orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode()
        parts.append(f"{TURN_START}tool_declare{ROLE_END}{schema}{TURN_END}")
    for msg in messages:
        role = str(msg.get("role", "user"))
        name = msg.get("name") or msg.get("tool_call_id") or ""
        header = f"{TURN_START}{role}{':' + str(name) if name else ''}{ROLE_END}"
        body = _content_text(msg.get("content")) + _tool_calls_text(msg.get("tool_calls"))
        parts.append(f"{header}{body}{TURN_END}")
    parts.append(GENERATION_HEADER)
    return "".join(parts)


def request_key(prompt_ids: npt.NDArray[Any], seed: int) -> int:
    """A stable 64-bit key of (prompt, seed) from which the output is derived."""
    data = np.ascontiguousarray(prompt_ids, dtype=np.uint32).data.cast("B")
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def output_token_ids(key: int, start: int, stop: int) -> TokenIds:
    """Output ids ``start:stop`` of the request with this key (counter-based, O(stop-start))."""
    idx = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (idx + np.uint64(key & 0xFFFFFFFFFFFFFFFF)) * _MIX_64
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    return (x % np.uint64(VOCAB_SIZE)).astype(np.uint32)


def natural_output_length(key: int, mean_tokens: int) -> int:
    """A deterministic exponential-like length with the given mean (at least 1)."""
    u = (xxhash.xxh3_64_intdigest(b"len", seed=key) + 0.5) / 2.0**64
    return max(1, round(-mean_tokens * math.log(u)))
