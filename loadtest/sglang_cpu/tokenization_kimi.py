"""The tiny TikToken-form test model's tokenizer class, loaded by SGLang with ``--trust-remote-code``.

Written here (not copied) to behave as Moonshot's Kimi K2 ``tokenization_kimi.TikTokenTokenizer``
does, from the public facts of that format, so that the real SGLang server tokenizes the
tiny model exactly as it tokenizes Kimi K2.6 (SGLang even recognises the class by its
name and module, ``utils/patch_tokenizer.py``):

- the vocabulary is ``tiktoken.model``: ``base64(token bytes) rank`` per line;
- ``num_reserved_special_tokens + 2`` special ids follow the ranks, named from
  ``added_tokens_decoder`` of ``tokenizer_config.json``, else ``<|reserved_token_{id}|>``;
- Kimi's pre-tokenizer pattern (``pat_str``);
- ``encode(text)`` with no keyword (what SGLang calls) cuts the text in 400,000-character
  slices and each slice inside runs of more than 25,000 whitespace or non-whitespace
  characters, then encodes every piece with ``allowed_special="all"`` (no BOS);
- ``apply_chat_template`` sorts the tools' keys (``deep_sort_dict``) and, as Kimi K2.5 and
  later do, declares them in TypeScript style for the template (``tools_ts_str``, built by
  the model directory's ``tool_declaration_ts.py``: a copy of ``gateway/kimi_tools.py``).

``loadtest/sglang_cpu/kimi_model.py`` copies this file into the model directory; it is
never imported by the project (it needs ``transformers`` and ``tiktoken`` of the SGLang
venv, imported lazily so the project's static checks need neither).
"""
from __future__ import annotations

import base64
import importlib
import os
from collections.abc import Iterator
from typing import Any

_transformers: Any = importlib.import_module("transformers")
_tiktoken: Any = importlib.import_module("tiktoken")


def deep_sort_dict(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sort_dict(v) for v in value]
    return value


def load_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_names() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (token strings of the vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    names = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names


class TikTokenTokenizer(_transformers.PreTrainedTokenizer):  # type: ignore[misc]
    vocab_files_names = {"vocab_file": "tiktoken.model"}  # noqa: RUF012 - transformers' class attributes
    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012
    num_reserved_special_tokens = 256
    pat_str = "|".join([  # noqa: FLY002 - written as Kimi's class writes it
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str | None = None, pad_token: str | None = None,
                 additional_special_tokens: list[str] | None = None,
                 added_tokens_decoder: dict[int, Any] | None = None, **kwargs: Any) -> None:
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(vocab_file)
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_ranks(vocab_file)
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + self.num_reserved_special_tokens + 2)}
        self.model = _tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=self.pat_str,
                                        mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.n_words: int = self.model.n_vocab
        self.byte_names = byte_names()
        self.byte_values = {v: k for k, v in self.byte_names.items()}
        self.decoder = {i: "".join(self.byte_names[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.n_words)}
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens or [], **kwargs)
        self.all_special_ids_set = set(self.all_special_ids)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return list(super().encode(text, **kwargs))
        TIKTOKEN_MAX_ENCODE_CHARS = 400_000
        MAX_NO_WHITESPACES_CHARS = 25_000
        ids: list[int] = []
        for start in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in self._runs(text[start:start + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
                if allow_special_tokens:
                    ids += self.model.encode(piece, allowed_special="all")
                else:
                    ids += self.model.encode(piece, disallowed_special=())
        return ids

    @staticmethod
    def _runs(text: str, limit: int) -> Iterator[str]:
        """``text`` cut after every ``limit`` characters of a whitespace or non-whitespace run."""
        start = 0
        run = 0
        space = text[:1].isspace()
        for i, ch in enumerate(text):
            if ch.isspace() != space:
                space, run = not space, 1
                continue
            run += 1
            if run > limit:
                yield text[start:i]
                start, run = i, 1
        yield text[start:]

    def decode(self, token_ids: int | list[int], **kwargs: Any) -> str:
        if kwargs:
            return str(super().decode(token_ids, **kwargs))
        return str(self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids)))

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.special_tokens.get(str(self.unk_token), 0))

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, "")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_values[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            with open(self.vocab_file, "rb") as src, open(target, "wb") as dst:
                dst.write(src.read())
        return (target,)

    def apply_chat_template(self, conversation: Any, tools: list[dict[str, Any]] | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        tools = deep_sort_dict(tools)
        if tools and "tools_ts_str" not in kwargs:  # Kimi K2.5+: tools declared in TypeScript style
            # (imported here: transformers copies a sibling named by a relative import into its
            # module cache; the model builder imports this file alone, without that package)
            from .tool_declaration_ts import encode_tools_to_typescript_style  # type: ignore[import-not-found]
            kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
