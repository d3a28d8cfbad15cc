"""CPU per streamed answer of three relays in front of one simulated replica, one run.

Where a streamed answer's router CPU goes once the request is routed: each SSE chunk is one
read from the replica and one write to the client, whatever the router. This bench puts
three relays in front of the same simulated replica (``kimi-k2.6-b200-tp8`` at
``--time-scale``, so tokens arrive spaced as in ``kvgate bench peers``) and streams
``--requests`` answers of ``--tokens`` tokens through each, ``--concurrency`` at a time:

- ``kvgate``: ``kvgate serve`` (cache-aware, in-memory index), the whole data plane;
- ``sglang-router``: sglang-router 0.3.2 (Rust), when installed (``bash loadtest/peers/install.sh``);
- ``python-floor`` (and ``python-floor-granian``): the pass-through proxy of
  ``loadtest/peers/python_floor.py``, kvgate's server and client stack with nothing of
  kvgate's own (``--relays kvgate,python-floor,...``; not in the default list);
- ``splice``: a byte-level TCP splice in Python on uvloop (this file, ``--serve-splice``):
  no HTTP parsing, no routing, one ``transport.write`` per ``data_received``. It is the
  floor of any Python relay on this event loop: what a relay below ASGI (parsing only the
  chunk framing) would approach, not something kvgate could ship as it is.

Reported per relay: its process's CPU (user + system, ``/proc/<pid>/stat``) per answer and
per SSE event, and the events each answer carried (checked equal for every relay).

    python tools/bench/relay_floor.py [--tokens 200] [--requests 200] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def serve_splice(port: int, upstream: str) -> None:
    """The splice relay: every client connection gets one upstream connection; bytes pass."""
    import uvloop

    host, _, up_port = upstream.removeprefix("http://").partition(":")

    class Back(asyncio.Protocol):
        def __init__(self, front: asyncio.Transport) -> None:
            self.front = front

        def data_received(self, data: bytes) -> None:
            self.front.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.front.close()

    class Front(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
            self.back: asyncio.Transport | None = None
            self.pending: list[bytes] = []
            asyncio.ensure_future(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            back, _ = await loop.create_connection(lambda: Back(self.transport), host, int(up_port))
            self.back = back
            for data in self.pending:
                back.write(data)

        def data_received(self, data: bytes) -> None:
            if self.back is None:
                self.pending.append(data)
            else:
                self.back.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.back is not None:
                self.back.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


async def stream_all(url: str, tokens: int, requests: int, concurrency: int) -> list[int]:
    """``requests`` streamed answers, ``concurrency`` at a time: SSE events per answer."""
    import aiohttp
    import orjson

    from loadtest.bench_gateway import small_body, with_stream

    body = with_stream(small_body(), True, tokens)
    doc = orjson.loads(body)
    doc["ignore_eos"] = True  # every answer exactly ``tokens`` long
    body = orjson.dumps(doc)
    events: list[int] = []
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status} {data[:200]!r}")
                events.append(data.count(b"data:"))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return events


def measure(name: str, url: str, pid: int, args: argparse.Namespace) -> dict[str, float | str]:
    from loadtest.bench_simulator import process_cpu_s

    asyncio.run(stream_all(url, args.tokens, 8, args.concurrency))  # warm-up
    cpu0, t0 = process_cpu_s(pid), time.monotonic()
    events = asyncio.run(stream_all(url, args.tokens, args.requests, args.concurrency))
    cpu, wall = process_cpu_s(pid) - cpu0, time.monotonic() - t0
    n = len(events)
    mean_events = sum(events) / n
    return {"relay": name, "answers": n, "events_per_answer": mean_events, "wall_s": wall,
            "cpu_ms_per_answer": cpu / n * 1e3, "cpu_us_per_event": cpu / (n * mean_events) * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--relays", default="kvgate,sglang-router,splice")
    parser.add_argument("--serve-splice", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_splice:
        serve_splice(int(args.serve_splice[0]), args.serve_splice[1])
        return 0

    from loadtest.demo import GatewayProcess
    from loadtest.peers.overhead import SLOW_PROBES
    from loadtest.peers.run import missing_peers, running_peer
    from loadtest.peers.targets import FLOORS, open_target
    from loadtest.simulator.fleet import SimFleet, wait_healthy
    from loadtest.simulator.ports import free_port

    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-relay-floor-"))
    rows = []
    with SimFleet(1, profile="kimi-k2.6-b200-tp8", time_scale=args.time_scale, seed=1, log_dir=log_dir) as fleet:
        for relay in args.relays.split(","):
            if relay == "kvgate":
                with GatewayProcess("cache-aware", fleet.urls, SLOW_PROBES, log_dir=log_dir) as gw:
                    assert gw.proc is not None
                    rows.append(measure(relay, gw.url, gw.proc.pid, args))
            elif relay == "splice":
                port = free_port()
                proc = subprocess.Popen([sys.executable, __file__, "--serve-splice", str(port), fleet.urls[0]])
                try:
                    wait_healthy(f"http://127.0.0.1:{port}", 10.0, proc)  # the replica's /health, spliced
                    rows.append(measure(relay, f"http://127.0.0.1:{port}", proc.pid, args))
                finally:
                    proc.terminate()
                    proc.wait(10)
            elif relay in FLOORS:
                with open_target(relay, fleet.urls, log_dir) as (url, pid):
                    rows.append(measure(relay, url, pid, args))
            elif missing_peers([relay]):
                print(f"{relay}: not installed (bash loadtest/peers/install.sh); skipped", file=sys.stderr)
            else:
                with running_peer(relay, fleet.urls, log_dir=log_dir) as peer:
                    rows.append(measure(relay, peer.url, peer.pid, args))
    print(f"{args.tokens} tokens per answer, {args.requests} answers, concurrency {args.concurrency}, "
          f"time scale {args.time_scale:g}")
    print(f"{'relay':<15} {'answers':>7} {'events/answer':>13} {'CPU/answer':>11} {'CPU/event':>10} {'wall':>7}")
    for r in rows:
        print(f"{r['relay']:<15} {r['answers']:>7} {r['events_per_answer']:>13.1f} "
              f"{r['cpu_ms_per_answer']:>8.2f} ms {r['cpu_us_per_event']:>7.1f} us {r['wall_s']:>6.1f}s")
    counts = {round(float(r["events_per_answer"]), 1) for r in rows}
    return 0 if len(counts) <= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
