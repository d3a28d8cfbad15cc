"""Kimi K2.5+'s tool declaration: OpenAI tools as a TypeScript-style ``namespace functions``.

Moonshot's Kimi K2.5 and later (K2.6 included) do not render a request's ``tools`` in the
chat template: their tokenizer class sorts the tools' keys, turns them into a TypeScript-
style text (``encode_tools_to_typescript_style`` in the model's ``tool_declaration_ts.py``)
and hands it to the template as ``tools_ts_str``. Precise mode must produce the same
characters, or every request with tools (every coding-agent turn) hashes differently
from the engine. Written here from the public facts of that format (not copied):

- ``# Tools\\n\\n## functions\\nnamespace functions {\\n`` + one declaration per
  ``{"type": "function"}`` tool (others skipped) joined by ``\\n`` + ``\\n}\\n``; no
  function at all gives ``""``.
- A declaration: the ``interface`` lines (below), the function's description as ``// ``
  lines, then ``type NAME = (_: PARAMS) => any;``; empty parts are left out.
- An object: ``{`` + its fields, required ones first then optional ones, each group by
  name, joined by ``,\\n`` and indented two spaces a level + ``}``; an empty one is ``{}``.
  A field is its comments (description, then sorted constraints ``// k: v, ...``, then
  ``// Default: ...``) and ``name?: type`` (``?`` when optional). ``additionalProperties``
  adds ``[k: string]: any | never | TYPE`` last.
- Types: ``integer`` is ``number``; ``enum`` values joined by `` | `` (strings quoted);
  ``anyOf`` and a list of types joined by `` | ``; an array is ``Array<T>``, or its item's
  comments inside ``Array<\\n...\\n>``; a ``$ref`` to ``#/$defs/NAME`` is ``NAME`` (each
  definition declared as ``interface NAME ...`` before the type), ``#`` is ``parameters``
  (the root then declared as ``interface parameters {...}``, fields in their own order).
- Constraints shown: strings ``maxLength``, ``minLength``, ``pattern``; numbers
  ``maximum``, ``minimum``; arrays ``maxItems``, ``minItems``.

A schema outside these rules (an unknown ``$ref``, ``oneOf`` without ``type``, an enum
value of the wrong type, ...) raises ``SchemaError`` (a ``ValueError``): the request is then routed
approximately, never hashed from a guess.

Dependency-free on purpose: the tiny test model (``loadtest/sglang_cpu/kimi_model.py``)
ships this file as its own ``tool_declaration_ts.py``, so the real SGLang server renders
the same declaration through the model's tokenizer class.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_TS_INDENT = "  "
_TS_FIELD_DELIMITER = ",\n"
LAYOUT = {"_TS_INDENT": _TS_INDENT, "_TS_FIELD_DELIMITER": _TS_FIELD_DELIMITER}  # as the model's file names them
_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
_ENUM_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "number": (int, float), "integer": int,
                                                  "boolean": bool}
_UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                "null": "null", "object": "{}", "array": "Array<any>"}


class SchemaError(ValueError):
    """A tool schema outside the declaration's rules (the request is routed approximately)."""


def _comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


@dataclass
class _Type:
    """One parsed schema: ``kind`` and what rendering it needs."""

    kind: str  # scalar, object, array, enum, anyof, union, ref
    description: str = ""
    constraints: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # scalar: its type; ref: the referenced name
    parts: list[_Type] = field(default_factory=list)  # array: [item]; anyof: the alternatives
    fields: list[_Field] = field(default_factory=list)  # object
    extra: _Type | bool | None = None  # object: additionalProperties
    values: list[Any] = field(default_factory=list)  # enum values; union type names

    def docstring(self, indent: str) -> str:
        lines = [_comment(self.description, indent)] if self.description else []
        if self.constraints:
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)

    def render(self, indent: str = "") -> str:
        if self.kind == "scalar":
            return "number" if self.name == "integer" else self.name
        if self.kind == "enum":
            return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)
        if self.kind == "anyof":
            return " | ".join(t.render(indent) for t in self.parts)
        if self.kind == "union":
            return " | ".join(self.values)
        if self.kind == "ref":
            return self.name
        if self.kind == "array":
            item = self.parts[0]
            doc = item.docstring(indent + _TS_INDENT)
            if not doc:
                return f"Array<{item.render(indent)}>"
            return f"Array<\n{doc}{indent}{_TS_INDENT}{item.render(indent + _TS_INDENT)}\n{indent}>"
        return self._render_object(indent)

    def _render_object(self, indent: str) -> str:
        ordered = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
        ordered += sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        lines = [f.render(indent + _TS_INDENT) for f in ordered]
        if self.extra is not None:
            extra = {True: "any", False: "never"}.get(self.extra) if isinstance(self.extra, bool) \
                else self.extra.render(indent + _TS_INDENT)
            lines.append(f"{indent}{_TS_INDENT}[k: string]: {extra}")
        return "{\n" + _TS_FIELD_DELIMITER.join(lines) + f"\n{indent}}}" if lines else "{}"


@dataclass
class _Field:
    name: str
    type: _Type
    optional: bool
    default: Any = None

    def render(self, indent: str) -> str:
        text = self.type.docstring(indent)
        if self.default is not None:
            shown = repr(self.default) if isinstance(self.default, (int, float, bool)) \
                else json.dumps(self.default, ensure_ascii=False)
            text += f"{indent}// Default: {shown}\n"
        return f"{text}{indent}{self.name}{'?' if self.optional else ''}: {self.type.render(indent)}"


class _Parser:
    """Schemas to ``_Type``s, with the ``$defs`` met so far (in the order they are met)."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}
        self.self_ref = False

    def parse(self, schema: Any) -> _Type:
        if isinstance(schema, bool):
            return _Type("scalar", name="any" if schema else "null")
        if not isinstance(schema, dict):
            raise SchemaError(f"not a JSON schema: {schema!r}")
        description = schema.get("description", "")
        if "$ref" in schema:
            return _Type("ref", description, name=self._ref(schema["$ref"]))
        if "anyOf" in schema:
            return _Type("anyof", description, parts=[self.parse(s) for s in schema["anyOf"]])
        if "enum" in schema:
            return _Type("enum", description, values=_checked_enum(schema))
        if "type" not in schema:
            if schema:
                raise SchemaError(f"a schema without type: {sorted(schema)}")
            return _Type("scalar", name="any")
        kind = schema["type"]
        if isinstance(kind, list):
            try:
                return _Type("union", description, values=[_UNION_NAMES[k] for k in kind])
            except (KeyError, TypeError) as exc:
                raise SchemaError(f"type list {kind!r}") from exc
        if kind == "object":
            return self.parse_object(schema)
        if not isinstance(kind, str):
            raise SchemaError(f"type {kind!r}")
        constraints = {k: schema[k] for k in _CONSTRAINTS.get(kind, ()) if k in schema}
        if kind == "array":
            item = self.parse(schema["items"]) if schema.get("items") else _Type("scalar", name="any")
            return _Type("array", description, constraints, parts=[item])
        return _Type("scalar", description, constraints, name=kind)

    def parse_object(self, schema: dict[str, Any]) -> _Type:
        out = _Type("object", schema.get("description", ""))
        if not schema:
            return out
        if "$defs" in schema:
            self.definitions.update(schema["$defs"] or {})
        extra = schema.get("additionalProperties")
        out.extra = self.parse(extra) if isinstance(extra, dict) else extra
        if out.extra is not None and not isinstance(out.extra, (bool, _Type)):
            raise SchemaError(f"additionalProperties {out.extra!r}")
        if "properties" not in schema:
            return out
        properties = schema["properties"]
        if not isinstance(properties, dict):
            raise SchemaError("properties is not an object")
        optional = set(properties) - set(schema.get("required", []))
        for name, prop in properties.items():
            out.fields.append(_Field(name, self.parse(prop), name in optional,
                                     prop.get("default") if isinstance(prop, dict) else None))
        return out

    def _ref(self, ref: Any) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name in self.definitions:
                return name
        raise SchemaError(f"unresolved $ref {ref!r}")


def _checked_enum(schema: dict[str, Any]) -> list[Any]:
    values = schema["enum"]
    if not isinstance(values, list):
        raise SchemaError("enum is not a list")
    kind = schema.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        if len(kind) == 1 or (len(kind) == 2 and len(others) == 1):
            kind = kind[0] if len(kind) == 1 else others[0]
        else:
            raise SchemaError(f"enum type {kind!r}")
    wanted = _ENUM_TYPES.get(kind) if isinstance(kind, str) else None
    if wanted is not None and any(v is not None and not isinstance(v, wanted) for v in values):
        raise SchemaError(f"enum values are not all {kind}")
    return values


def _declare(function: dict[str, Any]) -> str:
    parser = _Parser()
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise SchemaError("parameters is not an object")
    root = parser.parse_object(parameters)
    interfaces = []
    named_root = parser.self_ref
    if named_root:
        body = _TS_FIELD_DELIMITER.join(f.render(_TS_INDENT) for f in root.fields)
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in list(parser.definitions.items()):  # those met while parsing them come too late
        if not isinstance(schema, dict):
            raise SchemaError(f"definition {name!r} is not an object")
        described = schema.get("description", "")
        head = _comment(described) + "\n" if described else ""
        interfaces.append(f"{head}interface {name} {parser.parse(schema).render()}")
    signature = "parameters" if named_root else root.render()
    description = function.get("description")
    parts = ["\n".join(interfaces), _comment(description) if description else "",
             f"type {function.get('name', 'function')} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools_to_typescript_style(tools: list[dict[str, Any]]) -> str:
    """The ``tools_ts_str`` Kimi K2.5+'s tokenizer class builds for ``tools`` (keys already sorted)."""
    declared = []
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise SchemaError("a tool is not an object")
        function = tool.get("function", {}) if tool.get("type") == "function" else None
        if function and not isinstance(function, dict):
            raise SchemaError("a tool's function is not an object")
        if function:
            declared.append(_declare(function))
    if not declared:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(declared) + "\n}\n"
