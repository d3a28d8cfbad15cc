"""Benchmark: latency the gateway adds over calling a replica directly, and its CPU.

One simulated replica (``kimi-k2.6-b200-tp8`` profile, so a 400 KB prompt fits its
context) runs at a very high ``--time-scale`` (compute ~ 0) and is called with
``max_tokens = 1``, non-streaming, over keep-alive connections, one request at a time:
once directly, once through a real ``kvgate serve`` process, alternating so drift hits
both sides alike. Reported per body size (a small chat request; an agent-shaped
~400 KB chat request from ``loadtest.bench_hashing.make_body``):

- p50 / p99 wall latency, direct and through the gateway, and the added p50 / p99
  (gateway minus direct percentile),
- gateway CPU per request: user + system seconds of the gateway process from
  ``/proc/<pid>/stat`` before/after the gateway half of the run, divided by requests
  (probes are slowed to once a minute so they do not count).

Anchor on this machine: sglang-router 0.3.2 adds +0.2 ms p50 on a small request,
+1.8 ms p50 and 1.8 ms of CPU per 400 KB request. The machine is shared and noisy: for
a comparison, measure sglang-router in the same run with the same method
(``kvgate bench peers --overhead --targets kvgate,sglang-router``, which calls
``measure`` below for every target).

    python -m loadtest.bench_gateway [--small 400] [--large 150] [--kb 400] [--policy cache-aware]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.bench_hashing import make_body
from loadtest.bench_simulator import process_cpu_s
from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet, free_port, wait_healthy

PROFILE = "kimi-k2.6-b200-tp8"
MODEL = "kimi-k2.6"


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


def _timed_post(client: httpx.Client, url: str, body: bytes) -> float:
    start = time.perf_counter()
    r = client.post(url, content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return elapsed


def measure(replica: str, gateway: str, gateway_pid: int, body: bytes, n: int) -> dict[str, float]:
    """Alternate direct / gateway requests; gateway CPU is counted over its own requests."""
    direct: list[float] = []
    through: list[float] = []
    cpu_s = 0.0
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        for _ in range(5):  # warm up connections, caches, code paths
            _timed_post(client, replica + "/v1/chat/completions", body)
            _timed_post(client, gateway + "/v1/chat/completions", body)
        for _ in range(n):
            direct.append(_timed_post(client, replica + "/v1/chat/completions", body))
            before = process_cpu_s(gateway_pid)
            through.append(_timed_post(client, gateway + "/v1/chat/completions", body))
            cpu_s += process_cpu_s(gateway_pid) - before
    return {
        "body_kb": len(body) / 1000, "requests": n,
        "direct_p50_ms": _pct(direct, 0.5) * 1e3, "direct_p99_ms": _pct(direct, 0.99) * 1e3,
        "gateway_p50_ms": _pct(through, 0.5) * 1e3, "gateway_p99_ms": _pct(through, 0.99) * 1e3,
        "added_p50_ms": (_pct(through, 0.5) - _pct(direct, 0.5)) * 1e3,
        "added_p99_ms": (_pct(through, 0.99) - _pct(direct, 0.99)) * 1e3,
        "gateway_cpu_ms_per_request": cpu_s / n * 1e3,
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
