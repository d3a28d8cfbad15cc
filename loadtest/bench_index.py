"""Benchmark: prefix-index lookups and decisions, embedded vs Redis (issue 4 "How fast").

The index holds ``--replicas`` replicas x ``--tokens-per-replica`` tokens (64 replicas x
2M tokens = 64 x 31,250 blocks by default): a shared 64-block system prompt on every
replica, the request's own 1,500-block chain on replica 0 (and partly on replicas 1-3),
and random chains filling each replica to its capacity. Measured:
- lookup: ``match(chain, all replicas)`` p50/p99;
- decision: match + get_session + record + set_session (what one routed request costs
  the index), sequential decisions/s per process;
- Redis CPU per decision (``INFO cpu`` deltas) and per script call (``INFO commandstats``);
- memory: process RSS growth for the embedded index, ``used_memory`` for Redis.

    python -m loadtest.bench_index            # starts its own redis-server on a free port
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from prefix_index.base import PrefixIndex, ReplicaCapacity, ReplicaId, SessionEntry
from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex
from prefix_index.redis_backend import RedisPrefixIndex


@dataclass(frozen=True)
class Workload:
    replicas: list[ReplicaId]
    capacity: ReplicaCapacity
    fills: dict[ReplicaId, list[list[int]]]  # chains to record, oldest first
    request: list[int]


def make_workload(n_replicas: int, blocks_per_replica: int, chain_blocks: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    shared = [rng.getrandbits(64) for _ in range(64)]
    request = shared + [rng.getrandbits(64) for _ in range(chain_blocks - len(shared))]
    replicas = [ReplicaId(f"http://10.0.0.{i}:30000") for i in range(n_replicas)]
    fills: dict[ReplicaId, list[list[int]]] = {}
    for i, rid in enumerate(replicas):
        chains, held = [], 0
        while held < blocks_per_replica:
            n = min(chain_blocks, blocks_per_replica - held + len(shared))
            chains.append(shared + [rng.getrandbits(64) for _ in range(n - len(shared))])
            held += n - len(shared)
        partial = {0: chain_blocks, 1: 1000, 2: 500, 3: 200}.get(i)
        if partial:
            chains.append(request[:partial])
        fills[rid] = chains
    return Workload(replicas, ReplicaCapacity(blocks_per_replica, 0), fills, request)


async def populate(index: PrefixIndex, w: Workload) -> None:
    for rid in w.replicas:
        await index.set_capacity(rid, w.capacity)
        for chain in w.fills[rid]:
            await index.record(rid, chain)


def _pct(samples: Sequence[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def time_lookups(index: PrefixIndex, w: Workload, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this process) seconds of each ``match``: CPU is robust on a busy machine."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        await index.match(w.request, w.replicas)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


async def time_decisions(index: PrefixIndex, w: Workload, n: int) -> float:
    """Sequential decisions per second (match + session read + record + session write)."""
    t = time.perf_counter()
    for i in range(n):
        matches = await index.match(w.request, w.replicas)
        await index.get_session(f"s{i % 100}")
        best = max(matches, key=lambda r: matches[r].blocks)
        await index.record(best, w.request)
        await index.set_session(f"s{i % 100}", SessionEntry(best, 96_000, time.time()))
    return n / (time.perf_counter() - t)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _redis_cpu(client: redis.Redis) -> float:
    """Redis server CPU seconds so far (user + sys, from INFO cpu)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def bench_memory(w: Workload, n: int) -> dict[str, float]:
    rss0, t0 = _rss_bytes(), time.perf_counter()
    index = MemoryPrefixIndex()
    await populate(index, w)
    fill_s, rss = time.perf_counter() - t0, _rss_bytes() - rss0
    wall, cpu = await time_lookups(index, w, n)
    return {"fill_s": fill_s, "rss_mb": rss / 2**20, **_lookup_stats(wall, cpu),
            "decisions_per_s": await time_decisions(index, w, n // 2)}


def _lookup_stats(wall: list[float], cpu: list[float]) -> dict[str, float]:
    return {"p50_us": _pct(wall, 0.5) * 1e6, "p99_us": _pct(wall, 0.99) * 1e6,
            "cpu_p50_us": _pct(cpu, 0.5) * 1e6, "cpu_p99_us": _pct(cpu, 0.99) * 1e6}


async def bench_redis(w: Workload, n: int, url: str) -> dict[str, dict[str, float]]:
    """Fill once; time lookups with the default chain search and with exact matching."""
    client = redis.Redis.from_url(url)
    base = IndexConfig(backend="redis", redis_url=url, redis_timeout_s=1.0)
    index = RedisPrefixIndex(base)
    t0 = time.perf_counter()
    await populate(index, w)
    fill = {"fill_s": time.perf_counter() - t0, "used_memory_mb": int(client.info("memory")["used_memory"]) / 2**20}
    results: dict[str, dict[str, float]] = {}
    for mode, exact in (("redis", False), ("redis-exact", True)):
        idx = RedisPrefixIndex(base.model_copy(update={"redis_exact_match": exact}))
        await time_lookups(idx, w, 20)  # warm-up (script load)
        cpu0 = _redis_cpu(client)
        wall, cpu = await time_lookups(idx, w, n)
        cpu1 = _redis_cpu(client)
        results[mode] = {**(fill if not exact else {}), **_lookup_stats(wall, cpu),
                         "redis_cpu_us_per_lookup": (cpu1 - cpu0) / n * 1e6,
                         "degraded_total": float(idx.degraded_total)}
        await idx.close()
    client.config_resetstat()
    cpu1, n_dec = _redis_cpu(client), n // 2
    results["redis"]["decisions_per_s"] = await time_decisions(index, w, n_dec)
    results["redis"]["redis_cpu_us_per_decision"] = (_redis_cpu(client) - cpu1) / n_dec * 1e6
    evalsha = client.info("commandstats").get("cmdstat_evalsha", {})
    results["redis"]["evalsha_us_per_script_call"] = float(evalsha.get("usec_per_call", 0.0))
    behind = RedisPrefixIndex(base.model_copy(update={"redis_write_behind": True}))
    results["redis-write-behind"] = {"decisions_per_s": await time_decisions(behind, w, n_dec)}
    await behind.close()
    await index.close()
    client.close()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--tokens-per-replica", type=int, default=2_000_000)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--chain-blocks", type=int, default=1500, help="request size in blocks (1,500 = ~100k tokens)")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one (it is FLUSHED)")
    parser.add_argument("--skip-redis", action="store_true")


def run(args: argparse.Namespace) -> int:
    w = make_workload(args.replicas, args.tokens_per_replica // args.block_tokens, args.chain_blocks)
    print(f"index: {args.replicas} replicas x {args.tokens_per_replica // args.block_tokens} blocks; "
          f"request: {len(w.request)} blocks; {args.iterations} lookups")
    results = {"memory": asyncio.run(bench_memory(w, args.iterations))}
    if not args.skip_redis:
        results.update(_with_redis(args.redis_url, lambda url: asyncio.run(bench_redis(w, args.iterations, url))))
    for name, res in results.items():
        print(f"{name:11s} " + "  ".join(f"{k}={v:,.1f}" for k, v in res.items()))
    if "redis" in results:
        mem, red = results["memory"], results["redis"]
        print(f"redis lookup adds p50 {red['p50_us'] - mem['p50_us']:,.0f} us wall over memory; "
              f"redis-side CPU {red['redis_cpu_us_per_lookup']:,.0f} us + client CPU {red['cpu_p50_us']:,.0f} us "
              f"vs memory CPU {mem['cpu_p50_us']:,.0f} us")
    return 0


def _with_redis(url: str | None, fn: Any) -> dict[str, dict[str, float]]:
    if url:
        redis.Redis.from_url(url).flushdb()
        result: dict[str, dict[str, float]] = fn(url)
        return result
    tmp, port = tempfile.mkdtemp(prefix="kvgate-bench-redis-"), _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        result = fn(url)
        return result
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_index", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
