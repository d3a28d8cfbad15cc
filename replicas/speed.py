"""Per-replica speed, learned online from what the gateway observes (pure: no I/O, no clock).

Two figures per replica, both as rates (higher = faster), so one estimator serves both:

- **prefill** (uncached tokens/s): a request's uncached tokens (prompt minus the cached
  tokens its usage reports) over its time to first byte, for prompts of at least
  ``MIN_PREFILL_TOKENS`` uncached tokens (below that, fixed overheads dominate).
- **decode** (output tokens/s of one stream): output tokens after the first over the
  stream's time from first to last byte. The cost model wants a decode *step*, so the
  view shows ``DECODE_TOKENS_PER_STEP / rate`` (tokens per step: DFlash's mean accept
  length in the default profile).

The estimator (`RateEstimate`) is an upper *expectile* EWMA in log space: a sample
faster than the estimate pulls it with weight ``alpha * q``, a slower one with weight
``alpha * (1 - q)`` (q = 0.9). Queueing, admission holds and batching only ever make a
request look *slower* than the replica is, so the mean of per-request rates would
under-rate a busy replica; an upper expectile follows the rate of the requests that did
not wait. Bounded against outliers twice: a sample's log-distance from the estimate is
clipped to ``max_log_step`` (a single sample moves the figure by at most
``exp(alpha * q * max_log_step)``: 13% up, 1.4% down with the defaults), and the figure
stays within [0.25x, 4x] of its seed. Seeds are the fleet-wide constants below (the
cache-aware policy's defaults are these very values; `fleet_seed`: the policy's params
when an operator sets them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FLEET_PREFILL_TOKENS_PER_S = 40_000.0  # one 8x B200 Kimi K2.6 replica, long context
FLEET_DECODE_STEP_S = 0.015  # one decode step at low batch (the default profile's base step)
DECODE_TOKENS_PER_STEP = 5.0  # DFlash's mean accept length (tokens per verify step)
MIN_PREFILL_TOKENS = 1024


@dataclass(slots=True)
class RateEstimate:
    """One learned rate (see the module docstring); ``value`` is the current figure."""

    seed: float
    value: float = 0.0
    samples: int = 0
    alpha: float = 0.2
    q: float = 0.9
    max_log_step: float = math.log(2.0)
    bound: float = 4.0  # the figure stays within [seed / bound, seed * bound]

    def __post_init__(self) -> None:
        if self.value <= 0:
            self.value = self.seed

    def observe(self, rate: float) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            return
        d = math.log(rate / self.value)
        d = max(-self.max_log_step, min(self.max_log_step, d))
        w = self.alpha * (self.q if d > 0 else 1.0 - self.q)
        value = self.value * math.exp(w * d)
        self.value = max(self.seed / self.bound, min(self.seed * self.bound, value))
        self.samples += 1


def fleet_seed(policy_params: Mapping[str, Any]) -> tuple[float, float]:
    """The fleet-wide (prefill tokens/s, decode step s) to seed every replica with: the
    policy's params of those names (``prefill_tokens_per_s``, ``decode_step_s``, the
    cache-aware cost model's) when set, else the constants above."""
    return (float(policy_params.get("prefill_tokens_per_s", FLEET_PREFILL_TOKENS_PER_S)),
            float(policy_params.get("decode_step_s", FLEET_DECODE_STEP_S)))


def _prefill() -> RateEstimate:
    return RateEstimate(FLEET_PREFILL_TOKENS_PER_S)


def _decode() -> RateEstimate:
    return RateEstimate(DECODE_TOKENS_PER_STEP / FLEET_DECODE_STEP_S)


@dataclass(slots=True)
class ReplicaSpeed:
    """A replica's learned prefill rate and decode step."""

    prefill: RateEstimate = field(default_factory=_prefill)
    decode: RateEstimate = field(default_factory=_decode)

    @classmethod
    def seeded(cls, prefill_tokens_per_s: float, decode_step_s: float) -> ReplicaSpeed:
        """Seeded from other figures than the constants (`fleet_seed`)."""
        return cls(RateEstimate(prefill_tokens_per_s), RateEstimate(DECODE_TOKENS_PER_STEP / decode_step_s))

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill.value

    @property
    def decode_step_s(self) -> float:
        return DECODE_TOKENS_PER_STEP / self.decode.value

    def observe(self, prompt_tokens: int | None, cached_tokens: int | None, ttft_s: float | None,
                output_tokens: int | None, stream_s: float | None) -> None:
        """One finished stream: its usage (prompt, cached and output tokens), its time to
        first byte and from first to last byte (None: not known)."""
        uncached = None if prompt_tokens is None else prompt_tokens - (cached_tokens or 0)
        if uncached is not None and uncached >= MIN_PREFILL_TOKENS and ttft_s and ttft_s > 0:
            self.prefill.observe(uncached / ttft_s)
        if output_tokens is not None and output_tokens > 1 and stream_s and stream_s > 0:
            self.decode.observe((output_tokens - 1) / stream_s)
