"""Bootstrap confidence intervals for percentiles, and for differences of percentiles.

Used by ``kvgate bench peers --overhead`` to put an interval around the added latency
(router percentile minus direct percentile). Method: the percentile bootstrap. Resample
the ``n`` values (for a difference: the ``n`` *pairs*, so the interleaved direct and
routed samples of one moment stay together and shared drift cancels) with replacement
``resamples`` times from a seeded generator, compute the statistic on each resample,
and report the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of those
statistics. Every percentile here, of the data and of the bootstrap distribution, is the
project's one percentile (``loadtest.percentile``); numpy only draws the indices and
sorts the resamples. Same inputs and seed, same interval.

Each estimate carries its sample count and ``supported`` (``loadtest.percentile.supported``:
at least 10 samples beyond the percentile); an unsupported tail percentile is decided by
a handful of the largest samples and its interval is not to be trusted either.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from loadtest.percentile import percentile, percentiles, supported

RESAMPLES = 1000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A percentile (or a difference of two) with its bootstrap interval."""

    q: float
    value: float
    lo: float
    hi: float
    n: int
    supported: bool
    confidence: float
    resamples: int

    def as_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)

    def scaled(self, factor: float) -> Estimate:
        """The same estimate in other units (seconds -> ms: 1e3)."""
        return Estimate(self.q, self.value * factor, self.lo * factor, self.hi * factor,
                        self.n, self.supported, self.confidence, self.resamples)


def _sorted_resamples(data: np.ndarray, index: np.ndarray) -> list[list[float]]:
    rows: list[list[float]] = np.sort(data[index], axis=1).tolist()
    return rows


def _interval(stats: Sequence[float], confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = percentiles(stats, (tail, 100.0 - tail))
    assert lo is not None and hi is not None
    return lo, hi


def _check(n: int, confidence: float, resamples: int) -> None:
    if n == 0:
        raise ValueError("bootstrap of no values")
    if not 0.0 < confidence < 1.0 or resamples < 1:
        raise ValueError(f"confidence in (0, 1) and resamples >= 1, got {confidence}, {resamples}")


def bootstrap_percentiles(
    values: Sequence[float], qs: Sequence[float], resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE, seed: int = 0,
) -> list[Estimate]:
    """Percentiles ``qs`` (0-100) of ``values``, each with its bootstrap interval."""
    return bootstrap_differences(values, None, qs, resamples, confidence, seed)


def bootstrap_differences(
    values: Sequence[float], baseline: Sequence[float] | None, qs: Sequence[float],
    resamples: int = RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0,
) -> list[Estimate]:
    """``percentile(values, q) - percentile(baseline, q)`` for paired samples, with intervals.

    ``values[i]`` and ``baseline[i]`` are a pair (resampled together); with ``baseline``
    None this is the percentile of ``values`` alone."""
    n = len(values)
    _check(n, confidence, resamples)
    if baseline is not None and len(baseline) != n:
        raise ValueError(f"paired samples of unequal length: {n} and {len(baseline)}")
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    rows = _sorted_resamples(np.asarray(values, dtype=float), index)
    base_rows = (_sorted_resamples(np.asarray(baseline, dtype=float), index)
                 if baseline is not None else None)
    out: list[Estimate] = []
    for q in qs:
        point = _value(values, q) - (_value(baseline, q) if baseline is not None else 0.0)
        stats = [_value(r, q) for r in rows]
        if base_rows is not None:
            stats = [s - _value(b, q) for s, b in zip(stats, base_rows, strict=True)]
        lo, hi = _interval(stats, confidence)
        out.append(Estimate(q, point, lo, hi, n, supported(q, n), confidence, resamples))
    return out


def _value(values: Sequence[float], q: float) -> float:
    v = percentile(values, q)
    assert v is not None  # values are never empty here
    return v
