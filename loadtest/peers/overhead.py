"""`kvgate bench peers --overhead`: the latency and CPU each router adds, side by side, one run.

The method is `loadtest.bench_gateway.measure`, applied to every target in turn: one
simulated replica (``kimi-k2.6-b200-tp8`` profile at ``--time-scale 1e6``, so compute is
~0 and a 400 KB prompt fits its context), non-streaming requests with ``max_tokens = 1``
over keep-alive connections, one at a time, alternating direct / through the router so
drift hits both sides alike; the router's CPU (user + system from ``/proc/<pid>/stat``)
is counted around its own requests only. Body sizes: a small chat request and an
agent-shaped ``--kb`` KB one. kvgate runs with its probes slowed to once a minute (like
``kvgate bench gateway``); the peers run with their default health checks.

The machine is shared and noisy: compare the targets of one run with each other, not
with another run's absolute numbers.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from loadtest.bench_gateway import PROFILE, large_body, measure, small_body
from loadtest.peers.targets import kvgate_policy, open_target, target_version
from loadtest.simulator.fleet import SimFleet

SLOW_PROBES = (
    "--set",
    "registry.probe_interval_s=60",
    "--set",
    "registry.loads_poll_interval_s=60",
)


def overhead_rows(
    targets: Sequence[str], small: int, large: int, kb: int, log_dir: Path, console: Console
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bodies = (("small", small_body(), small), (f"{kb}KB", large_body(kb), large))
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=log_dir) as fleet:
        replica = fleet.urls[0]
        for target in targets:
            extra = SLOW_PROBES if kvgate_policy(target) is not None else ()
            try:
                with open_target(target, [replica], log_dir, extra) as (url, pid):
                    for name, body, n in bodies:
                        console.print(f"overhead: {target}, {name} x {n}")
                        rows.append(
                            {
                                "target": target,
                                "version": target_version(target),
                                "body": name,
                                **measure(replica, url, pid, body, n),
                            }
                        )
            except (RuntimeError, TimeoutError, OSError) as e:
                console.print(f"[red]{target} failed: {e}[/]")
                rows.append({"target": target, "version": target_version(target), "error": str(e)})
    return rows


def overhead_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title="added latency and CPU per request (one replica, compute ~0)", title_justify="left"
    )
    cols = ("target", "body", "n", "direct p50", "via p50", "added p50", "added p99", "CPU/request")
    keys = (
        "direct_p50_ms",
        "gateway_p50_ms",
        "added_p50_ms",
        "added_p99_ms",
        "gateway_cpu_ms_per_request",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("target", "body") else "right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["target"]), "-", "-", f"failed: {row['error']}"[:60])
            continue
        table.add_row(
            str(row["target"]),
            str(row["body"]),
            str(row["requests"]),
            *(f"{row[k]:.3f} ms" for k in keys),
        )
    return table


def run_overhead(args: argparse.Namespace, targets: Sequence[str], console: Console) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-overhead-"))
    rows = overhead_rows(targets, args.small, args.large, args.kb, log_dir, console)
    console.print(overhead_table(rows))
    console.print(
        "anchor (sglang-router 0.3.2 on this machine, earlier): +0.2 ms p50 small; "
        "+1.8 ms p50 and 1.8 ms CPU per 400 KB"
    )
    if args.json:
        args.json.write_bytes(orjson.dumps({"overhead": rows}, option=orjson.OPT_INDENT_2))
        console.print(f"results: {args.json}")
    return 0 if all("error" not in r for r in rows) else 1
