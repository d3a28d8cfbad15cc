"""Precise mode's request token ids and SGLang page hashes, in a worker thread.

The page hashes a replica publishes in its KV events are over *its* token ids, so the
gateway reproduces the engine's tokenization: the model's tokenizer in either form
(``gateway.precise_formats``: ``tokenizer.json``, or Kimi's TikToken ranks) and its chat
template (jinja2, as ``transformers.apply_chat_template`` renders it,
``add_generation_prompt=True``) over the messages and tools SGLang hands it
(``gateway.precise_chat``: chat, Anthropic Messages and Responses bodies, tools and tool
calls included), from the replica's ``model_path`` when it is a local directory or
``index.tokenizer_dir``.

- chat, messages, responses: render the template, then encode as the engine encodes a
  rendered prompt (no specials added);
- completions / generate with text: encode as the engine encodes a text prompt (a
  ``tokenizer.json`` post-processor's BOS, if the model adds one); token id prompts are
  taken as sent.

Cost. This runs in ``gateway.precise_pool``'s worker threads (the tokenizers release the
GIL), never on the event loop; the caches below are shared by the workers under a lock.

1. *Segments.* The rendered text is cut where the engine cuts it (Kimi: 400,000-character
   slices, long runs) and split at the tokenizer's special / added tokens, exactly where
   the tokenizer itself splits before pre-tokenizing, so the pieces encode independently
   to the same ids. Each piece's ids are cached by content (``xxh3_128``): a later turn
   only encodes its new messages. A tokenizer whose added tokens strip spaces or match
   normalized text is encoded whole (no segment cache).
2. *Per-session chains.* Per session key, the last turn's segment keys, token ids and
   page hashes (with a digest checkpoint every ``CHECKPOINT_PAGES`` pages) are kept; a
   turn reuses the hashes of its common segment prefix and hashes only the rest.

Both caches are bounded LRUs (tokens, pages). Measured: ``kvgate bench hashing --precise``.
"""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
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

from gateway import kimi_tools, precise_chat
from gateway.precise_chat import ChatRequest, NotReproducible
from gateway.precise_formats import Loaded, TokenizerForm, Unreproducible, load_form
from gateway.sglang_pages import PageHasher

CHECKPOINT_PAGES = 64
YIELD_PAGES = 256  # hashing yields the GIL this often (~0.3 ms of work), see sglang_pages.PageHasher
HASH_CHUNK_TOKENS = 8192  # tokens converted and hashed at a time (then the GIL is yielded)
SEGMENT_CACHE_TOKENS = 2_000_000
SESSION_CACHE_PAGES = 2_000_000
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
INLINE_SYSTEM_SENTINEL = "__kvgate_inline_system_sentinel__"


class TemplateError(NotReproducible):
    """The chat template could not render this request (it is then routed approximately)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def compile_template(template: str) -> jinja2.Template:
    """The template in transformers' environment (sandboxed, trim/lstrip blocks, loop controls,
    its ``tojson``, ``raise_exception``, ``strftime_now``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _alternation(tokens: Sequence[str]) -> str:
    """A regex matching any of ``tokens`` (a prefix-free set), grouped by their first two
    characters: ``re`` then tries only the few tokens sharing a text's two characters (one
    alternation of 258 tokens costs ~6 ms over 400 KB of code, the grouped one ~1.5 ms:
    time in one C call, the GIL held)."""
    groups: dict[str, list[str]] = {}
    for token in tokens:
        groups.setdefault(token[:2], []).append(token[2:])
    return "|".join(re.escape(head) + "(?:" + "|".join(re.escape(t) for t in sorted(tails, key=len, reverse=True))
                    + ")" for head, tails in groups.items())


@dataclass(frozen=True, slots=True)
class Segment:
    key: bytes  # xxh3_128 of the text (or of the ids, for token prompts)
    ids: tuple[int, ...]


class ModelTokenizer:
    """One model's tokenizer and chat template, with the content cache of segments (thread-safe)."""

    def __init__(self, loaded: Loaded, *, cache_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self.form: TokenizerForm = loaded.form
        config = loaded.config
        self.specials = {k: v for k in SPECIAL_NAMES if (v := _token_text(config.get(k))) is not None}
        self.template: jinja2.Template | None = None
        self.content_format = "string"
        self.inline_system = False
        if loaded.template is not None:
            try:
                self.template = compile_template(loaded.template)
                self._render([{"role": "user", "content": "hi"}], None, {})
            except (jinja2.TemplateError, NotReproducible, TypeError, ValueError) as exc:
                raise Unreproducible("template_error", f"{exc}") from exc
            self.content_format = precise_chat.content_format(loaded.template)
            self.inline_system = self._renders_inline_system()
        split = self.form.split_tokens()
        names = sorted(split, key=len, reverse=True)
        prefix_free = not any(a != b and b.startswith(a) for a in names for b in names)
        self._added = dict(split)
        self._split = re.compile(f"({_alternation(names)})") if names and prefix_free else None
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cache_tokens = 0
        self._lock = threading.Lock()
        self.cache_limit = cache_tokens

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelTokenizer:
        """From a model directory (``precise_formats.load_form``); ``Unreproducible`` if it cannot be exact."""
        return cls(load_form(directory))

    # ------------------------------------------------------------------ rendering
    def _renders_inline_system(self) -> bool:
        """Whether a system message after the first turn renders where it is (SGLang's probe;
        Responses bodies keep their system messages in place then, else merge them first)."""
        try:
            text = self._render([{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                                 {"role": "system", "content": INLINE_SYSTEM_SENTINEL},
                                 {"role": "user", "content": "t"}], None, {}, generation=False)
        except NotReproducible:
            return False
        return INLINE_SYSTEM_SENTINEL in text

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, extra: Mapping[str, Any],
                generation: bool = True) -> str:
        if self.template is None:
            raise TemplateError("the model has no chat template")
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=generation,
                                        **{**self.specials, **extra})
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc

    def render_request(self, request: ChatRequest) -> str:
        """The prompt text SGLang renders for a chat request (tools in its dump; on a failure,
        as SGLang retries: the tools as bare functions)."""
        tools = precise_chat.template_tools(request, self.form.sort_tools)
        messages = precise_chat.template_messages(request, self.content_format)
        try:
            return self._render(messages, tools, self._declared(tools, request.kwargs))
        except TemplateError:
            if not tools:
                raise
            bare = [t.get("function", t) for t in tools]
            return self._render(messages, bare, self._declared(bare, request.kwargs))

    def _declared(self, tools: list[Any] | None, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """The template's arguments with the tools' declaration when the tokenizer class
        builds it (Kimi K2.5+: ``tools_ts_str``, unless the request set it)."""
        declaration = self.form.tool_declaration
        if not tools or declaration == "template" or "tools_ts_str" in kwargs:
            return kwargs
        if declaration != "typescript":
            raise NotReproducible("the tokenizer class declares tools in a way not known here")
        try:
            return {**kwargs, "tools_ts_str": kimi_tools.encode_tools_to_typescript_style(tools)}
        except Exception as exc:  # a client's schema, whatever it holds: routed approximately
            raise NotReproducible(f"tool declaration: {type(exc).__name__}") from exc

    def render_chat(self, payload: Mapping[str, Any], endpoint: str = "chat") -> str:
        """The chat prompt text SGLang renders for this chat / messages / responses body."""
        if endpoint == "responses":
            request = precise_chat.responses_to_chat(payload, self.inline_system)
        else:
            request = precise_chat.chat_request(endpoint, payload)
        return self.render_request(request)

    # ------------------------------------------------------------------ tokenizing
    def _pieces(self, text: str) -> list[tuple[str, int | None]]:
        """The text cut where the engine cuts it, then split at special tokens: (piece, special id)."""
        bounds = [0, *self.form.cuts(text), len(text)]
        out: list[tuple[str, int | None]] = []
        for a, b in itertools.pairwise(bounds):
            chunk = text[a:b]
            if self._split is None:
                out.append((chunk, None))
                continue
            for i, piece in enumerate(self._split.split(chunk)):
                if piece:
                    out.append((piece, self._added[piece] if i % 2 else None))
        return out

    def segments(self, text: str, *, prompt: bool = False) -> list[Segment]:
        """The text's token ids as cached segments (``prompt``: a text prompt, else a rendered chat)."""
        if prompt and self.form.kind == "tokenizer.json":  # the post-processor may add specials: whole
            key = xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass")) + b"+"
            return [Segment(key, self._cached(key) or self._store(key, self.form.encode(text, prompt=True)))]
        pieces = self._pieces(text)
        keys = [piece.encode() if special is not None else xxhash.xxh3_128_digest(
            piece.encode("utf-8", "surrogatepass")) for piece, special in pieces]
        found: dict[int, tuple[int, ...]] = {}
        with self._lock:
            for i, ((_, special), key) in enumerate(zip(pieces, keys, strict=True)):
                if special is None and (hit := self._cache.get(key)) is not None:
                    self._cache.move_to_end(key)
                    found[i] = hit
        missing = [i for i, (_, special) in enumerate(pieces) if special is None and i not in found]
        if missing:
            encoded = self.form.encode_pieces([pieces[i][0] for i in missing], specials=self._split is None)
            for i, new in zip(missing, encoded, strict=True):
                found[i] = self._store(keys[i], new)
        return [Segment(key, (special,) if special is not None else found[i])
                for i, ((_, special), key) in enumerate(zip(pieces, keys, strict=True))]

    def clear_cache(self) -> None:
        """Forget every cached segment (benchmarks of a first turn)."""
        with self._lock:
            self._cache.clear()
            self._cache_tokens = 0

    def _cached(self, key: bytes) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._cache.get(key)
            if ids is not None:
                self._cache.move_to_end(key)
            return ids

    def _store(self, key: bytes, ids: Sequence[int]) -> tuple[int, ...]:
        kept = tuple(ids)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = kept
                self._cache_tokens += len(kept)
            while self._cache_tokens > self.cache_limit and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_tokens -= len(old)
        return kept

    def prompt_segments(self, endpoint: str, payload: Mapping[str, Any]) -> list[Segment] | None:
        """The request's prompt as segments, or None when it is not a single prompt we can tokenize.

        Raises ``NotReproducible`` (``TemplateError`` among them) for a prompt precise mode
        cannot reproduce exactly."""
        if endpoint in ("chat", "messages", "responses"):
            return self.segments(self.render_chat(payload, endpoint))
        prompt = payload.get("prompt") if endpoint == "completions" else payload.get("input_ids", payload.get("text"))
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.segments(prompt, prompt=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = tuple(prompt)
            return [Segment(xxhash.xxh3_128_digest(repr(ids).encode()), ids)]
        return None


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
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hash(self, segments: Sequence[Segment], session: str | None) -> PromptHashes:
        old = None
        if session is not None:
            with self._lock:
                old = self._chains.pop(session, None)
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
                                   old.checkpoints[:kept] if old else [], [], CHECKPOINT_PAGES, YIELD_PAGES)
        for at in range(start_page * self.page_size, len(tokens), HASH_CHUNK_TOKENS):
            hasher.extend(tokens[at:at + HASH_CHUNK_TOKENS])  # in chunks: each yields the GIL after it
            time.sleep(0)
        n_keys = len(tokens) - (1 if self.bigram else 0)
        reusable = max(n_keys - 1, 0) // self.page_size  # the engine always computes the last token
        answer = PromptHashes(len(tokens), tuple(hasher.hashes[:reusable]), self.page_size)
        if session is not None:
            self._remember(session, _Chain([s.key for s in segments], ends, tokens, hasher.hashes,
                                           hasher.checkpoints))
        return answer

    def _remember(self, session: str, chain: _Chain) -> None:
        with self._lock:
            replaced = self._chains.pop(session, None)
            if replaced is not None:
                self._pages -= len(replaced.hashes)
            self._chains[session] = chain
            self._pages += len(chain.hashes)
            while self._pages > self.max_pages and self._chains:
                _, dropped = self._chains.popitem(last=False)
                self._pages -= len(dropped.hashes)

    def __len__(self) -> int:
        return len(self._chains)

    def knows(self, session: str | None) -> bool:
        """Whether a chain is kept for this session (its next turn is mostly cached)."""
        return session is not None and session in self._chains
