"""Per-replica speed, learned online from what the gateway observes (pure: no I/O, no clock).

Three figures per replica:

- **prefill** (uncached tokens/s): a request's uncached tokens (prompt minus the cached
  tokens its usage reports) over its time to first byte, for prompts of at least
  ``MIN_PREFILL_TOKENS`` uncached tokens (below that, fixed overheads dominate).
- **accept length** (tokens per decode step of one stream, speculative decoding): what the
  replica reports on ``/v1/loads`` (``speculative.accept_length``, polled by the registry),
  `AcceptEstimate`; unknown (None) on a replica that reports none.
- **decode** (verify steps/s of one stream): a stream's output tokens after the first over
  its time from first to last byte is its per-stream rate, ``accept length / step``; that
  rate divided by the replica's accept length when the stream ended (``DECODE_TOKENS_PER_STEP``
  while it reports none) is a sample of its step rate.

The cost model prices decode by ``decode_step_s`` = the time one stream takes to produce
``DECODE_TOKENS_PER_STEP`` tokens = ``DECODE_TOKENS_PER_STEP x step / accept length``: the
fleet constant's step (15 ms for 5 tokens) at the fleet's accept length, longer where drafts
are accepted less. The accept length enters once: the learned step has it divided out,
and without a reported one both sides use ``DECODE_TOKENS_PER_STEP``, so the figure is
``DECODE_TOKENS_PER_STEP / per-stream rate`` as before (why learn the step and read the
accept length rather than learn the per-stream rate alone: replicas/README.md, "Learned
speed").

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
DECODE_TOKENS_PER_STEP = 5.0  # DFlash's mean accept length (tokens per verify step): the constants' own
MIN_PREFILL_TOKENS = 1024
ACCEPT_BOUNDS = (1.0, 4 * DECODE_TOKENS_PER_STEP)  # an accept length counts the bonus token: >= 1


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


@dataclass(slots=True)
class AcceptEstimate:
    """A replica's speculative accept length from its ``/v1/loads`` polls (None: it reports
    none). SGLang's figure is already a mean over the scheduler's life, so the smoothing only
    guards against a replica that reports nonsense: a reading is clipped to ``ACCEPT_BOUNDS``
    and, once a figure exists, to within ``max_ratio`` of it, then pulled in with weight
    ``alpha`` (one poll moves the figure by at most ``alpha x (max_ratio - 1)``: 6%)."""

    value: float | None = None
    samples: int = 0
    alpha: float = 0.25
    max_ratio: float = 1.25

    def observe(self, accept_length: float | None) -> None:
        if accept_length is None or not (accept_length > 0 and math.isfinite(accept_length)):
            return
        lo, hi = ACCEPT_BOUNDS
        x = max(lo, min(hi, accept_length))
        v = self.value
        if v is None:
            self.value = x
        else:
            x = max(v / self.max_ratio, min(v * self.max_ratio, x))
            self.value = v + self.alpha * (x - v)
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
    return RateEstimate(1.0 / FLEET_DECODE_STEP_S)


@dataclass(slots=True)
class ReplicaSpeed:
    """A replica's learned prefill rate, decode step rate and accept length (module docstring).

    ``read_accept=False``: the accept length is not read (`observe_accept` ignores it) and
    the figures are those of the per-stream rate alone (the fleet simulator's ablation)."""

    prefill: RateEstimate = field(default_factory=_prefill)
    decode: RateEstimate = field(default_factory=_decode)  # verify steps per second of one stream
    accept: AcceptEstimate = field(default_factory=AcceptEstimate)
    read_accept: bool = True

    @classmethod
    def seeded(cls, prefill_tokens_per_s: float, decode_step_s: float, read_accept: bool = True) -> ReplicaSpeed:
        """Seeded from other figures than the constants (`fleet_seed`)."""
        return cls(RateEstimate(prefill_tokens_per_s), RateEstimate(1.0 / decode_step_s), read_accept=read_accept)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill.value

    @property
    def spec_accept_length(self) -> float | None:
        """The reported accept length, smoothed (None: the replica reports none)."""
        return self.accept.value

    @property
    def decode_step_s(self) -> float:
        """Time for one stream to produce ``DECODE_TOKENS_PER_STEP`` tokens (module docstring)."""
        return DECODE_TOKENS_PER_STEP / (self.decode.value * self._accept())

    def _accept(self) -> float:
        a = self.accept.value
        return DECODE_TOKENS_PER_STEP if a is None else a

    def observe_accept(self, accept_length: float | None) -> None:
        """One ``/v1/loads`` poll's accept length (None: not reported; the figure stays)."""
        if self.read_accept:
            self.accept.observe(accept_length)

    def observe(self, prompt_tokens: int | None, cached_tokens: int | None, ttft_s: float | None,
                output_tokens: int | None, stream_s: float | None) -> None:
        """One finished stream: its usage (prompt, cached and output tokens), its time to
        first byte and from first to last byte (None: not known)."""
        uncached = None if prompt_tokens is None else prompt_tokens - (cached_tokens or 0)
        if uncached is not None and uncached >= MIN_PREFILL_TOKENS and ttft_s and ttft_s > 0:
            self.prefill.observe(uncached / ttft_s)
        if output_tokens is not None and output_tokens > 1 and stream_s and stream_s > 0:
            self.decode.observe((output_tokens - 1) / stream_s / self._accept())
