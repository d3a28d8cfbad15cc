"""Benchmark: a small request's latency through a gateway that is tokenizing big first turns.

``kvgate bench hashing --precise --gateway [--tokenizer-dir DIR] [--kb 400] [--small 400]``

Precise mode tokenizes each request's prompt with the model's tokenizer (issue 42). A
400 KB conversation new to the gateway costs 190-470 ms of tokenizer CPU; if that ran on
the gateway's event loop, every request on the process would wait behind it. This
measures that wait, through one real ``kvgate serve`` process:

- one simulated replica with KV events (so the gateway puts it in precise mode), at a
  very high time scale (its own answer takes ~0 ms), whose ``model_path`` folder holds the
  tokenizer files of ``--tokenizer-dir`` (a ``tokenizer.json`` model or a TikToken one; the
  simulator's own folder is written first, then its tokenizer files are replaced by the
  chosen model's, so the gateway loads that model's tokenizer from the ``/server_info`` it
  reads; the simulator counts its own tokens and is unaffected);
- small chat requests for ``--duration-s`` each phase, one at a time, alternating with
  direct calls to the replica (``bench_gateway``'s method), first *idle* (nothing else in
  flight), then
  *busy*: while 400 KB chat first turns arrive at ``--big-rate`` per second (open loop),
  every one a new conversation (nothing cached: the whole prompt tokenized).

The gateway's own handling of a 400 KB request (parse, approximate hashing, the index,
proxying the body) also delays small requests on a loaded machine: run once with
``--gateway-set index.mode=approximate`` for that reference (no precise work), and compare
the busy p99 of precise mode with it. ``--gateway-source DIR`` runs the gateway of another
tree (``git archive HEAD | tar -x -C DIR``: the code before a change) with the same bench.

Reported: p50 / p99 of (through the gateway - direct) for idle and busy, and the busy
minus idle difference (the latency the tokenization adds to a small request), plus the
number of big requests served and their mean latency.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet, wait_healthy
from loadtest.simulator.ports import free_port
from loadtest.simulator.profile import load_profile

EVENTS = '{"publisher": "zmq", "endpoint": "tcp://*:0", "topic": "kv"}'
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tiktoken.model",
                   "special_tokens_map.json")
JSON = {"content-type": "application/json"}
PRECISE_TIMEOUT_S = 60.0


def profile_file(directory: Path, name: str, page_size: int) -> Path:
    """A copy of the kimi-k2.6 profile served as ``name`` (its model folder is then this run's own)."""
    profile = dataclasses.replace(load_profile("kimi-k2.6-b200-tp8"), name=name, served_model_name=name,
                                  spec_algorithm=None, spec_num_draft_tokens=0, page_size=page_size)
    lines = []
    for field in dataclasses.fields(profile):
        value = getattr(profile, field.name)
        if value is None:
            value = ""
        lines.append(f"{field.name} = {json.dumps(value) if isinstance(value, str) else str(value).lower()}")
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _install_tokenizer(model_dir: Path, source: Path) -> None:
    for name in TOKENIZER_FILES:
        (model_dir / name).unlink(missing_ok=True)
    for path in sorted(source.iterdir()):
        if path.name in TOKENIZER_FILES or path.name.startswith("tokenization_"):
            shutil.copy(path, model_dir / path.name)


def _small(model: str) -> bytes:
    return orjson.dumps({"model": model, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]})


BodyMaker = Callable[[int, int], bytes]  # (kb, seed) -> an agent-shaped chat body (bench_hashing.make_body)


def _big(make_body: BodyMaker, model: str, kb: int, seed: int) -> bytes:
    body = orjson.loads(make_body(kb, seed))
    return orjson.dumps({**body, "model": model, "max_tokens": 1, "stream": False})


async def _timed(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> float:
    t = time.perf_counter()
    async with session.post(url, data=body, headers={**JSON, **headers}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t


async def _small_rounds(gateway: str, replica: str, body: bytes, duration_s: float) -> list[float]:
    """(through the gateway - direct) of small requests, one pair at a time, for ``duration_s``."""
    added: list[float] = []
    end = time.monotonic() + duration_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            direct = await _timed(session, replica + "/v1/chat/completions", body, {})
            through = await _timed(session, gateway + "/v1/chat/completions", body,
                                   {"x-kvgate-session": f"small-{len(added)}"})
            added.append(through - direct)
            await asyncio.sleep(0.01)
    return sorted(added)


async def _big_arrivals(bodies: list[bytes], gateway: str, rate: float, stop: asyncio.Event,
                        done: list[float]) -> None:
    """400 KB first turns at ``rate`` per second (open loop: one every 1/rate s, whatever the
    earlier ones are doing), every one a new conversation."""
    async with aiohttp.ClientSession() as session:
        sent: list[asyncio.Task[float]] = []
        n = 0
        while not stop.is_set():
            tag = b"%d " % n  # in every message: no piece of it is in any cache (a new conversation)
            body = bodies[n % len(bodies)].replace(b'"content":"', b'"content":"' + tag).replace(
                b'"text":"', b'"text":"' + tag)
            sent.append(asyncio.create_task(_timed(session, gateway + "/v1/chat/completions", body,
                                                   {"x-kvgate-session": f"big-{n}"})))
            n += 1
            await asyncio.sleep(1 / rate)
        done.extend(await asyncio.gather(*sent))


async def _run(gateway: str, replica: str, model: str, args: argparse.Namespace,
               make_body: BodyMaker) -> dict[str, Any]:
    small = _small(model)
    bodies = [_big(make_body, model, args.kb, seed) for seed in range(1, 9)]  # built before: no client CPU then
    await _small_rounds(gateway, replica, small, 1.0)  # warm-up
    idle = await _small_rounds(gateway, replica, small, args.duration_s)
    stop = asyncio.Event()
    big_done: list[float] = []
    arrivals = asyncio.create_task(_big_arrivals(bodies, gateway, args.big_rate, stop, big_done))
    await asyncio.sleep(0.5)
    busy = await _small_rounds(gateway, replica, small, args.duration_s)
    stop.set()
    await arrivals
    return {"idle": idle, "busy": busy, "big": big_done}


def _ms(values: list[float], q: float) -> float:
    return (percentile(values, q) or 0.0) * 1e3


def _start_gateway(replica: str, log_path: Path, extra: list[str],
                   source: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--replica", replica,
           "--log-level", "warning", "--set", "registry.probe_interval_s=5",
           "--set", "registry.loads_poll_interval_s=5", *extra]
    env = dict(os.environ)
    if source is not None:  # another tree's gateway (e.g. ``git archive HEAD | tar -x -C DIR``: "before")
        env["PYTHONPATH"] = source
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30.0, proc)
    return proc, url


def _precise(url: str) -> bool:
    return b'kvgate_precise_replicas{state="precise"} 1.0' in aiohttp_get(url + "/metrics")


def run_gateway_bench(args: argparse.Namespace, tokenizer_dir: str, make_body: BodyMaker) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-precise-"))
    sim_dir: Path | None = None
    name = f"bench-precise-{os.getpid()}"
    try:
        profile = profile_file(work, name, args.bench_page)
        with SimFleet(1, profile=str(profile), time_scale=1000.0, seed=5, log_dir=work,
                      extra_args=("--kv-events-config", EVENTS)) as fleet:
            replica = fleet.urls[0]
            info = orjson.loads(aiohttp_get(replica + "/server_info"))
            sim_dir = Path(info["model_path"])  # this run's own (its profile's unique name)
            _install_tokenizer(sim_dir, Path(tokenizer_dir))
            extra = [a for kv in args.gateway_set for a in ("--set", kv)]
            proc, url = _start_gateway(replica, work / "gateway.log", extra, args.gateway_source)
            try:
                deadline = time.monotonic() + PRECISE_TIMEOUT_S
                approximate = "index.mode=approximate" in args.gateway_set  # the reference: no precise work
                while not approximate and not _precise(url):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the replica never went precise: "
                                           + (work / "gateway.log").read_text()[-2000:])
                    time.sleep(0.2)
                result = asyncio.run(_run(url, replica, name, args, make_body))
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if sim_dir is not None:
            shutil.rmtree(sim_dir, ignore_errors=True)
    idle, busy, big = result["idle"], result["busy"], result["big"]
    load = os.getloadavg()
    print(f"precise through a gateway{' (source ' + args.gateway_source + ')' if args.gateway_source else ''}: "
          f"tokenizer {tokenizer_dir}; small requests for {args.duration_s:g} s idle ({len(idle)}), then for "
          f"{args.duration_s:g} s ({len(busy)}) while {args.kb} KB first turns arrive, {args.big_rate:g}/s; "
          f"gateway settings {args.gateway_set}; "
          f"page {args.bench_page}; load average {load[0]:.2f}")
    print(f"added latency (gateway - direct)  idle: p50 {_ms(idle, 50):6.2f} ms  p99 {_ms(idle, 99):6.2f} ms")
    print(f"                                  busy: p50 {_ms(busy, 50):6.2f} ms  p99 {_ms(busy, 99):6.2f} ms")
    print(f"busy - idle: p50 {_ms(busy, 50) - _ms(idle, 50):+6.2f} ms  p99 {_ms(busy, 99) - _ms(idle, 99):+6.2f} ms; "
          f"{len(big)} big requests, mean {sum(big) / max(len(big), 1) * 1e3:.0f} ms")
    return 0


def aiohttp_get(url: str) -> bytes:
    async def get() -> bytes:
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            return await r.read()

    return asyncio.run(get())
