"""Time to first byte the gateway adds with the Redis index: writes awaited vs write-behind.

One run, interleaved (issue 15): one simulated replica (the overhead bench's profile at
``--time-scale 1e6``, compute ~0), one ``redis-server``, and two ``kvgate serve``
processes on it that differ only in ``index.redis_write_behind`` (``sync``: the hooks
await ``record`` and ``set_session`` before the request goes upstream; ``behind``: the
writes are queued, ``prefix_index/write_behind.py``) and in their key prefix (each its
own index, same workload); a third gateway with the embedded index (``memory``) shows
what Redis costs beyond the writes. Per round, one request to each target in
a seeded random order, all with the same body: ``--sessions`` conversations, each turn
appending a short user message to its conversation (so each ``record`` extends a chain by
a few blocks, as a conversation does), with the conversation's session key (``user``),
streamed with ``max_tokens = 1``: the time to the first body byte.

Reported per body: TTFB p50/p99 direct, added p50/p99 of each gateway (gateway minus
direct, paired bootstrap 95% interval, ``loadtest.bootstrap``), behind minus sync, the
gateways' CPU per request (``/proc/<pid>/stat`` around their own requests) and their
``kvgate_index_degraded_total`` at the end (should be 0: a degraded index writes nothing).

    python tools/bench/index_writes.py [--n 1000] [--kb 0,400] [--sessions 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx
import orjson

from loadtest.bench_gateway import PROFILE, client_session, large_body, small_body, timed_post
from loadtest.bench_simulator import process_cpu_s
from loadtest.bootstrap import Estimate, bootstrap_differences
from loadtest.demo import GatewayProcess
from loadtest.peers.overhead import SLOW_PROBES
from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet
from tests.support.redis_server import redis_server

TARGETS = ("direct", "memory", "sync", "behind")
GATEWAYS = TARGETS[1:]
PATH = "/v1/chat/completions"


class Conversations:
    """``n`` conversations over one base body; ``next(i)`` is conversation i's next turn."""

    def __init__(self, base: bytes, n: int) -> None:
        data = orjson.loads(base)
        self.base = data
        self.turns: list[list[dict[str, str]]] = [
            [{"role": "user", "content": f"conversation {i}: " + "context " * 40}] for i in range(n)]

    def next(self, i: int, rng: random.Random) -> bytes:
        turns = self.turns[i]
        turns.append({"role": "user", "content": " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))})
        messages = [*turns[:1], *self.base["messages"], *turns[1:]]  # unique first block: own chain
        body = {**self.base, "messages": messages, "user": f"conv-{i}", "stream": True, "max_tokens": 1}
        return orjson.dumps(body)


async def measure(urls: dict[str, str], pids: dict[str, int], base: bytes, n: int, sessions: int,
                  seed: int) -> tuple[dict[str, list[float]], dict[str, float], float]:
    rng = random.Random(seed)
    convs = Conversations(base, sessions)
    ttfb: dict[str, list[float]] = {t: [] for t in TARGETS}
    sizes: list[int] = []
    cpu = {t: 0.0 for t in TARGETS if t != "direct"}
    clients = {t: client_session(1) for t in TARGETS}
    try:
        for r in range(n + 5):  # 5 warm-up rounds
            body = convs.next(r % sessions, rng)
            sizes.append(len(body))
            order = list(TARGETS)
            rng.shuffle(order)
            for target in order:
                before = process_cpu_s(pids[target]) if target in pids else 0.0
                first, _ = await timed_post(clients[target], urls[target] + PATH, body)
                if target in pids:
                    cpu[target] += process_cpu_s(pids[target]) - before
                if r >= 5:
                    ttfb[target].append(first)
    finally:
        for c in clients.values():
            await c.close()
    return ttfb, {t: s / n for t, s in cpu.items()}, sum(sizes) / len(sizes) / 1e3


def degraded_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvgate_index_degraded_total"))


def fmt(e: Estimate) -> str:
    star = "" if e.supported else "*"
    return f"{star}{e.value * 1e3:+.2f} [{e.lo * 1e3:+.2f}, {e.hi * 1e3:+.2f}]"


def summarize(name: str, ttfb: dict[str, list[float]], cpu: dict[str, float], seed: int) -> dict[str, Any]:
    qs = (50.0, 99.0)
    row: dict[str, Any] = {"body": name, "n": len(ttfb["direct"])}
    for q in qs:
        row[f"direct_p{q:g}_ms"] = (percentile(ttfb["direct"], q) or 0.0) * 1e3
    for target in GATEWAYS:
        added = bootstrap_differences(ttfb[target], ttfb["direct"], qs, seed=seed)
        row[target] = {"added": [e.as_dict() for e in added], "cpu_ms_per_request": cpu[target] * 1e3,
                       "text": [fmt(e) for e in added]}
    diff = bootstrap_differences(ttfb["behind"], ttfb["sync"], qs, seed=seed)
    row["behind_minus_sync"] = {"values": [e.as_dict() for e in diff], "text": [fmt(e) for e in diff]}
    return row


def print_row(row: dict[str, Any]) -> None:
    print(f"\n{row['body']} (mean body {row['body_kb_mean']:.1f} KB): n={row['n']} per target; direct TTFB p50 {row['direct_p50_ms']:.2f} ms, "
          f"p99 {row['direct_p99_ms']:.2f} ms")
    for target in GATEWAYS:
        t = row[target]
        print(f"  {target:7s} added p50 {t['text'][0]} ms   p99 {t['text'][1]} ms   "
              f"CPU {t['cpu_ms_per_request']:.2f} ms/request")
    d = row["behind_minus_sync"]["text"]
    print(f"  behind - sync:  p50 {d[0]} ms   p99 {d[1]} ms")


def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-writes-"))
    bodies = {("small" if kb == 0 else f"{kb} KB"): (small_body() if kb == 0 else large_body(kb))
              for kb in args.kb}
    rows: list[dict[str, Any]] = []
    for sub in ("m", "s", "b"):
        (log_dir / sub).mkdir()
    with redis_server() as url, SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=log_dir) as fleet:
        common = [*SLOW_PROBES, "--set", f"index.redis_url={url}"]
        sync_args = [*common, "--set", "index.key_prefix=sync", "--set", "index.redis_write_behind=false"]
        behind_args = [*common, "--set", "index.key_prefix=behind", "--set", "index.redis_write_behind=true"]
        with GatewayProcess(args.policy, fleet.urls, SLOW_PROBES, log_dir=log_dir / "m") as memory_gw, \
                GatewayProcess(args.policy, fleet.urls, sync_args, log_dir=log_dir / "s") as sync_gw, \
                GatewayProcess(args.policy, fleet.urls, behind_args, log_dir=log_dir / "b") as behind_gw:
            gws = {"memory": memory_gw, "sync": sync_gw, "behind": behind_gw}
            urls = {"direct": fleet.urls[0], **{t: g.url for t, g in gws.items()}}
            pids = {t: g.proc.pid for t, g in gws.items() if g.proc is not None}
            for name, base in bodies.items():
                t0 = time.monotonic()
                ttfb, cpu, kb = asyncio.run(measure(urls, pids, base, args.n, args.sessions, args.seed))
                row = summarize(name, ttfb, cpu, args.seed)
                row["body_kb_mean"] = kb
                row["wall_s"] = time.monotonic() - t0
                rows.append(row)
                print_row(row)
            degraded = {t: degraded_total(urls[t]) for t in ("sync", "behind")}
    print(f"\nkvgate_index_degraded_total at the end: {degraded}")
    print("* = unsupported (fewer than 10 samples beyond the percentile); intervals: paired bootstrap 95%")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps({"rows": rows, "degraded_total": degraded, "args": vars(args)},
                                                 option=orjson.OPT_INDENT_2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="requests per target and body")
    parser.add_argument("--kb", type=lambda s: [int(x) for x in s.split(",")], default=[0, 400],
                        help="body sizes in KB (0: the small chat body)")
    parser.add_argument("--sessions", type=int, default=40, help="conversations the turns rotate over")
    parser.add_argument("--policy", default="cache-aware")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
