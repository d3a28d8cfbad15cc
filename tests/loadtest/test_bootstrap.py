"""Bootstrap intervals (loadtest.bootstrap): coverage on a known distribution, seeds, pairs."""
from __future__ import annotations

import math
import random

import pytest

from loadtest.bootstrap import bootstrap_differences, bootstrap_percentiles
from loadtest.percentile import percentile


def test_coverage_of_the_median_of_an_exponential() -> None:
    """The 95% interval of the median covers ln 2 in about 95% of seeded experiments."""
    rng = random.Random(7)
    trials, covered = 200, 0
    for t in range(trials):
        values = [rng.expovariate(1.0) for _ in range(200)]
        (est,) = bootstrap_percentiles(values, (50,), resamples=200, seed=t)
        assert est.lo <= est.value <= est.hi
        covered += est.lo <= math.log(2) <= est.hi
    assert 0.88 <= covered / trials <= 0.99, covered


def test_coverage_of_p90_of_a_uniform() -> None:
    rng = random.Random(11)
    trials, covered = 150, 0
    for t in range(trials):
        values = [rng.random() for _ in range(500)]
        (est,) = bootstrap_percentiles(values, (90,), resamples=200, seed=t)
        covered += est.lo <= 0.9 <= est.hi
    assert 0.88 <= covered / trials <= 0.99, covered


def test_seeded_and_deterministic() -> None:
    rng = random.Random(1)
    values = [rng.gauss(0, 1) for _ in range(300)]
    a = bootstrap_percentiles(values, (50, 99), seed=3)
    assert a == bootstrap_percentiles(values, (50, 99), seed=3)
    assert a != bootstrap_percentiles(values, (50, 99), seed=4)
    assert [e.value for e in a] == [percentile(values, 50), percentile(values, 99)]
    assert [e.n for e in a] == [300, 300] and a[0].resamples == 1000


def test_paired_difference_and_support() -> None:
    rng = random.Random(2)
    base = [rng.expovariate(1.0) for _ in range(2000)]
    shifted = [b + 0.5 for b in base]  # pairs share their noise: the difference is exact
    ests = bootstrap_differences(shifted, base, (50, 90, 99, 99.9), resamples=100)
    for e in ests:
        assert e.value == pytest.approx(0.5) and e.lo == pytest.approx(0.5)
        assert e.hi == pytest.approx(0.5)
    assert [e.supported for e in ests] == [True, True, True, False]  # p99.9 needs 10,000
    ms = ests[0].scaled(1e3)
    assert ms.value == pytest.approx(500.0) and ms.n == 2000


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        bootstrap_percentiles([], (50,))
    with pytest.raises(ValueError, match="unequal"):
        bootstrap_differences([1.0, 2.0], [1.0], (50,))
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_percentiles([1.0], (50,), confidence=1.0)
