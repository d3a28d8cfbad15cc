"""Counters with a fixed vocabulary of labels are exported at 0 from start-up, so dashboard
panels and alerts read 0 instead of "No data" before their first event."""
from __future__ import annotations

import pytest

from gateway.metrics import (
    REJECT_REASONS,
    RETRY_REASONS,
    SCALE_STAGES,
    GatewayMetrics,
)


@pytest.mark.parametrize(("series", "label", "values"), [
    ("kvgate_requests_rejected_total", "reason", REJECT_REASONS),
    ("kvgate_scale_errors_total", "stage", SCALE_STAGES),
    ("kvgate_upstream_retries_total", "reason", RETRY_REASONS),
])
def test_fixed_vocabulary_counters_start_at_zero(series: str, label: str, values: tuple[str, ...]) -> None:
    text = GatewayMetrics().exposition()
    lines = (text.decode() if isinstance(text, bytes) else text).splitlines()
    for value in values:
        assert f'{series}{{{label}="{value}"}} 0.0' in lines


def test_unlabelled_counters_start_at_zero() -> None:
    text = GatewayMetrics().exposition()
    lines = (text.decode() if isinstance(text, bytes) else text).splitlines()
    for series in ("kvgate_index_degraded_total", "kvgate_retry_budget_exhausted_total",
                   "kvgate_streams_cut_at_shutdown_total"):
        assert f"{series} 0.0" in lines
