"""The two tokenizer forms precise mode reproduces, behind one small interface.

A model directory ships its tokenizer in one of two forms, and SGLang tokenizes with it:

- **tokenizer.json** (Hugging Face ``tokenizers``): ``HFTokenizerForm``. Chat prompts are
  encoded without the post-processor's specials, text prompts with them (a BOS if the
  model adds one), as SGLang's fast-tokenizer path does.
- **TikToken ranks** (Moonshot's Kimi K2 family): ``tiktoken.model`` (one ``base64 rank``
  line per token), ``tokenizer_config.json`` (``added_tokens_decoder``, ``auto_map``), and a
  tokenizer class loaded with ``trust_remote_code``: ``tokenization_kimi.TikTokenTokenizer``.
  That class builds a ``tiktoken.Encoding`` from the ranks with Kimi's pre-tokenizer
  pattern and ``num_reserved_special_tokens + 2`` special ids after the ranks (named from
  ``added_tokens_decoder``, else ``<|reserved_token_{id}|>``), and its ``encode(text)``
  (what SGLang calls, with no keyword, for chat and text prompts alike: it adds no BOS)
  cuts the text in 400,000-character slices, cuts each slice inside any run of more than
  25,000 whitespace or non-whitespace characters, and encodes every piece with
  ``allowed_special="all"``. ``TikTokenForm`` does the same with the ``tiktoken`` library.
  The class file is read, never executed (``ast``): its pattern, reserved count and cut
  sizes must be the ones known here, else the directory is ``tokenizer_class_differs``.
  Kimi K2.5 and later declare a request's tools in Python (``tool_declaration_ts.py``,
  handed to the template as ``tools_ts_str``): when that file is there and its layout
  constants are the ones ``gateway.kimi_tools`` reproduces, ``tool_declaration`` is
  ``"typescript"``; a class that declares tools some other way is ``"unknown"`` (its
  requests with tools are routed approximately, the others stay exact).

``load_form(directory)`` returns the form and the chat template text, or raises
``Unreproducible(reason, detail)`` with a reason from ``REASONS`` (a bounded label set:
the replica is then routed approximately and the reason shown in logs, metrics and the
admin API). Every ``encode`` releases the GIL while it works (``tokenizers``'
``encode_batch``; ``tiktoken``'s encode), so the thread pool that calls it
(``gateway.precise_pool``) leaves the event loop free.
"""
from __future__ import annotations

import ast
import base64
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gateway import kimi_tools, word_tokens

REASONS = ("no_local_tokenizer", "missing_files", "unknown_tokenizer_class", "tokenizer_class_differs",
           "unreadable", "template_error")

KIMI_MODULE, KIMI_CLASS = "tokenization_kimi", "TikTokenTokenizer"
KIMI_PATTERN_PARTS = (
    r"""[\p{Han}]+""",
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(KIMI_PATTERN_PARTS)  # Kimi's pre-tokenizer pattern (its class's ``pat_str``)
KIMI_RESERVED = 256
KIMI_SLICE_CHARS = 400_000
KIMI_RUN_CHARS = 25_000
# names in the class file that mean tools are declared some other way than the template's
# own rendering of ``tools`` (Kimi K2.5+: a TypeScript-style declaration built in Python)
TOOLS_REWRITTEN = ("tools_ts_str", "encode_tools_to_typescript_style")
KIMI_TOOLS_MODULE = "tool_declaration_ts"  # that declaration's module in the model directory


class Unreproducible(ValueError):
    """A model directory whose tokenization precise mode cannot reproduce exactly."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TokenizerForm(Protocol):
    """What precise mode needs of a tokenizer (one code path after loading)."""

    kind: str  # "tokenizer.json" | "tiktoken" | "sim-words"
    sort_tools: bool  # the tokenizer class sorts the tools' keys before rendering (Kimi)
    # who declares a request's tools: "template" (it renders ``tools``), "typescript" (Kimi
    # K2.5+'s ``tools_ts_str``, gateway.kimi_tools), "unknown" (not reproducible here)
    tool_declaration: str

    def encode(self, text: str, *, prompt: bool) -> list[int]:
        """Token ids of ``text`` as the engine encodes it: a rendered chat prompt
        (``prompt=False``), or a completions / generate text prompt (``prompt=True``)."""
        ...

    def encode_pieces(self, texts: list[str], *, specials: bool) -> list[list[int]]:
        """Token ids of pieces of a rendered prompt, already cut where the engine cuts
        (``specials``: they may hold special tokens, else they hold none)."""
        ...

    def split_tokens(self) -> Mapping[str, int]:
        """Tokens at which a text may be split and its pieces encoded alone to the same ids
        (empty: never split)."""
        ...

    def cuts(self, text: str) -> list[int]:
        """Positions where the engine itself cuts ``text`` before encoding (sorted)."""
        ...


class HFTokenizerForm:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    kind = "tokenizer.json"
    sort_tools = False
    tool_declaration = "template"

    def __init__(self, tokenizer: Any) -> None:
        # encode_batch would run on the library's process-wide rayon pool, whose threads take
        # every core and queue a small prompt's work behind a long one's: one thread per call
        # (the caller's, off the event loop). An operator's own setting is kept.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        simple = all(not (t.lstrip or t.rstrip or t.single_word or (t.normalized and not t.special))
                     for t in added.values())
        self._split = {t.content: i for i, t in added.items()} if simple else {}

    def encode(self, text: str, *, prompt: bool) -> list[int]:
        # encode_batch releases the GIL (encode does not)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=prompt)[0].ids)

    def encode_pieces(self, texts: list[str], *, specials: bool) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def split_tokens(self) -> Mapping[str, int]:
        return self._split

    def cuts(self, text: str) -> list[int]:
        return []


class WordForm:
    """The simulated replica's ids (``gateway.word_tokens``): they depend on each byte's
    offset modulo 4, so a prompt is never split (one numpy pass, well under a millisecond)."""

    kind = "sim-words"
    sort_tools = False
    tool_declaration = "template"

    def encode(self, text: str, *, prompt: bool) -> list[int]:
        return list(word_tokens.encode(text).tolist())

    def encode_pieces(self, texts: list[str], *, specials: bool) -> list[list[int]]:
        return [self.encode(t, prompt=False) for t in texts]

    def split_tokens(self) -> Mapping[str, int]:
        return {}

    def cuts(self, text: str) -> list[int]:
        return []


def _space_table() -> np.ndarray:
    top = 0x3000  # str.isspace() is False above U+3000
    return np.array([chr(c).isspace() for c in range(top + 1)], dtype=bool)


_SPACES = _space_table()


def long_run_cuts(text: str, start: int, run_chars: int) -> list[int]:
    """Cut positions (offset by ``start``) inside every run of more than ``run_chars``
    whitespace (``str.isspace``) or non-whitespace characters: after each ``run_chars`` of
    the run, counted from its start, as Kimi's ``_split_whitespaces_or_nonwhitespaces``
    cuts. Linear (numpy), whatever the text."""
    if len(text) <= run_chars:
        return []
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    top = _SPACES.size - 1
    space = np.take(_SPACES, np.minimum(points, top)) & (points <= top)
    starts = np.concatenate(([0], np.flatnonzero(space[1:] != space[:-1]) + 1))
    ends = np.append(starts[1:], points.size)
    cuts: list[int] = []
    for s, e in zip(starts[ends - starts > run_chars].tolist(), ends[ends - starts > run_chars].tolist(),
                    strict=True):
        cuts.extend(range(s + run_chars, e, run_chars))
    return [start + c for c in cuts]


class TikTokenForm:
    """Kimi's ``TikTokenTokenizer`` reproduced with ``tiktoken`` (see the module docstring)."""

    kind = "tiktoken"

    def __init__(self, encoding: Any, *, sort_tools: bool, tool_declaration: str,
                 slice_chars: int = KIMI_SLICE_CHARS, run_chars: int = KIMI_RUN_CHARS) -> None:
        self.encoding = encoding
        self.sort_tools = sort_tools
        self.tool_declaration = tool_declaration
        self.slice_chars = slice_chars
        self.run_chars = run_chars
        self._specials: dict[str, int] = {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}

    def encode(self, text: str, *, prompt: bool) -> list[int]:
        ids: list[int] = []
        bounds = [0, *self.cuts(text), len(text)]
        for a, b in itertools.pairwise(bounds):
            ids += self.encoding.encode(text[a:b], allowed_special="all")
        return ids

    def encode_pieces(self, texts: list[str], *, specials: bool) -> list[list[int]]:
        if specials:
            return [self.encoding.encode(t, allowed_special="all") for t in texts]
        return [self.encoding.encode_ordinary(t) for t in texts]

    def split_tokens(self) -> Mapping[str, int]:
        return self._specials

    def cuts(self, text: str) -> list[int]:
        out: list[int] = []
        for start in range(0, len(text), self.slice_chars):
            if start:
                out.append(start)
            out += long_run_cuts(text[start:start + self.slice_chars], start, self.run_chars)
        return out


# ---------------------------------------------------------------------- loading
@dataclass(frozen=True, slots=True)
class Loaded:
    form: TokenizerForm
    config: dict[str, Any]  # tokenizer_config.json (its chat_template resolved)
    template: str | None


def _config(root: Path) -> dict[str, Any]:
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Unreproducible("unreadable", f"{path}: {exc}") from exc
    if not isinstance(config, dict):
        raise Unreproducible("unreadable", f"{path}: not an object")
    return config


def chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` when present (it takes priority, as in transformers), else the
    config's ``chat_template`` (a list of named templates: the ``default`` one)."""
    file = root / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _auto_class(config: Mapping[str, Any]) -> str | None:
    auto = config.get("auto_map")
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(ref, list):
        ref = next((r for r in ref if isinstance(r, str)), None)
    return ref if isinstance(ref, str) else None


def load_form(directory: str | Path) -> Loaded:
    """The tokenizer form of a model directory (``Unreproducible`` when it cannot be exact)."""
    root = Path(directory)
    config = _config(root)
    template = chat_template(root, config)
    if config.get(word_tokens.TOKENIZER_KEY) == word_tokens.TOKENIZER_KIND:
        return Loaded(WordForm(), config, template)
    auto = _auto_class(config)
    if auto is not None:  # a class loaded with trust_remote_code: only the ones known here
        if auto.split("--")[-1] != f"{KIMI_MODULE}.{KIMI_CLASS}":
            raise Unreproducible("unknown_tokenizer_class", f"{root}: auto_map AutoTokenizer {auto!r}")
        return Loaded(_kimi_form(root, config), config, template)
    if (root / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            return Loaded(HFTokenizerForm(Tokenizer.from_file(str(root / "tokenizer.json"))), config, template)
        except Exception as exc:
            raise Unreproducible("unreadable", f"{root / 'tokenizer.json'}: {exc}") from exc
    if (root / "tiktoken.model").is_file():
        raise Unreproducible("unknown_tokenizer_class", f"{root}: tiktoken.model without a known auto_map class")
    raise Unreproducible("missing_files", f"{root}: no tokenizer.json, no tiktoken.model")


@dataclass(frozen=True, slots=True)
class KimiClass:
    """What ``tokenization_kimi.py`` declares, read from its syntax tree."""

    pattern: str | None
    reserved: int | None
    slice_chars: int | None
    run_chars: int | None
    sort_tools: bool
    tools_rewritten: bool


def _const(node: ast.AST) -> object:
    """A literal, or ``"sep".join([literals])`` (how Kimi writes its pattern); else None."""
    if isinstance(node, ast.Constant):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))):
        parts = [_const(e) for e in node.args[0].elts]
        if all(isinstance(p, str) for p in parts):
            return node.func.value.value.join(str(p) for p in parts)
    return None


def _names(tree: ast.AST) -> list[object]:
    """Every name the module mentions: variables, attributes, definitions, imports, string literals."""
    out: list[object] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(n.name)
        elif isinstance(n, ast.alias):
            out += [n.name.split(".")[-1], n.asname]
        elif isinstance(n, ast.Constant):
            out.append(n.value)
    return out


def read_kimi_class(source: str) -> KimiClass:
    tree = ast.parse(source)
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == KIMI_CLASS), None)
    if cls is None:
        raise ValueError(f"no class {KIMI_CLASS}")
    names: dict[str, object] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names.setdefault(node.targets[0].id, _const(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names.setdefault(node.target.id, _const(node.value))
    apply = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "apply_chat_template"), None)
    sorts = apply is not None and any(isinstance(n, ast.Name) and n.id == "deep_sort_dict" for n in ast.walk(apply))
    rewritten = any(name in TOOLS_REWRITTEN for name in _names(tree))

    def num(key: str) -> int | None:
        value = names.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    pattern = names.get("pat_str")
    return KimiClass(pattern if isinstance(pattern, str) else None, num("num_reserved_special_tokens"),
                     num("TIKTOKEN_MAX_ENCODE_CHARS"), num("MAX_NO_WHITESPACES_CHARS"), sorts, rewritten)


def read_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: ``base64(token bytes) rank`` per line (tiktoken's own format)."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _kimi_form(root: Path, config: Mapping[str, Any]) -> TikTokenForm:
    import tiktoken

    source, ranks_file = root / f"{KIMI_MODULE}.py", root / "tiktoken.model"
    missing = [p.name for p in (source, ranks_file) if not p.is_file()]
    if missing:
        raise Unreproducible("missing_files", f"{root}: {', '.join(missing)} missing")
    try:
        declared = read_kimi_class(source.read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        raise Unreproducible("unreadable", f"{source}: {exc}") from exc
    known = (KIMI_PATTERN, KIMI_RESERVED, KIMI_SLICE_CHARS, KIMI_RUN_CHARS)
    found = (declared.pattern, declared.reserved, declared.slice_chars, declared.run_chars)
    if found != known:
        differs = [name for name, a, b in zip(("pat_str", "num_reserved_special_tokens", "TIKTOKEN_MAX_ENCODE_CHARS",
                                               "MAX_NO_WHITESPACES_CHARS"), found, known, strict=True) if a != b]
        raise Unreproducible("tokenizer_class_differs", f"{source}: {', '.join(differs)} not Kimi's")
    try:
        ranks = read_ranks(ranks_file)
        decoder = config.get("added_tokens_decoder") or {}
        named = {int(i): str(t["content"]) for i, t in decoder.items() if isinstance(t, dict) and "content" in t}
        base = len(ranks)
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + KIMI_RESERVED + 2)}
        encoding = tiktoken.Encoding(name=ranks_file.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=specials)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unreproducible("unreadable", f"{root}: {exc}") from exc
    declaration = "template" if not declared.tools_rewritten else \
        "typescript" if _kimi_tools_known(root / f"{KIMI_TOOLS_MODULE}.py") else "unknown"
    return TikTokenForm(encoding, sort_tools=declared.sort_tools, tool_declaration=declaration)


def _kimi_tools_known(path: Path) -> bool:
    """``tool_declaration_ts.py`` defines ``encode_tools_to_typescript_style`` with the layout
    constants ``gateway.kimi_tools`` reproduces (read, never executed)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    consts = {n.targets[0].id: _const(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    defined = any(isinstance(n, ast.FunctionDef) and n.name == "encode_tools_to_typescript_style" for n in tree.body)
    return defined and all(consts.get(k) == v for k, v in kimi_tools.LAYOUT.items())
