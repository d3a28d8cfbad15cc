"""A tiny model directory for precise-mode tests: a byte-level BPE ``tokenizer.json`` trained
in milliseconds on fixed text, and a ChatML ``chat_template`` (like the real CPU model's)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["def class return import self value None if else for in while try except with as yield lambda",
          "the quick brown fox jumps over the lazy dog; caching prefixes of prompts saves prefill time",
          "You are a helpful assistant. Answer the question about KV caches and radix trees."] * 20


def write_model(root: Path, *, bos: bool = False) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
            ("<|endoftext|>", 0)])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "bos_token": None}))
    return root
