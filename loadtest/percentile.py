"""The one percentile of the project's harness and benchmarks.

Convention: ``q`` in [0, 100]; linear interpolation between the closest ranks (numpy's
default, "method 7" of Hyndman & Fan): ``k = (n - 1) * q / 100``, the value between
``sorted[floor(k)]`` and ``sorted[ceil(k)]``. With ``n`` samples, a percentile above
``100 * (1 - 1/n)`` is decided by the largest sample alone, so a reported p99 needs well
over 100 samples to mean more than "the maximum": ``supported(q, n)`` says whether it has
them (at least 10 samples beyond the percentile), and benchmarks print the sample count.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation); None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """Several percentiles of one sample (sorted once)."""
    if not values:
        return [None for _ in qs]
    s = sorted(values)
    return [percentile(s, q) for q in qs]


def supported(q: float, n: int, tail_samples: int = 10) -> bool:
    """True when ``n`` samples put at least ``tail_samples`` beyond the ``q``-th percentile."""
    return n * (100.0 - q) / 100.0 >= tail_samples
