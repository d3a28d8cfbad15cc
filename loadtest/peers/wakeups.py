"""How often a router's threads sleep and wake per streamed chunk.

    python -m loadtest.peers.wakeups --targets kvgate,python-floor-granian,python-floor,sglang-router

Each target in turn, in front of one simulated replica (``kimi-k2.6-b200-tp8`` at time scale
``--time-scale``, 5: tokens paced as on a fleet), gets ``--streams`` streamed chat requests
of ``--tokens`` output tokens one at a time; the router's voluntary context switches (every
thread's ``voluntary_ctxt_switches`` in ``/proc/<pid>/task/*/status``: the times a thread
went to sleep waiting) are counted around them and divided by the SSE chunks the client
received. A thread that sleeps and is woken per chunk costs a scheduler round trip each
time, whatever the thread runs (docs/benchmarks.md, "A flatter stream relay": a quarter of
the gateway's CPU). Counts, not timings: they hold on a busy machine too.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx
import orjson

from loadtest.bench_gateway import JSON, MODEL, PROFILE
from loadtest.peers.targets import open_target, parse_targets
from loadtest.simulator.fleet import SimFleet


def sleeps_by_thread(pid: int) -> dict[str, tuple[str, int]]:
    """Thread id -> (name, voluntary context switches so far)."""
    out: dict[str, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[task.name] = (name, int(line.split()[1]))
    return out


def measure(url: str, pid: int, body: bytes, streams: int) -> tuple[int, dict[str, float]]:
    """The chunks ``streams`` streams gave, and the switches per chunk by thread name."""
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        client.post(url + "/v1/chat/completions", content=body, headers=JSON).read()  # warm: connections, caches
        time.sleep(0.5)
        before = sleeps_by_thread(pid)
        chunks = 0
        for _ in range(streams):
            with client.stream("POST", url + "/v1/chat/completions", content=body, headers=JSON) as answer:
                answer.raise_for_status()
                chunks += sum(line.startswith("data:") for line in answer.iter_lines())
        after = sleeps_by_thread(pid)
    by_name: Counter[str] = Counter()
    for tid, (name, count) in after.items():
        by_name[name] += count - before.get(tid, (name, 0))[1]
    return chunks, {name: n / max(chunks, 1) for name, n in by_name.most_common() if n > 0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="kvgate,python-floor-granian,python-floor,sglang-router")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=300, help="output tokens per stream")
    parser.add_argument("--time-scale", type=float, default=5.0, help="the simulated replica's time scale")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = parser.parse_args(argv)
    targets = parse_targets(args.targets)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgate-wakeups-") as tmp, \
            SimFleet(1, profile=PROFILE, time_scale=args.time_scale, seed=1, log_dir=Path(tmp)) as fleet:
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 2000}],
                             "max_tokens": args.tokens, "stream": True})
        for target in targets:
            with open_target(target, fleet.urls, Path(tmp), (), args.time_scale) as (url, pid):
                chunks, by_thread = measure(url, pid, body, args.streams)
            total = sum(by_thread.values())
            rows.append({"target": target, "chunks": chunks, "switches_per_chunk": total, "by_thread": by_thread})
            threads = ", ".join(f"{k} {v:.2f}" for k, v in by_thread.items())
            print(f"{target}: {chunks} chunks, {total:.2f} voluntary context switches per chunk ({threads})",
                  flush=True)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps({"rows": rows, "options": vars(args) | {"json": str(args.json)}},
                                           option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
