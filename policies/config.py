"""Configuration of the routing policy (a section of the gateway's one settings object)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field


class PolicyConfig(BaseModel):
    name: str = Field(default="cache-aware", description="policy name; see policies/README.md")
    params: dict[str, Any] = Field(
        default_factory=dict, description="per-policy parameters (overrides)"
    )
    seed: int | None = Field(
        default=None, description="seed for tie-breaking randomness (None: random)"
    )


P = TypeVar("P")


def parse_params(cls: type[P], params: Mapping[str, Any] | None, policy: str) -> P:
    """Build a frozen params dataclass from a mapping; unknown keys are an error.

    ``weights`` (scorer name -> weight) is handled by `parse_weights`, not here.
    """
    given = {k: v for k, v in (params or {}).items() if k != "weights"}
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"policy {policy!r}: unknown params {unknown}; known: {sorted(known)}")
    defaults = cls()
    coerced: dict[str, Any] = {}
    for key, value in given.items():
        coerced[key] = _coerce(getattr(defaults, key), value)
    return dataclasses.replace(defaults, **coerced)  # type: ignore[type-var]


def _coerce(default: Any, value: Any) -> Any:
    """Coerce a config value (possibly a string from an env var) to the default's type."""
    if isinstance(default, bool):
        return (
            value.strip().lower() in ("1", "true", "yes", "on")
            if isinstance(value, str)
            else bool(value)
        )
    if isinstance(default, (int, float, str)):
        return type(default)(value)
    return value


def parse_weights(
    params: Mapping[str, Any] | None, defaults: Mapping[str, float], policy: str
) -> dict[str, float]:
    """Scorer weights: the policy's defaults overridden by ``params["weights"]``."""
    given = dict((params or {}).get("weights") or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"policy {policy!r}: unknown scorer weights {unknown}; known: {sorted(defaults)}"
        )
    weights = {**defaults, **{k: float(v) for k, v in given.items()}}
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"policy {policy!r}: weights must be >= 0 and not all 0: {weights}")
    return weights


@dataclasses.dataclass(frozen=True, slots=True)
class NoParams:
    """For policies without params: any key but ``weights`` is an error."""
