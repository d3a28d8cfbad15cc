"""`kvgate demo`'s prediction summary, from a real registry of the gateway's metrics."""
from __future__ import annotations

from prometheus_client import generate_latest

from gateway.metrics import GatewayMetrics
from loadtest.demo import prediction_summary


def test_summary_counts_each_band_per_mode() -> None:
    metrics = GatewayMetrics()
    for predicted, reported in [(1000, 1000), (1000, 990), (1000, 1500), (1000, 5000), (9000, 1000)]:
        metrics.prediction("approximate", predicted, reported)
    metrics.prediction("precise", 640, 640)
    text = prediction_summary(generate_latest(metrics.registry).decode())
    assert text.startswith("predicted vs reported cached tokens: precise 100.0% within 64 tokens")
    # approximate errors: 0, +10, -500, -4000, +8000
    assert "approximate 40.0% within 64 tokens, 60.0% within 1,024, 40.0% lower, 20.0% higher (of 5)" in text
    assert prediction_summary("") == "predicted vs reported cached tokens: no reports"
