"""A real Hugging Face tokenizer for the simulated replica's ``model_path`` folder.

Benchmark clients (aiperf, inference-perf, guidellm, SGLang's bench_serving) and peer
routers load a tokenizer from the ``model_path`` a replica reports. This writes one whose
token COUNT equals the simulator's own rule (:mod:`.tokenizer`: one token per 4 UTF-8
bytes of the rendered chat text, the last one partial) and whose chat template renders
exactly what :func:`.tokenizer.render_chat` renders, so their counts agree with the
``usage`` the replica reports, offline, without a tokenizer workaround:

- pre-tokenizer: ``ByteLevel`` without its regex (each byte becomes one character), then
  ``Split`` into chunks of 4 characters (= 4 bytes); model: ``WordLevel`` over the 256
  byte characters, every longer chunk is ``<unk>`` (ids are meaningless, counts are right);
- no special tokens: the chat markers are plain text, as in the simulator's count;
- the template renders tools (JSON, sorted keys, compact), role (``:name`` or
  ``:tool_call_id``), text content (a string or text parts) and tool calls, and always
  ends with the generation header ``<|im_start|>``. Non-text parts (images) are left out
  (the simulator renders a hash marker for them).

Pure Python (JSON files): no ``tokenizers`` needed to write it; tests/simulator checks it
with the real ``tokenizers`` and ``transformers`` (in the SGLang CPU venv).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from gateway.word_tokens import TOKENIZER_KEY, TOKENIZER_KIND

UNK = "<unk>"
_JSON = "tojson(separators=(',', ':'), sort_keys=True)"
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_start|>tool_declare<|im_middle|>{{ tools | " + _JSON + " }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set name = m.get('name') or m.get('tool_call_id') or '' -%}"
    "<|im_start|>{{ m.get('role', 'user') }}{% if name %}:{{ name }}{% endif %}<|im_middle|>"
    "{%- set c = m.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is iterable and c is not mapping -%}{%- for p in c -%}"
    "{%- if p is string -%}{{ p }}{%- elif p.get('type') == 'text' -%}{{ p.get('text', '') }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in (m.get('tool_calls') or []) -%}{%- set fn = call.get('function', {}) -%}"
    "<|tool_call|>{{ fn.get('name', '') }}:"
    "{%- if fn.get('arguments', '') is string -%}{{ fn.get('arguments', '') }}"
    "{%- else -%}{{ fn.get('arguments') | " + _JSON + " }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "<|im_start|>"
)


def byte_alphabet() -> list[str]:
    """The 256 characters of the ByteLevel pre-tokenizer, in byte order (GPT-2's map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json() -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    vocab = {UNK: 0, **{ch: i + 1 for i, ch in enumerate(byte_alphabet())}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            byte_level,
            {"type": "Split", "pattern": {"Regex": ".{1,4}"}, "behavior": "Isolated", "invert": False},
        ]},
        "post_processor": None, "decoder": byte_level,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }


def tokenizer_config(context_length: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "model_max_length": context_length, "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False,
            # the ids are the simulator's own (gateway/word_tokens.py), not this file's <unk>s:
            # the gateway's precise mode reads this key to reproduce them
            TOKENIZER_KEY: TOKENIZER_KIND}


def write_tokenizer(path: Path, context_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path`` (atomic each)."""
    files = {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": tokenizer_config(context_length)}
    for name, body in files.items():
        tmp = path / f".{name}.{os.getpid()}"
        tmp.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        os.replace(tmp, path / name)
