"""Precise mode's tokenizer forms (gateway/precise_formats.py): Kimi's TikToken form gives
exactly the ids of Kimi's encode algorithm, segments and all; a directory that cannot be
reproduced exactly is refused with its reason."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.precise_chat import NotReproducible
from gateway.precise_formats import (
    KIMI_PATTERN,
    TikTokenForm,
    Unreproducible,
    long_run_cuts,
    read_ranks,
)
from gateway.precise_tokens import ModelTokenizer
from loadtest.sglang_cpu.kimi_model import CLASS_FILE
from tests.kv_events.kimi_dir import write_kimi_model
from tests.kv_events.tokmodel import write_model

SPECIAL_TEXT = st.sampled_from(["<|im_end|>", "<|im_user|>", "<|tool_call_begin|>", "<|reserved_token_300|>", "[EOS]"])
WORDS = st.sampled_from(["the", " cache", "def ", "  ", "\n", "é", "中文", "😀", "x" * 9, " " * 9, "<|", "|>", "<|im"])
TEXT = st.lists(st.one_of(WORDS, SPECIAL_TEXT), max_size=40).map("".join)


def kimi_runs(text: str, limit: int) -> list[str]:
    """Kimi's ``_split_whitespaces_or_nonwhitespaces``, as its class states it (the reference)."""
    out, start, run, space = [], 0, 0, text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            space, run = not space, 1
            continue
        run += 1
        if run > limit:
            out.append(text[start:i])
            start, run = i, 1
    return [*out, text[start:]]


def kimi_encode(encoding: tiktoken.Encoding, text: str, slice_chars: int, run_chars: int) -> list[int]:
    ids: list[int] = []
    for s in range(0, len(text), slice_chars):
        for piece in kimi_runs(text[s:s + slice_chars], run_chars):
            ids += encoding.encode(piece, allowed_special="all")
    return ids


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kimi_model(tmp_path_factory.mktemp("kimi"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "bb", " ", "\t", "\n", "\u3000", "\xa0", "é"]), max_size=60).map("".join),
       st.integers(1, 6))
def test_long_run_cuts_are_kimis(text: str, limit: int) -> None:
    bounds = [0, *long_run_cuts(text, 0, limit), len(text)]
    assert [text[a:b] for a, b in itertools.pairwise(bounds)] == kimi_runs(text, limit)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT, st.integers(5, 40), st.integers(2, 12))
def test_tiktoken_segments_equal_kimis_encode(kimi: Path, text: str, slice_chars: int, run_chars: int) -> None:
    tok = ModelTokenizer.from_dir(kimi)
    form = tok.form
    assert isinstance(form, TikTokenForm)
    small = TikTokenForm(form.encoding, sort_tools=True, tool_declaration="typescript", slice_chars=slice_chars,
                         run_chars=run_chars)
    tok.form = small
    expected = kimi_encode(form.encoding, text, slice_chars, run_chars)
    assert small.encode(text, prompt=False) == expected
    for _ in range(2):  # the second time from the segment cache
        assert [t for s in tok.segments(text) for t in s.ids] == expected


def test_the_kimi_layout(kimi: Path) -> None:
    tok = ModelTokenizer.from_dir(kimi)
    form = tok.form
    assert isinstance(form, TikTokenForm) and form.sort_tools and form.tool_declaration == "typescript"
    base = len(read_ranks(kimi / "tiktoken.model"))
    specials = form.split_tokens()
    assert len(specials) == 258 and specials["[BOS]"] == base and specials["<|im_end|>"] == base + 2
    assert specials["<|im_middle|>"] == base + 17 and specials[f"<|reserved_token_{base + 5}|>"] == base + 5
    assert form.encoding._pat_str == KIMI_PATTERN
    assert tok.content_format == "openai" and tok.inline_system


def test_tools_are_sorted_and_rendered_as_the_engine_dumps_them(tmp_path: Path) -> None:
    """A Kimi K2 class that leaves the tools to the template (no TypeScript declaration)."""
    source = "\n".join(line for line in CLASS_FILE.read_text().splitlines()
                       if "tool_declaration_ts import" not in line and "tools_ts_str" not in line.split("#")[0]
                       and not line.strip().startswith("# (imported here") and "module cache;" not in line)
    tok = ModelTokenizer.from_dir(write_kimi_model(tmp_path / "k2", class_source=source))
    assert tok.form.tool_declaration == "template"
    text = tok.render_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}, "strict": True}}]})
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"defer_loading":null,"function":'
                           '{"description":null,"name":"f","parameters":{"a":2,"b":1},"strict":true},'
                           '"type":"function"}]<|im_end|>')
    none = tok.render_chat({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
                            "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert "tool_declare" not in none


def _class_with(old: str, new: str) -> str:
    source = CLASS_FILE.read_text()
    assert old in source
    return source.replace(old, new)


@pytest.mark.parametrize("change, reason", [
    (("num_reserved_special_tokens = 256", "num_reserved_special_tokens = 255"), "tokenizer_class_differs"),
    ((r'r"""\p{N}{1,3}""",', r'r"""\p{N}{1,2}""",'), "tokenizer_class_differs"),
    (("MAX_NO_WHITESPACES_CHARS = 25_000", "MAX_NO_WHITESPACES_CHARS = 20_000"), "tokenizer_class_differs"),
    (("class TikTokenTokenizer(", "class OtherTokenizer("), "unreadable"),
])
def test_a_class_that_differs_is_refused(tmp_path: Path, change: tuple[str, str], reason: str) -> None:
    root = write_kimi_model(tmp_path / "m", class_source=_class_with(*change))
    with pytest.raises(Unreproducible) as caught:
        ModelTokenizer.from_dir(root)
    assert caught.value.reason == reason


def test_unreproducible_directories_name_their_reason(tmp_path: Path) -> None:
    def reason(root: Path) -> str:
        with pytest.raises(Unreproducible) as caught:
            ModelTokenizer.from_dir(root)
        return caught.value.reason

    unknown = write_kimi_model(tmp_path / "unknown")
    config = (unknown / "tokenizer_config.json").read_text().replace("tokenization_kimi.TikTokenTokenizer",
                                                                     "tokenization_other.Other")
    (unknown / "tokenizer_config.json").write_text(config)
    assert reason(unknown) == "unknown_tokenizer_class"
    missing = write_kimi_model(tmp_path / "missing")
    (missing / "tiktoken.model").unlink()
    assert reason(missing) == "missing_files"
    (tmp_path / "empty").mkdir()
    assert reason(tmp_path / "empty") == "missing_files"
    assert reason(write_kimi_model(tmp_path / "bad-template", template="{% for %}")) == "template_error"
    assert reason(write_kimi_model(tmp_path / "raising", template="{{ raise_exception('no') }}")) == "template_error"
    garbled = write_model(tmp_path / "garbled")
    (garbled / "tokenizer_config.json").write_text("{not json")
    assert reason(garbled) == "unreadable"


def test_kimi_k25_tool_declarations_are_rendered_as_the_class_renders_them(tmp_path: Path) -> None:
    """The class declares tools in TypeScript style (``tools_ts_str``): with the model's
    ``tool_declaration_ts.py`` in the layout known here, the prompt holds that declaration;
    a schema it cannot declare, or a declaration module not known here, is approximate."""
    tok = ModelTokenizer.from_dir(write_kimi_model(tmp_path / "k26"))
    assert tok.form.tool_declaration == "typescript"
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}}}]
    text = tok.render_chat({**plain, "tools": tools})
    assert "tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n" \
           "type f = (_: {\n  b: number,\n  a?: string\n}) => any;\n}\n<|im_end|>" in text
    assert tok.prompt_segments("chat", {**plain, "tools": tools})
    with pytest.raises(NotReproducible):  # an unresolved $ref: never a guessed declaration
        tok.prompt_segments("chat", {**plain, "tools": [{"type": "function", "function": {
            "name": "g", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/definitions/X"}}}}}]})
    (tmp_path / "k26" / "tool_declaration_ts.py").write_text("_TS_INDENT = '    '\n"
                                                             "def encode_tools_to_typescript_style(tools): ...\n")
    other = ModelTokenizer.from_dir(tmp_path / "k26")
    assert other.form.tool_declaration == "unknown"
    assert other.prompt_segments("chat", plain)  # without tools: exact
    with pytest.raises(NotReproducible):
        other.prompt_segments("chat", {**plain, "tools": tools})
