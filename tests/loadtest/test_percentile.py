"""The one percentile convention (loadtest.percentile) against numpy's default."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loadtest.percentile import percentile, percentiles, supported


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_matches_numpy_linear(values: list[float], q: float) -> None:
    got = percentile(values, q)
    assert got is not None
    assert abs(got - float(np.percentile(values, q))) <= 1e-6 * (1 + max(abs(v) for v in values))


def test_edges() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == [None, None]
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentiles([1.0, 2.0, 3.0, 4.0], (0, 100)) == [1.0, 4.0]


def test_supported_needs_tail_samples() -> None:
    assert not supported(99, 100)  # p99 of 100 samples is the top sample alone
    assert supported(99, 1000) and supported(50, 20)
