"""The tokenizer files of a simulated replica's model folder (plain checks; the real
``transformers`` comparison is tests/sglang_real/test_hf_tokenizer.py)."""
from __future__ import annotations

import json
from pathlib import Path

from loadtest.simulator.hf_tokenizer import CHAT_TEMPLATE, byte_alphabet, write_tokenizer
from loadtest.simulator.info import write_model_dir
from loadtest.simulator.profile import load_profile


def test_byte_alphabet_is_gpt2_byte_level() -> None:
    alphabet = byte_alphabet()
    assert len(set(alphabet)) == 256
    assert alphabet[ord("A")] == "A" and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"
    assert not any(ch in "\n\r\x85\u2028\u2029" for ch in alphabet)  # "." matches every one


def test_model_dir_has_a_loadable_tokenizer(tmp_path: Path) -> None:
    write_model_dir(tmp_path, load_profile("tiny"))
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel" and len(tok["model"]["vocab"]) == 257
    assert tok["added_tokens"] == []  # no special tokens: markers count as plain bytes
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["model_max_length"] == 8192
    write_tokenizer(tmp_path, 8192)  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "tokenizer.json",
                                                          "tokenizer_config.json"]
