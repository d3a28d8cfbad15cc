"""Policies by name: `make_policy(name, params, seed)` and `POLICY_NAMES`.

Every policy is a `policies.framework.Pipeline`; ``params`` are the policy's documented
parameters (policies/README.md) plus ``weights`` (scorer name -> weight). Unknown names
or params raise ValueError, so a typo in configuration fails at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from policies import baselines, cache_aware, session_hash, sglang_cache_aware
from policies.framework import Pipeline

_BUILDERS: Mapping[str, Callable[[Mapping[str, Any] | None, int | None], Pipeline]] = {
    "cache-aware": cache_aware.build,
    "round-robin": baselines.build_round_robin,
    "random": baselines.build_random,
    "least-load": baselines.build_least_load,
    "session-hash": session_hash.build,
    "sglang-cache-aware": sglang_cache_aware.build,
}

POLICY_NAMES: tuple[str, ...] = tuple(_BUILDERS)
DEFAULT_POLICY = "cache-aware"


def make_policy(
    name: str, params: Mapping[str, Any] | None = None, seed: int | None = None
) -> Pipeline:
    """A fresh policy instance (each has its own state: counters, rings, trees)."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None
    return builder(params, seed)
