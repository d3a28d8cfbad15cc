"""Capacity at an SLO: how many concurrent sessions a fleet carries under each policy.

``kvgate simulate --capacity --slo-ttft-p99 S --slo-tps-p50 T ...`` runs, for each
policy, a bisection over ``--sessions-concurrent`` (the same workload, the same sessions
and seed for every policy, each run on a fresh fleet: `loadtest.fleetsim.run`) for the
largest concurrency whose run is *within the SLO*:

- TTFT p99 <= ``--slo-ttft-p99`` (default 3 s), and
- median output tokens/s per user >= ``--slo-tps-p50`` (default 200: interactivity).

What a fleet owner buys is that concurrency, and the output tokens per GPU per second
the fleet delivers there.

**The steady-state window.** A run of ``c`` concurrent sessions over a pool of recorded
sessions holds ``c`` sessions live only for a while: from the first moment ``c`` are live
(at once with ``--ramp-s 0``; after the ramp otherwise) until the pool has no unstarted
session left and the first live one ends; after that the fleet drains, and the run's
length is set by its longest session (with recorded think times, hours). Measured over
the whole run, tokens per GPU per second are therefore the same for every concurrency.
Every figure of a capacity point is measured over the window instead
(`loadtest.fleetsim.metrics.steady_window`, `window_summary`): output tokens produced in
it per second per GPU, and the SLO figures (TTFT p99, median tok/s per user, hit rate) of
the requests arriving in it. The SLO is judged over the same window as the throughput
because a capacity point claims "at ``c`` sessions the users get this and the fleet
delivers that": both must describe the same state of the fleet. Over the whole run the
drain (concurrency falling from ``c`` to 0, queues emptying) would dilute the p99 more
the closer ``c`` is to the pool's size, and flatter large concurrencies. The window
keeps the start (a cold fleet meeting ``c`` first turns at once with ``--ramp-s 0``):
part of holding ``c`` sessions, and the same for every policy; ``--ramp-s`` moves the
window's start past it. A run whose window is empty (``c`` larger than the pool: the
bracket is clamped to it) is outside the SLO. The JSON gives, per point, the window's
bounds and request count, and the whole run's p99 and throughput beside them. The window
shortens as ``c`` nears the pool's size, and a short window over-weights the cold start
and the busy first turns of sessions (higher p99, higher tokens per session): use a pool
several times the capacity (the whole trace), and compare policies on the same pool.

Search: evaluate the bracket's ends (``--capacity-min``, ``--capacity-max``); if the
lower end already misses the SLO the capacity is 0 (below the bracket), if the upper end
meets it the capacity is at least the upper end; otherwise halve the bracket, keeping
``lo`` within the SLO and ``hi`` outside it, until ``hi - lo <= --capacity-step``. It
assumes that more sessions never make the SLO easier; every run is reported, so a
non-monotonic point shows. Every run is a whole simulation, so ~log2((max - min) /
step) + 2 runs per policy.

The chart (``--chart PATH``) has two panels: the usual inference trade-off curve
(throughput per GPU against interactivity, one curve per policy through every
concurrency it was run at, each point labelled with its concurrency, filled when within
the SLO, the capacity point ringed), and TTFT p99 against concurrency with the SLO's
bound, the figure that decides the capacity when interactivity has room.
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

from loadtest.fleetsim.metrics import session_roots, steady_window, window_summary
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
    """One run at one concurrency: its SLO figures, throughput and hit rate (over the window).

    ``run_*``: the same figures over the whole run, for comparison."""

    concurrency: int
    within_slo: bool
    ttft_p99_s: float | None
    tps_p50: float | None
    tokens_per_s_per_gpu: float | None
    cache_hit_rate: float | None
    window_start_s: float | None = None
    window_end_s: float | None = None
    window_requests: int | None = None
    run_ttft_p99_s: float | None = None
    run_tokens_per_s_per_gpu: float | None = None

    @classmethod
    def of(cls, concurrency: int, summary: Mapping[str, Any], slo: Slo) -> Point:
        """The point of one set of figures (``summarize``'s or ``window_summary``'s names)."""
        return cls(concurrency, slo.met(summary), summary.get("ttft_p99_s"),
                   summary.get("output_tps_per_user_p50"),
                   summary.get("throughput_tokens_per_s_per_gpu"), summary.get("cache_hit_rate"))

    @classmethod
    def of_run(cls, concurrency: int, run: Mapping[str, Any], window: Mapping[str, Any] | None,
               slo: Slo) -> Point:
        """The point of a run: its window's figures (none, and outside the SLO, without one)."""
        p99, tokens = run.get("ttft_p99_s"), run.get("throughput_tokens_per_s_per_gpu")
        if window is None:
            return cls(concurrency, False, None, None, None, None, run_ttft_p99_s=p99,
                       run_tokens_per_s_per_gpu=tokens)
        return dataclasses.replace(
            cls.of(concurrency, window, slo), window_start_s=window["window_start_s"],
            window_end_s=window["window_end_s"], window_requests=window["requests"],
            run_ttft_p99_s=p99, run_tokens_per_s_per_gpu=tokens)


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """A policy's capacity: the largest concurrency within the SLO (None: not even ``min``)."""

    policy: str
    best: Point | None
    points: tuple[Point, ...]  # every run, by concurrency
    below_min: bool  # the lower end of the bracket already missed the SLO
    at_max: bool  # the upper end met it: the capacity is at least ``max``


Evaluate = Callable[[int], Point]

WINDOW = ("steady state: from the first moment `sessions_concurrent` sessions are live to the "
          "first moment after it that fewer are; SLO figures over the requests arriving in it, "
          "throughput = output tokens produced in it / its length / GPUs")


def point_line(p: Point) -> str:
    """One point's figures, for the progress lines and the report."""
    if p.window_start_s is None:
        return f"no steady window ({p.concurrency} sessions never live at once): outside the SLO"
    return (f"TTFT p99 {p.ttft_p99_s or 0:.2f} s, {p.tps_p50 or 0:.1f} tok/s/user, "
            f"{p.tokens_per_s_per_gpu or 0:.3g} output tok/s/GPU, hit {100 * (p.cache_hit_rate or 0):.2f}% "
            f"over {p.window_requests:,} requests in [{p.window_start_s:,.0f}, {p.window_end_s or 0:,.0f}) s; "
            f"{'within' if p.within_slo else 'outside'} the SLO")


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


def results_of_doc(doc: Mapping[str, Any]) -> tuple[Slo, list[CapacityResult]]:
    """The SLO and results of a `capacity_doc` (to redraw a chart from a saved JSON)."""
    def point(d: Mapping[str, Any]) -> Point:
        fields: dict[str, Any] = {f.name: d.get(f.name) for f in dataclasses.fields(Point)}
        return Point(**fields)

    results = []
    for c in doc["capacity"]:
        points = tuple(point(d) for d in c["points"])
        best = next((p for p in points if c["at_capacity"] and p.concurrency == c["sessions"]), None)
        results.append(CapacityResult(c["policy"], best, points, c["below_min"], c["at_max"]))
    return Slo(**doc["slo"]), results


def capacity_lines(slo: Slo, results: Sequence[CapacityResult]) -> list[str]:
    """One line per policy, best capacity first."""
    out = [f"capacity at SLO (TTFT p99 <= {slo.ttft_p99_s:g} s, median output tok/s/user >= {slo.tps_p50:g}):"]
    for r in sorted(results, key=lambda r: -(r.best.concurrency if r.best else 0)):
        b = r.best
        if b is None:
            out.append(f"  {r.policy}: below the bracket (misses the SLO at {r.points[0].concurrency} sessions)")
            continue
        more = "+" if r.at_max else ""
        out.append(f"  {r.policy}: {b.concurrency}{more} sessions: {point_line(b)} ({len(r.points)} runs)")
    return out


def write_chart(path: str | Path, slo: Slo, results: Sequence[CapacityResult]) -> Path:
    """Left: throughput per GPU vs interactivity; right: TTFT p99 vs concurrency (docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5))
    for r in results:
        pts = [p for p in r.points if p.tps_p50 is not None and p.tokens_per_s_per_gpu is not None]
        if not pts:
            continue
        xs, ys = [p.tps_p50 or 0.0 for p in pts], [p.tokens_per_s_per_gpu or 0.0 for p in pts]
        line, = ax.plot(xs, ys, label=f"{r.policy} (capacity {r.best.concurrency if r.best else 0})")
        color = line.get_color()
        bx.plot([p.concurrency for p in pts], [p.ttft_p99_s or 0.0 for p in pts], color=color)
        for p, x, y in zip(pts, xs, ys):
            face = color if p.within_slo else "white"
            ax.scatter([x], [y], s=28, color=color, facecolors=face, zorder=3)
            bx.scatter([p.concurrency], [p.ttft_p99_s or 0.0], s=28, color=color, facecolors=face, zorder=3)
            ax.annotate(str(p.concurrency), (x, y), fontsize=7, textcoords="offset points",
                        xytext=(4, 3), color=color)
            if p is r.best:
                for axis, xy in ((ax, (x, y)), (bx, (p.concurrency, p.ttft_p99_s or 0.0))):
                    axis.scatter([xy[0]], [xy[1]], s=150, facecolors="none", edgecolors=color,
                                 linewidths=1.5, zorder=3)
    lo, hi = ax.get_xlim()
    floor = "dashed"
    if lo <= slo.tps_p50 <= hi:
        ax.axvline(slo.tps_p50, linestyle="--", color="grey", linewidth=1)
    else:  # zoomed on the points: the floor is off the axis
        floor = f"{'left' if slo.tps_p50 < lo else 'right'} of this axis"
    bx.axhline(slo.ttft_p99_s, linestyle="--", color="grey", linewidth=1)
    ax.set_xlabel(f"interactivity: output tokens/s per user, median (SLO floor {slo.tps_p50:g}: {floor})")
    ax.set_ylabel("output tokens/s per GPU (steady-state window)")
    ax.set_title("throughput per GPU vs interactivity (labels: concurrent sessions)", fontsize=9)
    bx.set_xlabel("concurrent sessions")
    bx.set_ylabel("TTFT p99 (s, steady-state window)")
    bx.set_title(f"TTFT p99 (SLO <= {slo.ttft_p99_s:g} s, dashed)", fontsize=9)
    for axis in (ax, bx):
        axis.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"capacity at SLO: TTFT p99 <= {slo.ttft_p99_s:g} s, >= {slo.tps_p50:g} tok/s/user "
                 "(filled: within the SLO; ringed: capacity)", fontsize=10)
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

    roots = session_roots(workload.sessions)
    gpus = base.replicas * base.gpus_per_replica

    def evaluator(name: str) -> Evaluate:
        def evaluate(c: int) -> Point:
            cfg = dataclasses.replace(base, pacing=dataclasses.replace(base.pacing, sessions_concurrent=c,
                                                                       session_rate=None))
            res = run_policy(workload, name, cfg)
            window = steady_window(res.records, c, roots)
            point = Point.of_run(c, res.summary,
                                 window_summary(res.records, window, gpus) if window else None, slo)
            console.print(f"{name} at {c} sessions: {point_line(point)} ({res.summary['wall_s']:.0f} s wall)")
            return point
        return evaluate

    config = {**config, "pacing": {**config["pacing"], "sessions_concurrent": "searched"},
              "window": WINDOW}
    top = min(args.capacity_max, len(workload.sessions))
    if top < args.capacity_max:
        console.print(f"--capacity-max {args.capacity_max} > the {top} sessions of the workload: "
                      f"searching up to {top}")
    for name in names:
        results.append(find_capacity(name, evaluator(name), args.capacity_min, top, args.capacity_step))
        if args.json_out:  # after every policy, so a long search leaves partial results
            Path(args.json_out).write_bytes(orjson.dumps(capacity_doc(slo, results, config),
                                                         option=orjson.OPT_INDENT_2))
    for line in capacity_lines(slo, results):
        print(line)
    if args.chart:
        console.print(f"chart: {write_chart(args.chart, slo, results)}")
    return 0
