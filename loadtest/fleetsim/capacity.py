"""Capacity at an SLO: how many concurrent sessions a fleet carries under each policy.

``kvgate simulate --capacity --slo-ttft-p99 S --slo-tps-p50 T ...`` runs, for each
policy, a bisection over ``--sessions-concurrent`` (the same workload, the same sessions
and seed for every policy, each run on a fresh fleet: `loadtest.fleetsim.run`) for the
largest concurrency whose run is *within the SLO*:

- TTFT p99 <= ``--slo-ttft-p99`` (default 3 s), and
- median output tokens/s per user >= ``--slo-tps-p50`` (default 200: interactivity).

What a fleet owner buys is that concurrency, and the output tokens per GPU per second
the fleet delivers there (``throughput_tokens_per_s_per_gpu`` of the run).

Search: evaluate the bracket's ends (``--capacity-min``, ``--capacity-max``); if the
lower end already misses the SLO the capacity is 0 (below the bracket), if the upper end
meets it the capacity is at least the upper end; otherwise halve the bracket, keeping
``lo`` within the SLO and ``hi`` outside it, until ``hi - lo <= --capacity-step``. It
assumes that more sessions never make the SLO easier; every run is reported, so a
non-monotonic point shows. Every run costs a whole simulation (a Claude Code run of all
360 sessions takes 1-3 CPU minutes), so ~log2((max - min) / step) + 2 runs per policy.

The chart (``--chart PATH``) is the usual inference trade-off curve: throughput per GPU
against interactivity, one curve per policy through every concurrency it was run at,
each point labelled with its concurrency, the capacity point ringed, and the SLO's
interactivity floor drawn.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from loadtest.fleetsim.run import SimConfig, run_policy
from loadtest.workload import Workload


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_s: float = 3.0
    tps_p50: float = 200.0

    def met(self, summary: Mapping[str, Any]) -> bool:
        p99, tps = summary.get("ttft_p99_s"), summary.get("output_tps_per_user_p50")
        return p99 is not None and tps is not None and p99 <= self.ttft_p99_s and tps >= self.tps_p50


@dataclass(frozen=True, slots=True)
class Point:
    """One run at one concurrency: its SLO figures, throughput and hit rate."""

    concurrency: int
    within_slo: bool
    ttft_p99_s: float | None
    tps_p50: float | None
    tokens_per_s_per_gpu: float | None
    cache_hit_rate: float | None

    @classmethod
    def of(cls, concurrency: int, summary: Mapping[str, Any], slo: Slo) -> Point:
        return cls(concurrency, slo.met(summary), summary.get("ttft_p99_s"),
                   summary.get("output_tps_per_user_p50"),
                   summary.get("throughput_tokens_per_s_per_gpu"), summary.get("cache_hit_rate"))


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """A policy's capacity: the largest concurrency within the SLO (None: not even ``min``)."""

    policy: str
    best: Point | None
    points: tuple[Point, ...]  # every run, by concurrency
    below_min: bool  # the lower end of the bracket already missed the SLO
    at_max: bool  # the upper end met it: the capacity is at least ``max``


Evaluate = Callable[[int], Point]


def find_capacity(policy: str, evaluate: Evaluate, lo: int, hi: int, step: int = 1) -> CapacityResult:
    """Bisection for the largest concurrency in ``[lo, hi]`` within the SLO (see the docstring)."""
    if lo < 1 or hi < lo or step < 1:
        raise ValueError(f"capacity bracket needs 1 <= min <= max and step >= 1, got {lo}, {hi}, {step}")
    seen: dict[int, Point] = {}

    def at(c: int) -> Point:
        if c not in seen:
            seen[c] = evaluate(c)
        return seen[c]

    def done(best: Point | None, below: bool = False, top: bool = False) -> CapacityResult:
        return CapacityResult(policy, best, tuple(seen[c] for c in sorted(seen)), below, top)

    if not at(lo).within_slo:
        return done(None, below=True)
    if at(hi).within_slo:
        return done(at(hi), top=True)
    while hi - lo > step:
        mid = (lo + hi) // 2
        if at(mid).within_slo:
            lo = mid
        else:
            hi = mid
    return done(at(lo))


def add_capacity_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--capacity`` options of ``kvgate simulate`` (its other options still apply).

    Idempotent: a parser that already has them (``kvgate simulate``'s own) is left as is.
    """
    if any("--capacity" in a.option_strings for a in p._actions):
        return
    g = p.add_argument_group("capacity at SLO")
    g.add_argument("--capacity", action="store_true",
                   help="per policy, bisect --sessions-concurrent for the largest load within the SLO")
    g.add_argument("--slo-ttft-p99", type=float, default=3.0, metavar="S", help="TTFT p99 bound (s)")
    g.add_argument("--slo-tps-p50", type=float, default=200.0, metavar="T",
                   help="median output tokens/s per user, lower bound")
    g.add_argument("--capacity-min", type=int, default=8, help="lower end of the bracket (sessions)")
    g.add_argument("--capacity-max", type=int, default=256, help="upper end of the bracket (sessions)")
    g.add_argument("--capacity-step", type=int, default=8, help="stop when the bracket is this narrow")
    g.add_argument("--chart", default=None, metavar="PNG", help="write the throughput/interactivity chart")


def capacity_doc(slo: Slo, results: Sequence[CapacityResult], config: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: the SLO, the run's config, and per policy its capacity and runs."""
    def point(p: Point | None) -> dict[str, Any] | None:
        return None if p is None else dataclasses.asdict(p)

    return {
        "slo": dataclasses.asdict(slo), "config": dict(config),
        "capacity": [{"policy": r.policy, "sessions": r.best.concurrency if r.best else 0,
                      "below_min": r.below_min, "at_max": r.at_max, "at_capacity": point(r.best),
                      "points": [point(p) for p in r.points]} for r in results],
    }


def capacity_lines(slo: Slo, results: Sequence[CapacityResult]) -> list[str]:
    """One line per policy, best capacity first."""
    out = [f"capacity at SLO (TTFT p99 <= {slo.ttft_p99_s:g} s, median output tok/s/user >= {slo.tps_p50:g}):"]
    for r in sorted(results, key=lambda r: -(r.best.concurrency if r.best else 0)):
        b = r.best
        if b is None:
            out.append(f"  {r.policy}: below the bracket (misses the SLO at {r.points[0].concurrency} sessions)")
            continue
        more = "+" if r.at_max else ""
        out.append(f"  {r.policy}: {b.concurrency}{more} sessions, {b.tokens_per_s_per_gpu or 0:.3g} output "
                   f"tok/s/GPU, TTFT p99 {b.ttft_p99_s or 0:.2f} s, {b.tps_p50 or 0:.1f} tok/s/user, "
                   f"hit {100 * (b.cache_hit_rate or 0):.2f}% ({len(r.points)} runs)")
    return out


def write_chart(path: str | Path, slo: Slo, results: Sequence[CapacityResult]) -> Path:
    """Throughput per GPU vs interactivity, one curve per policy (labels: concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in results:
        pts = [(p.tps_p50, p.tokens_per_s_per_gpu, p) for p in r.points
               if p.tps_p50 is not None and p.tokens_per_s_per_gpu is not None]
        if not pts:
            continue
        line, = ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o",
                        label=f"{r.policy} (capacity {r.best.concurrency if r.best else 0})")
        for x, y, p in pts:
            ax.annotate(str(p.concurrency), (x, y), fontsize=8, textcoords="offset points",
                        xytext=(4, 4), color=line.get_color())
            if p is r.best:
                ax.scatter([x], [y], s=160, facecolors="none", edgecolors=line.get_color(),
                           linewidths=1.5)
    ax.axvline(slo.tps_p50, linestyle="--", color="grey", linewidth=1)
    ax.set_xlabel("interactivity: output tokens/s per user (median)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"capacity at SLO: TTFT p99 <= {slo.ttft_p99_s:g} s, >= {slo.tps_p50:g} tok/s/user "
                 "(labels: concurrent sessions; ringed: capacity)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_capacity(args: argparse.Namespace, workload: Workload, base: SimConfig, config: dict[str, Any],
                 names: Sequence[str]) -> int:
    """``kvgate simulate --capacity``: bisect per policy, print, write JSON and the chart.

    ``kvgate simulate`` hands over what it built from its flags: the workload, the base
    simulation config, its JSON description and the policy names."""
    console = Console(stderr=True)
    slo = Slo(args.slo_ttft_p99, args.slo_tps_p50)
    results: list[CapacityResult] = []

    def evaluator(name: str) -> Evaluate:
        def evaluate(c: int) -> Point:
            cfg = dataclasses.replace(base, pacing=dataclasses.replace(base.pacing, sessions_concurrent=c,
                                                                       session_rate=None))
            summary = run_policy(workload, name, cfg).summary
            point = Point.of(c, summary, slo)
            console.print(f"{name} at {c} sessions: TTFT p99 {point.ttft_p99_s}, tok/s/user "
                          f"{point.tps_p50}, {'within' if point.within_slo else 'outside'} the SLO "
                          f"({summary['wall_s']:.0f} s wall)")
            return point
        return evaluate

    config = {**config, "pacing": {**config["pacing"], "sessions_concurrent": "searched"}}
    for name in names:
        results.append(find_capacity(name, evaluator(name), args.capacity_min, args.capacity_max,
                                     args.capacity_step))
        if args.json_out:  # after every policy, so a long search leaves partial results
            Path(args.json_out).write_bytes(orjson.dumps(capacity_doc(slo, results, config),
                                                         option=orjson.OPT_INDENT_2))
    for line in capacity_lines(slo, results):
        print(line)
    if args.chart:
        console.print(f"chart: {write_chart(args.chart, slo, results)}")
    return 0
