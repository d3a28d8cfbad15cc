"""Build the tiny test model that the real CPU SGLang server serves (run in the SGLang venv).

A ``LlamaForCausalLM`` of ~0.6M parameters (2 layers, hidden 64, 4 heads, 2 KV heads,
intermediate 128) with random weights (seeded) saved as safetensors, and a byte-level
BPE tokenizer (4,096 tokens) trained here with ``tokenizers`` on a fixed local corpus:
the Python sources of the pinned ``sglang`` wheel in the same venv (so the tokenizer
depends only on the pins). The chat template is ChatML (``<|im_start|>role\\n...<|im_end|>``)
and is stored in ``tokenizer_config.json``; ``AutoTokenizer.from_pretrained(dir)`` works
offline. Output text is random: use it for token counts, cached tokens and routing only.

Needs ``torch``, ``transformers``, ``tokenizers`` and ``safetensors`` (all in the SGLang
CPU venv), so it imports them lazily and never imports the project: it is run as a file,
``python model.py --out DIR``, by :func:`loadtest.sglang_cpu.env.ensure_model`, which
caches the result under a directory named after this file's hash.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 20261201
VOCAB_SIZE = 4096
CORPUS_BYTES = 4_000_000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
EOS, PAD = "<|im_end|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def corpus(limit_bytes: int = CORPUS_BYTES) -> Iterator[str]:
    """The pinned sglang wheel's Python sources, in a fixed order, up to ``limit_bytes``."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("model.py must run in the SGLang CPU venv (tools/sglang_cpu/install.sh)")
    root = Path(next(iter(spec.submodule_search_locations)))
    total = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def train_tokenizer() -> Any:
    tk: Any = importlib.import_module("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def save_tokenizer(tok: Any, out: Path) -> None:
    transformers: Any = importlib.import_module("transformers")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None,
        unk_token=None, model_max_length=LLAMA["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4 too
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def save_model(tok: Any, out: Path) -> None:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "architectures"},
                                      eos_token_id=ids[EOS], pad_token_id=ids[PAD], bos_token_id=None)
    config.architectures = LLAMA["architectures"]
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"eos_token_id": ids[EOS], "pad_token_id": ids[PAD], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def build(out: Path) -> Path:
    """Build the model in ``out`` atomically (a temporary sibling renamed at the end)."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # BPE training: one deterministic thread
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = train_tokenizer()
    save_tokenizer(tok, tmp)
    save_model(tok, tmp)
    check(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def check(path: Path) -> None:
    """The folder loads offline with AutoTokenizer and renders the chat template."""
    transformers: Any = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    if text != "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n":
        raise SystemExit(f"unexpected chat rendering: {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="model directory to create")
    args = parser.parse_args(argv)
    build(args.out)
    print(f"tiny model built in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
