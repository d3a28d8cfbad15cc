"""Build the tiny TikToken-form test model (run in the SGLang venv): Kimi K2's tokenizer layout.

The same tiny ``LlamaForCausalLM`` as :mod:`model` (random seeded weights), with its
tokenizer in the form Moonshot's Kimi K2 family ships (issue 42), so that the real SGLang
server loads it exactly as it loads Kimi K2.6 (``--trust-remote-code``):

- ``tiktoken.model``: the ranks of a byte-level BPE (4,096 tokens) trained here on the same
  fixed corpus as :mod:`model` (the pinned sglang wheel's sources), one
  ``base64(token bytes) rank`` line each;
- ``tokenizer_config.json``: ``auto_map`` -> ``tokenization_kimi.TikTokenTokenizer``, the
  special tokens in ``added_tokens_decoder`` at Kimi K2's offsets after the ranks
  (``[BOS]`` +0, ``[EOS]`` +1, ``<|im_end|>`` +2, ``<|im_user|>`` +3, ``<|im_assistant|>``
  +4, ``<|im_system|>`` +10, the tool-call section tokens +11..+15, ``<|im_middle|>`` +17,
  ``[UNK]`` +254, ``[PAD]`` +255; 258 special ids in all);
- ``tokenization_kimi.py``: this package's own class (:mod:`.tokenization_kimi`);
- ``tool_declaration_ts.py``: ``gateway/kimi_tools.py``, Kimi K2.5+'s TypeScript-style tool
  declaration, which the class hands to the template as ``tools_ts_str``;
- ``chat_template.jinja`` in Kimi's structure: a ``tool_declare`` system turn with
  ``tools_ts_str`` (the tools as compact JSON without it), a default system turn, ``<|im_system|>`` / ``<|im_user|>`` /
  ``<|im_assistant|>`` role tokens, ``<|im_middle|>`` after the role name, ``<|im_end|>``
  after each turn, tool calls in a ``<|tool_calls_section_begin|>`` section
  (``<|tool_call_begin|>id<|tool_call_argument_begin|>arguments<|tool_call_end|>``), tool
  results as ``## Return of <id>`` tool turns.

Run as a file, ``python kimi_model.py --out DIR``, by
:func:`loadtest.sglang_cpu.env.ensure_tiktoken_model` (cached under the hash of this file,
:mod:`model` and the tokenizer class).
"""
from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

MAX_POSITIONS = 32768


def _tiny() -> Any:
    """The sibling builder :mod:`model` (this file runs as a script beside it, in the venv)."""
    return importlib.import_module("model")

CLASS_FILE = Path(__file__).resolve().with_name("tokenization_kimi.py")
TOOLS_FILE = Path(__file__).resolve().parents[2] / "gateway" / "kimi_tools.py"  # Kimi K2.5+'s tool declaration
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
            11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
            14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
            254: "[UNK]", 255: "[PAD]"}
RESERVED = 258
CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
{%- if msg['content'] is string -%}{{ msg['content'] }}
{%- elif msg['content'] is not none -%}
{%- for content in msg['content'] -%}{%- if content['type'] == 'text' -%}{{ content['text'] }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>
{%- if tools_ts_str -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}
<|im_end|>
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a tiny test model.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role == 'system' -%}<|im_system|>system<|im_middle|>
{%- elif role == 'tool' -%}<|im_system|>tool<|im_middle|>
{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{%- else -%}<|im_user|>user<|im_middle|>
{%- endif -%}
{%- if role == 'tool' -%}## Return of {{ message['tool_call_id'] }}{{ '\\n' }}{{ render_content(message) }}
{%- elif role == 'assistant' and message.get('tool_calls') -%}
{{ render_content(message) }}<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- else -%}{{ render_content(message) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


def ranks_from_bpe(tok: Any) -> list[bytes]:
    """The trained byte-level BPE's tokens as bytes, in id order (the ranks)."""
    byte_of = {v: k for k, v in importlib.import_module("tokenization_kimi").byte_names().items()}
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [bytes(byte_of[c] for c in text) for text, _ in vocab if text not in _tiny().SPECIAL_TOKENS]
    assert len(set(tokens)) == len(tokens) and all(bytes([b]) in set(tokens) for b in range(256))
    return tokens


def save_tokenizer(ranks: list[bytes], out: Path) -> int:
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    base = len(ranks)
    added = {str(base + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True} for off, name in SPECIALS.items()}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
        "pad_token": "[PAD]", "additional_special_tokens": [n for o, n in sorted(SPECIALS.items()) if o not in
                                                            (0, 1, 254, 255)],
        "model_max_length": MAX_POSITIONS, "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    shutil.copy(CLASS_FILE, out / "tokenization_kimi.py")
    shutil.copy(TOOLS_FILE, out / "tool_declaration_ts.py")
    return base


def save_model(base: int, out: Path) -> None:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    eos, pad = base + 2, base + 255
    tiny = _tiny()
    values = {k: v for k, v in tiny.LLAMA.items() if k != "architectures"}
    values["vocab_size"] = base + RESERVED
    config = transformers.LlamaConfig(**values, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    config.architectures = tiny.LLAMA["architectures"]
    torch.manual_seed(tiny.SEED)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    gen = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def check(path: Path) -> None:
    """Loads offline through AutoTokenizer (trust_remote_code), renders Kimi's structure, and
    its ``encode`` is tiktoken's with every special token allowed."""
    transformers: Any = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=True)
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "functions.read:0", "type": "function", "function": {"name": "read", "arguments": {"p": 1}}}]},
                {"role": "tool", "tool_call_id": "functions.read:0", "content": "ok"}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    expected = ('<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n'
                'type read = (_: {}) => any;\n}\n<|im_end|><|im_system|>system<|im_middle|>You are a tiny test model.<|im_end|>'
                '<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>'
                '<|tool_calls_section_begin|><|tool_call_begin|>functions.read:0<|tool_call_argument_begin|>'
                '{"p": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>'
                '## Return of functions.read:0\nok<|im_end|><|im_assistant|>assistant<|im_middle|>')
    if text != expected:
        raise SystemExit(f"unexpected chat rendering: {text!r}")
    ids = tok.encode(text)
    if ids != tok.model.encode(text, allowed_special="all") or tok.encode("") != []:
        raise SystemExit("encode is not tiktoken's with every special allowed")


def build(out: Path) -> Path:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # BPE training: one deterministic thread
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    base = save_tokenizer(ranks_from_bpe(_tiny().train_tokenizer()), tmp)
    save_model(base, tmp)
    check(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="model directory to create")
    args = parser.parse_args(argv)
    build(args.out)
    print(f"tiny TikToken-form model built in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
