"""The rich summary table of `kvgate simulate`: one row per policy, then the oracle."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.table import Table


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _secs(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _rate(v: Any) -> str:
    return "-" if v is None else f"{v:,.3g}"


def _ratio(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _int(v: Any) -> str:
    return "-" if v is None else f"{v:,}"


COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("hit rate", "cache_hit_rate", _pct),
    ("device", "cache_hit_rate_device", _pct),
    ("host", "cache_hit_rate_host", _pct),
    ("TTFT p50", "ttft_p50_s", _secs),
    ("TTFT p90", "ttft_p90_s", _secs),
    ("TTFT p99", "ttft_p99_s", _secs),
    ("tok/s/user p50", "output_tps_per_user_p50", _num),
    ("out tok/s/GPU", "throughput_tokens_per_s_per_gpu", _rate),
    ("imbalance", "imbalance", _ratio),
    ("pred ±1 page", "prediction_within_page", _pct),
    ("requests", "requests", _int),
    ("rejected", "rejected", _int),
)


def results_table(oracle: Mapping[str, Any], results: Sequence[Mapping[str, Any]],
                  title: str = "kvgate simulate", caption: str | None = None) -> Table:
    """``caption``: printed under the table (the trace entries skipped or defaulted)."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column("policy", style="bold")
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in results:
        table.add_row(str(row.get("policy")), *(fmt(row.get(key)) for _, key, fmt in COLUMNS))
    if oracle:
        table.add_row("oracle (bound)", *(fmt(oracle.get(key)) if key in oracle else "" for _, key, fmt in COLUMNS),
                      style="dim")
    return table
