"""Precise mode's request token ids and SGLang page hashes, with CPU bounded per turn.

The page hashes a replica publishes in its KV events are over *its* token ids, so the
gateway reproduces the engine's tokenization: the model's ``tokenizer.json``
(``tokenizers``) and the chat template of its ``tokenizer_config.json`` (jinja2, as
``transformers.apply_chat_template`` renders it, ``add_generation_prompt=True``), from
the replica's ``model_path`` when it is a local directory or ``index.tokenizer_dir``.

- chat: render the template, then tokenize without the post-processor's specials
  (``apply_chat_template(tokenize=True)`` does ``add_special_tokens=False``);
- completions / generate with text: tokenize with the post-processor (a BOS if the model
  adds one), as SGLang's tokenizer manager does; token id prompts are taken as sent.

Cost bound. Tokenizing a 400 KB conversation every turn would cost tens of ms, so:

1. *Segments.* The rendered text is split at the tokenizer's added tokens (``<|im_start|>``
   ...), exactly where the tokenizer itself splits before pre-tokenizing, so the pieces
   tokenize independently to the same ids. Each piece's ids are cached by content
   (``xxh3_128``): a later turn only tokenizes its new messages. A tokenizer whose added
   tokens strip spaces or match normalized text is tokenized whole (no segment cache).
2. *Per-session chains.* Per session key, the last turn's segment keys, token ids and
   page hashes (with a digest checkpoint every ``CHECKPOINT_PAGES`` pages) are kept; a
   turn reuses the hashes of its common segment prefix and hashes only the rest.

Both caches are bounded LRUs (tokens, pages). Measured: ``kvgate bench hashing --precise``.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway import word_tokens
from gateway.sglang_pages import PageHasher

CHECKPOINT_PAGES = 64
SEGMENT_CACHE_TOKENS = 2_000_000
SESSION_CACHE_PAGES = 2_000_000
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# ~16k tokens, ~30 ms of a BPE tokenizer on this class of CPU: a conversation new to the
# gateway (400 KB) is tokenized over a few turns instead of stalling the loop ~0.2 s once
UNCACHED_CHARS_PER_REQUEST = 64 * 1024


class TemplateError(ValueError):
    """The chat template could not render this request (it is then routed approximately)."""


class OverBudget(TemplateError):
    """Tokenizing what is not cached yet would exceed the per-request budget: the pieces
    within it were tokenized and cached, the request is routed approximately, and a later
    turn of the conversation continues from the cache."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Segment:
    key: bytes  # xxh3_128 of the text (or of the ids, for token prompts)
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Encoding:
    ids: list[int]


class WordTokenizer:
    """The simulated replica's ids (``gateway.word_tokens``) behind the part of the
    ``tokenizers.Tokenizer`` interface used here. Its ids depend on each byte's offset
    modulo 4, so it has no added tokens to split at: a prompt is one segment (encoding
    400 KB is one numpy pass, well under a millisecond)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return _Encoding(word_tokens.encode(text).tolist())

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {}


class ModelTokenizer:
    """One model's tokenizer and chat template, with the content cache of segments."""

    def __init__(self, tokenizer: Tokenizer | WordTokenizer, config: Mapping[str, Any], *,
                 cache_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.specials = {k: v for k in SPECIAL_NAMES if (v := _token_text(config.get(k))) is not None}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template) if isinstance(template, str) else None
        added = tokenizer.get_added_tokens_decoder()
        simple = all(not (t.lstrip or t.rstrip or t.single_word or (t.normalized and not t.special))
                     for t in added.values())
        self._added = {t.content: i for i, t in added.items()}
        self._split = (re.compile("(" + "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
                                  + ")") if simple and self._added else None)
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cache_tokens = 0
        self.cache_limit = cache_tokens
        # Bound on the event loop's time per request: characters of not-yet-cached text
        # tokenized per request (at least one piece); beyond it, OverBudget.
        self.budget_chars = UNCACHED_CHARS_PER_REQUEST
        self._spent = 0

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelTokenizer:
        """From a model directory (``tokenizer.json``, ``tokenizer_config.json``); OSError/ValueError if unusable.

        A ``tokenizer_config.json`` naming the simulated replica's scheme
        (``gateway.word_tokens``) gets that scheme instead of ``tokenizer.json``."""
        root = Path(directory)
        config_path = root / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        tokenizer: Tokenizer | WordTokenizer
        if config.get(word_tokens.TOKENIZER_KEY) == word_tokens.TOKENIZER_KIND:
            tokenizer = WordTokenizer()
        else:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        template_file = root / "chat_template.jinja"
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        return cls(tokenizer, config)

    # ------------------------------------------------------------------ rendering
    def render_chat(self, payload: Mapping[str, Any]) -> str:
        """The chat prompt text SGLang renders for this request body."""
        if self.template is None:
            raise TemplateError("the model has no chat template")
        messages = [_template_message(m) for m in payload.get("messages") or [] if isinstance(m, dict)]
        tools = payload.get("tools")
        tool_list = [t.get("function", t) for t in tools if isinstance(t, dict)] if isinstance(tools, list) else None
        kwargs = payload.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, dict) else {}
        try:
            return self.template.render(messages=messages, tools=tool_list or None, add_generation_prompt=True,
                                        **self.specials, **extra)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ tokenizing
    def segments(self, text: str, *, add_special_tokens: bool = False) -> list[Segment]:
        """The text's token ids as cached segments (one segment when it cannot be split safely)."""
        if self._split is None or add_special_tokens:
            return [self._segment(text, add_special_tokens)]
        out: list[Segment] = []
        for i, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            if i % 2:  # an added token
                out.append(Segment(piece.encode(), (self._added[piece],)))
            else:
                out.append(self._segment(piece, False))
        return out

    def _segment(self, text: str, add_special_tokens: bool) -> Segment:
        key = xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass")) + (b"+" if add_special_tokens else b"")
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            return Segment(key, ids)
        if self._spent and self._spent + len(text) > self.budget_chars:
            raise OverBudget(f"more than {self.budget_chars} characters to tokenize in one request")
        self._spent += len(text)
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        self._cache[key] = ids
        self._cache_tokens += len(ids)
        while self._cache_tokens > self.cache_limit and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_tokens -= len(old)
        return Segment(key, ids)

    def prompt_segments(self, endpoint: str, payload: Mapping[str, Any]) -> list[Segment] | None:
        """The request's prompt as segments, or None when it is not a single prompt we can tokenize.

        Raises ``OverBudget`` when more than ``budget_chars`` of it are not cached yet."""
        self._spent = 0
        if endpoint in ("chat", "messages"):
            chat = payload if endpoint == "chat" else anthropic_to_chat(payload)
            return self.segments(self.render_chat(chat)) if chat is not None else None
        prompt = payload.get("prompt") if endpoint == "completions" else payload.get("input_ids", payload.get("text"))
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.segments(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = tuple(prompt)
            return [Segment(xxhash.xxh3_128_digest(repr(ids).encode()), ids)]
        return None


def _texts(blocks: Any) -> list[str] | None:
    """The texts of a list of text blocks (None: some block is not text)."""
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        return None
    return [str(b.get("text") or "") for b in blocks]


def anthropic_to_chat(payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """An Anthropic Messages body as SGLang 0.5.23 converts it to a chat request
    (``entrypoints/anthropic/serving.py``), for text, tool_use and text tool_result blocks;
    None (routed approximately) for tools, images, thinking or inline system messages."""
    if payload.get("tools") or any(isinstance(m, dict) and m.get("role") == "system"
                                   for m in payload.get("messages") or []):
        return None
    system = payload.get("system")
    system_parts = [system] if isinstance(system, str) and system.strip() else (
        [t for t in _texts(system) or [] if t] if isinstance(system, list) else [])
    out: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(system_parts)}] if system_parts else []
    for msg in payload.get("messages") or []:
        role, content = msg.get("role"), msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "", "type": "function", "function": {
                    "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                parts = _texts(result) if isinstance(result, list) else [str(result) if result else ""]
                if parts is None or texts:
                    return None  # images in a result, or text before it (SGLang splits the turn)
                kept = [t for t in parts if t]
                tool: Any = kept[0] if len(kept) == 1 else [{"type": "text", "text": t} for t in kept] or ""
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": tool})
            else:
                return None
        message: dict[str, Any] = {"role": role}
        if calls:
            message["tool_calls"] = calls
        if texts:
            message["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        elif not calls:
            if role == "user":
                continue
            message["content"] = ""
        out.append(message)
    return {"messages": out}


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as SGLang hands it to the template: no content is "", a tool result's text
    parts joined by spaces, tool call arguments parsed to objects (``serving_chat.py``)."""
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif out.get("role") == "tool" and isinstance(content, list) and all(
            isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in content):
        out["content"] = " ".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn = {**fn, "arguments": json.loads(fn["arguments"])}
                except ValueError:
                    pass
                call = {**call, "function": fn}
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


@dataclass(slots=True)
class _Chain:
    keys: list[bytes]
    ends: list[int]  # tokens after each segment
    tokens: list[int]
    hashes: list[int]
    checkpoints: list[bytes]


@dataclass(frozen=True, slots=True)
class PromptHashes:
    tokens: int  # the prompt's token count
    hashes: tuple[int, ...]  # page hashes of the pages the engine can reuse (not the last token's)
    page_size: int


@dataclass
class SessionHasher:
    """Page hashes of prompts, reusing a session's previous turn (bounded by pages kept)."""

    page_size: int
    bigram: bool = False
    max_pages: int = SESSION_CACHE_PAGES
    _chains: OrderedDict[str, _Chain] = field(default_factory=OrderedDict)
    _pages: int = 0

    def hash(self, segments: Sequence[Segment], session: str | None) -> PromptHashes:
        old = self._chains.pop(session, None) if session is not None else None
        if old is not None:
            self._pages -= len(old.hashes)
        common = 0
        if old is not None:
            for a, b in zip(old.keys, segments, strict=False):
                if a != b.key:
                    break
                common += 1
        reuse_tokens = old.ends[common - 1] if old is not None and common else 0
        usable = max(reuse_tokens - (1 if self.bigram else 0), 0) // self.page_size
        kept = min(usable // CHECKPOINT_PAGES, len(old.checkpoints) if old is not None else 0)
        start_page = kept * CHECKPOINT_PAGES
        tokens = old.tokens[:reuse_tokens] if old is not None else []
        ends = old.ends[:common] if old is not None else []
        for seg in segments[common:]:
            tokens.extend(seg.ids)
            ends.append(len(tokens))
        hasher = PageHasher.resume(self.page_size, self.bigram, old.hashes[:start_page] if old else [],
                                   old.checkpoints[:kept] if old else [], tokens[start_page * self.page_size:],
                                   CHECKPOINT_PAGES)
        hasher.extend(())
        n_keys = len(tokens) - (1 if self.bigram else 0)
        reusable = max(n_keys - 1, 0) // self.page_size  # the engine always computes the last token
        answer = PromptHashes(len(tokens), tuple(hasher.hashes[:reusable]), self.page_size)
        if session is not None:
            self._remember(session, _Chain([s.key for s in segments], ends, tokens, hasher.hashes,
                                           hasher.checkpoints))
        return answer

    def _remember(self, session: str, chain: _Chain) -> None:
        self._chains[session] = chain
        self._pages += len(chain.hashes)
        while self._pages > self.max_pages and self._chains:
            _, dropped = self._chains.popitem(last=False)
            self._pages -= len(dropped.hashes)

    def __len__(self) -> int:
        return len(self._chains)
