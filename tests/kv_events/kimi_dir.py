"""A tiny model directory in Kimi K2's TikToken form for precise-mode unit tests: a few hundred
ranks (every byte and some merges), ``tokenizer_config.json`` with the special tokens at
Kimi's offsets, the tokenizer class of the real test model (read, never run, by the gateway)
and its Kimi-structured chat template (``loadtest/sglang_cpu/kimi_model.py``)."""
from __future__ import annotations

from pathlib import Path

from loadtest.sglang_cpu import kimi_model

WORDS = ["the", " the", "def", " def", "class", " class", "return", " return", "self", "cache", " cache", "page",
         " page", "er", "in", "on", " a", "  ", "    ", "\n", "\n\n", "é", "中"]


def ranks() -> list[bytes]:
    out = [bytes([b]) for b in range(256)]
    seen = set(out)
    for word in WORDS:
        data = word.encode()
        for end in range(2, len(data) + 1):  # every prefix: each merge joins a known token and a byte
            if data[:end] not in seen:
                seen.add(data[:end])
                out.append(data[:end])
    return out


def write_kimi_model(root: Path, *, template: str | None = kimi_model.CHAT_TEMPLATE,
                     class_source: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    kimi_model.save_tokenizer(ranks(), root)
    if template is None:
        (root / "chat_template.jinja").unlink()
    else:
        (root / "chat_template.jinja").write_text(template)
    if class_source is not None:
        (root / "tokenization_kimi.py").write_text(class_source)
    return root
