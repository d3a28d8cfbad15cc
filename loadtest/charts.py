"""PNG charts of load-test runs (matplotlib, Agg backend: no display needed).

(a) throughput per GPU (output tokens/min/GPU) against interactivity (median output
    tokens/s per user), one point per run, the concurrency written at each point, one
    line per policy/target (the usual inference-benchmark trade-off curve);
(b) cache hit rate over time (cached / prompt tokens of requests started in each bin);
(c) TTFT distribution (empirical CDF, log x axis).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from loadtest.results import RunResult


def _group(run: RunResult) -> str:
    return str(run.config.get("policy") or run.config.get("target_label") or run.label)


def plot_throughput(ax: Axes, runs: Sequence[RunResult]) -> None:
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(_group(run), []).append(run)
    for name, members in groups.items():
        pts = sorted(((r.summary.output_tps_per_user_p50, r.summary.output_tokens_per_min_per_gpu,
                       r.config.get("sessions_concurrent")) for r in members
                      if r.summary.output_tps_per_user_p50 is not None
                      and r.summary.output_tokens_per_min_per_gpu is not None),
                     key=lambda p: p[0])
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, conc in pts:
            if conc is not None:
                ax.annotate(str(conc), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8, color=line.get_color())
    ax.set_xlabel("interactivity: output tokens/s per user (median)")
    ax.set_ylabel("output tokens/min per GPU")
    ax.set_title("throughput vs interactivity (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    if groups:
        ax.legend(fontsize=8)


def plot_hit_rate(ax: Axes, runs: Sequence[RunResult], bins: int = 30) -> None:
    for run in runs:
        good = [r for r in run.records if r.ok and r.prompt_tokens]
        if not good:
            continue
        t_max = max(r.t_start_s for r in good) or 1.0
        width = t_max / bins or 1.0
        prompt = [0] * (bins + 1)
        cached = [0] * (bins + 1)
        for r in good:
            b = min(bins, int(r.t_start_s / width))
            prompt[b] += r.prompt_tokens or 0
            cached[b] += r.cached_tokens or 0
        xs = [(b + 0.5) * width for b in range(bins + 1) if prompt[b]]
        ys = [cached[b] / prompt[b] for b in range(bins + 1) if prompt[b]]
        ax.plot(xs, ys, label=run.label)
    ax.set_xlabel("time since start (target s)")
    ax.set_ylabel("cache hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_title("prefix cache hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_ttft_cdf(ax: Axes, runs: Sequence[RunResult]) -> None:
    for run in runs:
        ttfts = sorted(r.ttft_s for r in run.records if r.ok and r.ttft_s is not None and r.ttft_s > 0)
        if not ttfts:
            continue
        n = len(ttfts)
        ax.step(ttfts, [(i + 1) / n for i in range(n)], where="post", label=run.label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (target s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def write_charts(path: str | Path, runs: Sequence[RunResult]) -> Path:
    """One PNG with the three panels."""
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    try:
        plot_throughput(axes[0], runs)
        plot_hit_rate(axes[1], runs)
        plot_ttft_cdf(axes[2], runs)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return Path(path)
