"""Fault injection for tests: how a simulated replica misbehaves (not part of SGLang).

Set at start-up with ``kvgate sim`` flags, or at run time with ``POST /_sim/faults``
(a JSON object with any of the fields below; ``GET /_sim/faults`` shows the current
ones). Faults apply to generation routes only (chat, completions, generate); health,
info and metrics routes stay truthful so a gateway's prober sees the replica as up.

| field | effect |
|---|---|
| ``error_rate`` | fraction of requests answered ``error_status`` before the first byte |
| ``error_status`` | the status of those errors (default 503) |
| ``latency_s`` | wall seconds added before the request reaches the engine |
| ``hang_rate`` | fraction of requests accepted and never answered (until the client leaves) |
| ``die_after_chunks`` | streaming requests lose their connection after N SSE events |
| ``die_mode`` | ``"close"`` (drop the connection) or ``"exit"`` (kill the process) |

Random choices come from one ``random.Random(seed)`` per replica, so a run is repeatable.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

DIE_MODES = ("close", "exit")


class FaultConfigError(ValueError):
    """A fault setting that does not parse or is out of range."""


@dataclass(frozen=True, slots=True)
class FaultConfig:
    error_rate: float = 0.0
    error_status: int = 503
    latency_s: float = 0.0
    hang_rate: float = 0.0
    die_after_chunks: int | None = None
    die_mode: str = "close"

    def __post_init__(self) -> None:
        for name in ("error_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise FaultConfigError(f"{name} must be in [0, 1], got {value}")
        if not 500 <= self.error_status <= 599:
            raise FaultConfigError(f"error_status must be a 5xx status, got {self.error_status}")
        if self.latency_s < 0:
            raise FaultConfigError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.die_after_chunks is not None and self.die_after_chunks < 0:
            raise FaultConfigError(f"die_after_chunks must be >= 0, got {self.die_after_chunks}")
        if self.die_mode not in DIE_MODES:
            raise FaultConfigError(f"die_mode must be one of {DIE_MODES}, got {self.die_mode!r}")

    @classmethod
    def from_json(cls, obj: Any) -> FaultConfig:
        if not isinstance(obj, dict):
            raise FaultConfigError("faults must be a JSON object")
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise FaultConfigError(f"unknown fault fields: {unknown}")
        try:
            return cls(**obj)
        except TypeError as e:
            raise FaultConfigError(str(e)) from e

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def active(self) -> bool:
        return self != FaultConfig()


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What happens to one request, drawn when it arrives."""

    error_status: int | None = None
    latency_s: float = 0.0
    hang: bool = False
    die_after_chunks: int | None = None
    die_exit: bool = False


NO_FAULT = FaultPlan()


class Faults:
    """The replica's current fault settings and its seeded random source."""

    def __init__(self, config: FaultConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)

    def plan(self) -> FaultPlan:
        c = self.config
        if not c.active:
            return NO_FAULT
        error = c.error_status if c.error_rate and self._rng.random() < c.error_rate else None
        hang = bool(c.hang_rate) and self._rng.random() < c.hang_rate
        return FaultPlan(error_status=error, latency_s=c.latency_s, hang=hang,
                         die_after_chunks=c.die_after_chunks, die_exit=c.die_mode == "exit")
