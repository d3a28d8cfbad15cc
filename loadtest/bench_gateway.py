"""Benchmark: latency the gateway adds over calling a replica directly, and its CPU.

One simulated replica (``kimi-k2.6-b200-tp8`` profile, so a 400 KB prompt fits its
context) runs at a very high ``--time-scale`` (compute ~ 0) and is called with
``max_tokens = 1``, non-streaming, over keep-alive connections, one request at a time:
once directly, once through a real ``kvgate serve`` process, alternating so drift hits
both sides alike (``measure_async``; ``measure_interleaved`` does the same for several
routers at once, for ``kvgate bench peers --overhead``, which also runs it streamed and
with several requests in flight per round; ``open_loop`` is its Poisson arrivals for the
maximum-rate search). Reported per body size (a small chat request; an agent-shaped
~400 KB chat request from ``loadtest.bench_hashing.make_body``):

- p50 / p99 wall latency, direct and through the gateway, and the added p50 / p99
  (gateway minus direct percentile),
- gateway CPU per request: user + system seconds of the gateway process from
  ``/proc/<pid>/stat`` before/after the gateway half of the run, divided by requests
  (probes are slowed to once a minute so they do not count).

Anchor on this machine: sglang-router 0.3.2 adds +0.2 ms p50 on a small request,
+1.8 ms p50 and 1.8 ms of CPU per 400 KB request. The machine is shared and noisy: for
a comparison, measure sglang-router in the same run with the same method
(``kvgate bench peers --overhead --targets kvgate,sglang-router``, which interleaves
the targets' rounds).

    python -m loadtest.bench_gateway [--small 400] [--large 150] [--kb 400] [--policy cache-aware]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.bench_hashing import make_body
from loadtest.bench_simulator import process_cpu_s
from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet, wait_healthy
from loadtest.simulator.ports import free_port

PROFILE = "kimi-k2.6-b200-tp8"
MODEL = "kimi-k2.6"
JSON = {"content-type": "application/json"}


def small_body() -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]})


def large_body(kb: int) -> bytes:
    data = orjson.loads(make_body(kb))
    data.update(model=MODEL, max_tokens=1, stream=False)
    return orjson.dumps(data)


def _pct(values: Sequence[float], q: float) -> float:
    """``q`` as a fraction (0.99), the project's one percentile (loadtest.percentile)."""
    return percentile(values, q * 100) or 0.0


def with_stream(body: bytes, stream: bool, max_tokens: int = 1) -> bytes:
    """``body`` with ``stream`` and ``max_tokens`` set (a streamed case needs a few chunks)."""
    data = orjson.loads(body)
    data.update(stream=stream, max_tokens=max_tokens)
    return orjson.dumps(data)


@dataclass(frozen=True)
class Samples:
    """Interleaved samples (seconds): ``direct[i]`` and ``via[i]`` were taken in one round.

    ``*_ttfb``: time to the first byte of the response body; ``*_total``: to its end."""

    direct_ttfb: list[float]
    direct_total: list[float]
    via_ttfb: list[float]
    via_total: list[float]
    cpu_s: float

    @property
    def requests(self) -> int:
        return len(self.via_total)


async def timed_post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the end) of one POST; raises unless 200."""
    start = time.perf_counter()
    first: float | None = None
    async with session.post(url, data=body, headers=JSON) as r:
        async for _chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return (first or end) - start, end - start


async def _batch(session: aiohttp.ClientSession, url: str, body: bytes, c: int) -> list[tuple[float, float]]:
    return list(await asyncio.gather(*(timed_post(session, url, body) for _ in range(c))))


def client_session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=60.0))


async def measure_async(replica: str, gateway: str, gateway_pid: int, body: bytes, n: int,
                        concurrency: int = 1) -> Samples:
    """Rounds of ``concurrency`` requests straight to the replica, then as many through the
    gateway, until ``n`` per side; the gateway's CPU is counted around its own rounds."""
    return (await measure_interleaved(replica, [(gateway, gateway_pid)], body, n, concurrency))[0]


async def measure_interleaved(replica: str, gateways: Sequence[tuple[str, int]], body: bytes, n: int,
                              concurrency: int = 1, seed: int = 0) -> list[Samples]:
    """``measure_async`` for several gateways at once: each round goes direct, gateway 1,
    direct, gateway 2, ... so every gateway is paired with direct rounds taken beside its
    own, and a drift of the machine hits every gateway alike (not only the one measured
    while it lasted); each gateway's CPU is counted around its own rounds.

    The gateways' order is shuffled every round (seeded): a pause that recurs every k
    requests in the shared replica (its garbage collector, with the same bodies every
    round) would otherwise land on the same gateway's slot each time, and show as that
    gateway's tail (seen on 2026-12-04: +28 ms at p99 on 400 KB bodies, on whichever
    target held that slot, in its direct samples as often as in its own)."""
    order = list(range(len(gateways)))
    rng = random.Random(seed)
    path = "/v1/chat/completions"
    samples = [Samples([], [], [], [], 0.0) for _ in gateways]
    cpu_s = [0.0] * len(gateways)
    async with client_session(concurrency) as direct, client_session(concurrency) as via:
        for _ in range(5):  # warm up connections, caches, code paths
            for url, _pid in gateways:
                await _batch(direct, replica + path, body, concurrency)
                await _batch(via, url + path, body, concurrency)
        while len(samples[-1].via_total) < n:
            rng.shuffle(order)
            for i in order:
                url, pid = gateways[i]
                s = samples[i]
                for t, e in await _batch(direct, replica + path, body, concurrency):
                    s.direct_ttfb.append(t)
                    s.direct_total.append(e)
                before = process_cpu_s(pid)
                for t, e in await _batch(via, url + path, body, concurrency):
                    s.via_ttfb.append(t)
                    s.via_total.append(e)
                cpu_s[i] += process_cpu_s(pid) - before
    return [dataclasses.replace(s, cpu_s=c) for s, c in zip(samples, cpu_s, strict=True)]


async def open_loop(url: str, body: bytes, rate: float, n: int, seed: int) -> tuple[list[float], float]:
    """``n`` requests with Poisson arrivals at ``rate``/s (seeded), not waiting for answers;
    returns each one's total latency (s) and the share of the schedule the client kept up
    with (scheduled / actual time to send them all: below 1 when it lagged)."""
    rng = random.Random(seed)
    path = url + "/v1/chat/completions"
    async with client_session(0) as session:  # no connection cap: arrivals never wait for one
        await _batch(session, path, body, 2)
        tasks: list[asyncio.Task[tuple[float, float]]] = []
        start = due = time.perf_counter()
        for _ in range(n):
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(timed_post(session, path, body)))
        kept_up = (due - start) / max(time.perf_counter() - start, 1e-9)
        return [total for _, total in await asyncio.gather(*tasks)], kept_up


def measure(replica: str, gateway: str, gateway_pid: int, body: bytes, n: int) -> dict[str, float]:
    """One request at a time, direct / gateway alternating (the summary `bench gateway` prints)."""
    s = asyncio.run(measure_async(replica, gateway, gateway_pid, body, n))
    direct, through = s.direct_total, s.via_total
    return {
        "body_kb": len(body) / 1000, "requests": s.requests,
        "direct_p50_ms": _pct(direct, 0.5) * 1e3, "direct_p99_ms": _pct(direct, 0.99) * 1e3,
        "gateway_p50_ms": _pct(through, 0.5) * 1e3, "gateway_p99_ms": _pct(through, 0.99) * 1e3,
        "added_p50_ms": (_pct(through, 0.5) - _pct(direct, 0.5)) * 1e3,
        "added_p99_ms": (_pct(through, 0.99) - _pct(direct, 0.99)) * 1e3,
        "gateway_cpu_ms_per_request": s.cpu_s / s.requests * 1e3,
    }


def start_gateway(replica: str, policy: str, log_path: Path) -> tuple[Any, str]:
    import subprocess

    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--replica", replica,
           "--policy", policy, "--log-level", "warning",
           "--set", "registry.probe_interval_s=60", "--set", "registry.loads_poll_interval_s=60"]
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process by the caller
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30.0, proc)
    return proc, url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", type=int, default=400, help="small requests per side")
    parser.add_argument("--large", type=int, default=150, help="large requests per side")
    parser.add_argument("--kb", type=int, default=400, help="size of the large request body (KB)")
    parser.add_argument("--policy", default="cache-aware", help="gateway routing policy")
    parser.add_argument("--time-scale", type=float, default=1e6, help="simulator time scale (~0 compute)")


def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-gateway-"))
    with SimFleet(1, profile=PROFILE, time_scale=args.time_scale, seed=1, log_dir=log_dir) as fleet:
        proc, gateway = start_gateway(fleet.urls[0], args.policy, log_dir / "gateway.log")
        try:
            rows = [("small", measure(fleet.urls[0], gateway, proc.pid, small_body(), args.small)),
                    (f"{args.kb}KB", measure(fleet.urls[0], gateway, proc.pid, large_body(args.kb), args.large))]
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"command: python -m loadtest.bench_gateway --small {args.small} --large {args.large} "
          f"--kb {args.kb} --policy {args.policy} --time-scale {args.time_scale:g}")
    header = ("body", "kB", "n", "direct p50", "direct p99", "gw p50", "gw p99", "added p50", "added p99",
              "gw CPU/req")
    print("  ".join(f"{h:>10}" for h in header))
    for name, m in rows:
        cells = [name, f"{m['body_kb']:.1f}", str(m["requests"])] + [
            f"{m[k]:.3f}ms" for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms",
                                       "added_p50_ms", "added_p99_ms", "gateway_cpu_ms_per_request")]
        print("  ".join(f"{c:>10}" for c in cells))
    print("anchor (sglang-router 0.3.2, this machine): +0.2 ms p50 small; +1.8 ms p50 and 1.8 ms CPU per 400 KB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_gateway", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
