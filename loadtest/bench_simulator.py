"""Benchmark: requests/s one simulated replica process takes with ~400 KB chat prompts.

(issue 2 "How fast": at least 200 req/s of ~100k-token prompts with compute scaled to
near zero.) Starts one ``kvgate sim`` replica (default profile, ``--time-scale 1e6``)
and ``--clients`` client processes, each an asyncio loop with one ``httpx.AsyncClient``
keeping ``--concurrency`` requests in flight for ``--duration-s``. Every prompt is
``--prompt-kb`` of text: one of ``--bases`` shared base prompts plus a unique tail, so the
replica tokenises, hashes and matches the whole prompt on every request and its prefix
cache sees both hits and misses. Prints requests/s, latency percentiles, errors, and the
cache-index memory figure of ``loadtest/bench_simulator_memory.py`` when that exists.

    python -m loadtest.bench_simulator [--clients 2 --concurrency 16 --duration-s 10]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("cache", "router", "replica", "prefix", "token", "session", "agent", "tool", "kernel",
         "page", "block", "decode", "prefill", "stream", "latency", "budget", "python", "def")


def make_bases(n: int, size_bytes: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    bases = []
    for _ in range(n):
        words: list[str] = []
        total = 0
        while total < size_bytes:
            w = rng.choice(WORDS)
            words.append(w)
            total += len(w) + 1
        bases.append(" ".join(words)[:size_bytes])
    return bases


def request_body(base: str, tail: str, max_tokens: int) -> bytes:
    return orjson.dumps({"model": "sim", "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "system", "content": base},
                                      {"role": "user", "content": tail}]})


async def client_loop(url: str, args: argparse.Namespace, index: int) -> dict[str, Any]:
    bases = make_bases(args.bases, args.prompt_kb * 1024, args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    latencies: list[float] = []
    errors = 0
    counter = 0
    deadline = time.monotonic() + args.duration_s
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0, trust_env=False) as client:

        async def worker(w: int) -> None:
            nonlocal errors, counter
            while time.monotonic() < deadline:
                counter += 1
                tail = f"client {index} worker {w} request {counter}: go on."
                body = request_body(bases[counter % len(bases)], tail, args.max_tokens)
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", content=body,
                                      headers={"content-type": "application/json"})
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
        elapsed = time.monotonic() - t0
    return {"ok": len(latencies), "errors": errors, "elapsed_s": elapsed, "latencies": latencies}


def _pct(values: Sequence[float], q: float) -> float:
    """``q`` as a fraction (0.99), the project's one percentile (loadtest.percentile)."""
    value = percentile(values, q * 100)
    return float("nan") if value is None else value


def run_clients(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start the client processes, wait, and merge their figures."""
    common = ["--prompt-kb", str(args.prompt_kb), "--concurrency", str(args.concurrency),
              "--duration-s", str(args.duration_s), "--bases", str(args.bases),
              "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    procs = [subprocess.Popen([sys.executable, "-m", "loadtest.bench_simulator", "--client-of", url,
                               "--client-index", str(i), *common], stdout=subprocess.PIPE, cwd=ROOT)
             for i in range(args.clients)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=args.duration_s + 120)
        results.append(json.loads(out))
    latencies = [x for r in results for x in r["latencies"]]
    elapsed = max(r["elapsed_s"] for r in results)
    return {"requests": len(latencies), "errors": sum(r["errors"] for r in results),
            "elapsed_s": elapsed, "req_per_s": len(latencies) / elapsed,
            "p50_ms": _pct(latencies, 0.5) * 1e3, "p99_ms": _pct(latencies, 0.99) * 1e3}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_figure() -> str | None:
    script = ROOT / "loadtest" / "bench_simulator_memory.py"
    if not script.exists():
        return None
    r = subprocess.run([sys.executable, "-m", "loadtest.bench_simulator_memory"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, check=False)
    return (r.stdout + r.stderr).strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="kimi-k2.6-b200-tp8")
    parser.add_argument("--time-scale", type=float, default=1e6)
    parser.add_argument("--prompt-kb", type=int, default=400)
    parser.add_argument("--bases", type=int, default=8, help="distinct shared base prompts")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per client")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the cache-index memory figure")
    parser.add_argument("--client-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--client-index", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.client_of:  # a client process: print its figures as JSON
        print(json.dumps(asyncio.run(client_loop(args.client_of, args, args.client_index))))
        return 0
    print("command:", shlex.join([sys.executable, "-m", "loadtest.bench_simulator", *sys.argv[1:]]))
    with SimFleet(1, profile=args.profile, time_scale=args.time_scale, seed=args.seed) as fleet:
        pid = fleet.procs[0].pid
        cpu0 = process_cpu_s(pid)
        result = run_clients(fleet.urls[0], args)
        cpu_ms = (process_cpu_s(pid) - cpu0) / max(result["requests"], 1) * 1e3
    print(f"simulator: {result['requests']} requests of {args.prompt_kb} KB in {result['elapsed_s']:.1f} s "
          f"= {result['req_per_s']:.0f} req/s ({args.clients} client processes x {args.concurrency} "
          f"in flight; p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms; "
          f"errors {result['errors']})")
    print(f"replica CPU: {cpu_ms:.2f} ms per request = {1e3 / cpu_ms:.0f} req/s per fully available core "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    if not args.no_memory:
        figure = memory_figure()
        print("cache-index memory:", figure if figure else "(loadtest/bench_simulator_memory.py not present)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
