"""The wall-clock path of a small request through kvgate's callbacks path, step by step.

One simulated replica (compute ~0) and one kvgate in front of it, started as `kvgate bench
peers --overhead` starts them; ``critical_path_hook/sitecustomize.py`` on the gateway's
PYTHONPATH wraps each step (parse, context, snapshot, decision, request head, upstream
write, routing, the answer's head and end, the client write, and each piece of the
bookkeeping after it) with ``perf_counter_ns`` marks. After a warm-up, exactly
``--requests`` requests go through one at a time; printed: the median gap between each
two consecutive marks, in microseconds, and how many requests had both.

The marks cost ~1 us each and run warm (one client, nothing between the requests), so
read the steps against each other: the interleaved overhead bench runs each router colder.

    python tools/profile/critical_path.py --requests 2000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calls import recorded  # (tools/profile/calls.py)
from rich.console import Console
from rich.table import Table

from loadtest.bench_gateway import PROFILE, small_body, with_stream
from loadtest.peers.overhead import SLOW_PROBES
from loadtest.peers.targets import open_target
from loadtest.simulator.fleet import SimFleet

HOOK = Path(__file__).resolve().parent / "critical_path_hook"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="kvgate", help="kvgate or kvgate@<checkout>")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    body = with_stream(small_body(), False, 1)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-crit-"))
    out = log_dir / "critical-path.json"
    os.environ["PYTHONPATH"] = str(HOOK) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["KVGATE_CRIT_OUT"] = str(out)
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=log_dir) as fleet, \
            open_target(args.target, fleet.urls, log_dir, SLOW_PROBES) as (url, pid):
        recorded(pid, url, body, args.requests, out, args.warmup)  # (a renamed step: no output, see log_dir)
    result = json.loads(out.read_text())
    table = Table(title=f"{args.target}: a small request's path, medians of {result['requests']} requests (us)")
    table.add_column("from -> to")
    table.add_column("median us", justify="right")
    table.add_column("n", justify="right")
    for step, (median, n) in result["steps"].items():
        table.add_row(step, f"{median:.1f}", str(n))
    Console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
