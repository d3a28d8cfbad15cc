"""Metric names used by a PromQL expression, found with regular expressions (no parser).

What is removed first, so that what is left are selectors, functions and operators:
string literals (label values, Grafana's ``$variables`` inside them), label matchers
``{...}``, range and subquery brackets ``[5m]``, grouping clauses (``by (...)``,
``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``) and Grafana variables
outside strings. Every identifier left that is not a keyword and not followed by ``(``
(a function or an aggregation) is a metric name: a vector selector, with or without
``{`` / ``[`` after it. Histogram series are reported by their family name
(``_bucket``, ``_sum``, ``_count`` stripped); counters keep ``_total``.
"""
from __future__ import annotations

import re

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])\s*(\(?)")
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                      "and", "or", "unless", "offset", "atan2", "inf", "nan", "Inf", "NaN"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family(name: str) -> str:
    """``x_bucket`` / ``x_sum`` / ``x_count`` -> ``x``; any other name unchanged."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def metric_names(expr: str) -> set[str]:
    """The metric (or recording-rule) names ``expr`` selects, as families."""
    text = _VARIABLE.sub("0", _STRING.sub('""', expr))
    text = _BRACKETS.sub("[]", _MATCHERS.sub("{}", text))
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name in KEYWORDS:
            continue
        names.add(family(name))
    return names
