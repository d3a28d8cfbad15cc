"""Kimi K2.5+'s TypeScript-style tool declaration (``gateway.kimi_tools``).

The expected texts follow the format's rules as the module docstring states them; each
was also checked against the public reference encoder outside this repository (a
differential run over 6,000 generated schemas: equal text, or both refuse)."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.kimi_tools import SchemaError, encode_tools_to_typescript_style
from gateway.precise_chat import deep_sorted


def declare(tools: list[dict[str, Any]]) -> str:
    return encode_tools_to_typescript_style(deep_sorted(tools))  # the class sorts the keys first


def fn(name: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    function = {"name": name, **extra} | ({"parameters": parameters} if parameters is not None else {})
    return {"type": "function", "function": function}


def test_a_coding_agents_tool() -> None:
    bash = fn("Bash", {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
        "required": ["command"],
        "properties": {"command": {"type": "string", "description": "The command to execute"},
                       "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
                       "run_in_background": {"type": "boolean", "default": False},
                       "files": {"type": "array", "items": {"type": "string", "description": "a path"}, "minItems": 1},
                       "mode": {"type": "string", "enum": ["a", "b"]}}},
        description="Executes a bash command.\n\nUse with care.")
    assert declare([bash]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// Executes a bash command.\n\n// Use with care.\n"
        "type Bash = (_: {\n"
        "  // The command to execute\n  command: string,\n"        # required first, then optional, by name
        "  // minItems: 1\n  files?: Array<\n    // a path\n    string\n  >,\n"
        '  mode?: "a" | "b",\n'
        "  // Default: False\n  run_in_background?: boolean,\n"    # Python's repr, as the original prints it
        "  // Optional timeout in milliseconds\n  timeout?: number,\n"
        "  [k: string]: never\n"
        "}) => any;\n}\n")


def test_definitions_and_a_self_reference() -> None:
    tree = fn("tree", {
        "type": "object", "required": ["leaf"],
        "$defs": {"Leaf": {"type": "object", "description": "a leaf", "required": ["v"],
                           "properties": {"v": {"type": "integer", "minimum": 0}}}},
        "properties": {"leaf": {"$ref": "#/$defs/Leaf"}, "children": {"type": "array", "items": {"$ref": "#"}}}},
        description="A tree.")
    assert declare([tree]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "interface parameters {\n  children?: Array<parameters>,\n  leaf: Leaf\n}\n"  # the root's own order
        "// a leaf\ninterface Leaf {\n  // minimum: 0\n  v: number\n}\n"
        "// A tree.\ntype tree = (_: parameters) => any;\n}\n")


def test_unions_extra_properties_and_skipped_tools() -> None:
    put = fn("put", {"type": "object", "required": [], "properties": {
        "value": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "v"},
        "kind": {"type": ["string", "null"]},
        "meta": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 5}},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"], "description": "tag"},
                 "maxItems": 3, "default": ["a"]}}})
    plugin = {"type": "_plugin", "function": {"name": "skip"}}
    assert declare([put, plugin, fn("empty")]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "type put = (_: {\n"
        "  kind?: string | null,\n"
        "  meta?: {\n    [k: string]: string\n  },\n"
        '  // maxItems: 3\n  // Default: ["a"]\n  tags?: Array<\n    // tag\n    "a" | "b"\n  >,\n'
        "  // v\n  value?: string | null\n"
        "}) => any;\n"
        "type empty = (_: {}) => any;\n}\n")
    assert declare([plugin]) == "" and declare([]) == ""


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"x": {"$ref": "#/definitions/X"}}},       # not a $defs reference
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}},       # not defined (yet)
    {"type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}},   # no type
    {"type": "object", "properties": {"x": {"type": "string", "enum": [1]}}},   # enum of another type
    {"type": "object", "properties": {"x": {"type": ["string", "date"]}}},      # unknown type in a list
    {"type": "object", "properties": {"x": {"type": "object", "additionalProperties": "yes"}}},
    {"type": "object", "properties": ["x"]},
])
def test_a_schema_outside_the_rules_is_refused(parameters: dict[str, Any]) -> None:
    with pytest.raises(SchemaError):
        declare([fn("f", parameters)])


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(max_size=4)}, optional={"parameters": json_values, "description": json_values})}), max_size=3))
def test_any_json_either_declares_or_raises_an_exception(tools: list[dict[str, Any]]) -> None:
    """A client's tools are arbitrary JSON: the declaration is text or an exception (the
    gateway routes the request approximately then), never anything else."""
    try:
        assert isinstance(declare(tools), str)
    except (SchemaError, AttributeError, TypeError):
        pass
