"""Load drivers: closed-loop sessions and open-loop replay against an OpenAI-compatible URL.

One asyncio loop, one shared ``httpx.AsyncClient``. Every request streams, with the
trace's output tokens as its limit and ``ignore_eos`` (SGLang extension) so output
lengths are exact, and the session's headers (Claude Code: ``x-claude-code-session-id``;
subagents add ``x-claude-code-agent-id`` / ``x-claude-code-parent-agent-id``). The API
(``DriverConfig.api``, ``API_CHOICES``):

- ``chat``: ``/v1/chat/completions``, ``messages``, ``max_tokens``,
  ``stream_options.include_usage``;
- ``messages``: Anthropic ``/v1/messages``, the system message as top-level ``system``,
  the rest as ``messages``, ``max_tokens``;
- ``responses``: OpenAI ``/v1/responses``, the system message as ``instructions``, the
  rest as ``input`` message items, ``max_output_tokens``. With ``responses_chain``, a
  session's turn after the first sends only the messages beyond those its previous turn
  sent, with that turn's ``previous_response_id`` (the replica then prepends its stored
  conversation: an approximation of the trace, whose last message grows in place).

- Closed loop: a session sends turn ``i`` ``think_time`` after the response to turn
  ``i-1`` ended and after the subagents that turn started have finished. Sessions run
  ``sessions_concurrent`` at a time (the next session starts when one ends), or arrive as
  a Poisson process of ``session_rate`` per second (optionally capped in concurrency).
- Open loop: every turn is sent at its recorded ``arrival_s``.

Time: think times are multiplied by ``think_scale`` (and capped at ``max_think_s``), then
every wait is divided by ``time_scale``; recorded durations are multiplied back by
``time_scale`` (target seconds). Bounds: ``max_requests`` and ``duration_s`` (wall); at
the deadline no new request starts and in-flight ones get ``grace_s`` to finish.

The SSE stream is parsed cheaply by ``loadtest.sse.StreamParser``.
"""
from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from loadtest.prompts import API_PATHS, PromptRenderer, PromptSpec, request_body
from loadtest.results import RequestRecord
from loadtest.sse import StreamParser, build_record
from loadtest.workload import Session, Turn, Workload


class RemoteTargetError(ValueError):
    """The target is not on this machine and --allow-remote was not given."""


def check_target(url: str, allow_remote: bool = False) -> str:
    """The target base URL (no trailing ``/`` or ``/v1``); refuses non-loopback hosts."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"target must be an http(s) URL, got {url!r}")
    if not allow_remote and not _is_loopback(host):
        raise RemoteTargetError(f"refusing non-loopback target {host!r} (use --allow-remote)")
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DriverConfig:
    target: str
    model: str | None = None  # None: the first id of GET /v1/models
    sessions_concurrent: int | None = 16
    session_rate: float | None = None  # sessions per target second (Poisson)
    time_scale: float = 1.0
    think_scale: float = 1.0
    max_think_s: float | None = None  # cap on one think time (target seconds)
    ramp_s: float = 0.0  # closed loop: first sessions start uniformly over this (target s)
    max_requests: int | None = None
    duration_s: float | None = None  # wall seconds
    grace_s: float = 30.0
    request_timeout_s: float = 600.0
    max_inflight: int = 4096
    keep_itl: bool = False
    allow_remote: bool = False
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    api: str = "chat"  # the API the requests speak: one of API_CHOICES
    responses_chain: bool = False  # api "responses": chain turns with previous_response_id


API_CHOICES = tuple(API_PATHS)  # chat, messages, responses (loadtest.prompts.request_body)



@dataclass
class _Counters:
    sent: int = 0
    inflight: int = 0
    max_inflight: int = 0


RecordCallback = Callable[[RequestRecord], None]


class Driver:
    def __init__(self, config: DriverConfig, client: httpx.AsyncClient,
                 on_record: RecordCallback | None = None) -> None:
        self.cfg = config
        self.base = check_target(config.target, config.allow_remote)
        self.client = client
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.renderer = PromptRenderer()
        self.rng = random.Random(config.seed)
        self.counters = _Counters()
        self.model = config.model or ""
        self._t0 = 0.0
        self._deadline = float("inf")
        self._gate = asyncio.Semaphore(config.max_inflight)
        self._chains: dict[str, tuple[str, int]] = {}  # session -> (last response id, messages it sent)

    # ---- timing ---------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic()

    def _stopped(self) -> bool:
        c = self.cfg
        return self._now() >= self._deadline or (c.max_requests is not None and self.counters.sent >= c.max_requests)

    async def _sleep_until(self, wall: float) -> None:
        delay = min(wall, self._deadline) - self._now()
        if delay > 0:
            await asyncio.sleep(delay)

    def _think_wall(self, think_s: float) -> float:
        s = think_s * self.cfg.think_scale
        if self.cfg.max_think_s is not None:
            s = min(s, self.cfg.max_think_s)
        return s / self.cfg.time_scale

    # ---- run ------------------------------------------------------------------------
    async def run(self, workload: Workload) -> list[RequestRecord]:
        if not self.model:
            self.model = await self._discover_model()
        self._t0 = self._now()
        if self.cfg.duration_s is not None:
            self._deadline = self._t0 + self.cfg.duration_s
        if workload.open_loop:
            await self._open_loop(workload)
        elif self.cfg.session_rate:
            await self._session_arrivals(workload)
        else:
            await self._closed_pool(workload)
        return self.records

    async def _discover_model(self) -> str:
        try:
            r = await self.client.get(f"{self.base}/v1/models", timeout=10.0)
            data = r.json().get("data") or []
            return str(data[0]["id"]) if data else "default"
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return "default"

    async def _closed_pool(self, workload: Workload) -> None:
        sessions = iter(workload.sessions)
        n = max(1, self.cfg.sessions_concurrent or 1)
        ramp = self.cfg.ramp_s / self.cfg.time_scale

        async def worker(k: int) -> None:
            await self._sleep_until(self._t0 + (ramp * k / n))
            for s in sessions:
                if self._stopped():
                    return
                await self._session(s)

        await self._bounded(asyncio.gather(*(worker(k) for k in range(n))))

    async def _session_arrivals(self, workload: Workload) -> None:
        rate = float(self.cfg.session_rate or 1.0) / self.cfg.time_scale
        cap = asyncio.Semaphore(self.cfg.sessions_concurrent or 1 << 30)
        tasks: list[asyncio.Task[None]] = []

        async def one(s: Session) -> None:
            async with cap:
                await self._session(s)

        async def spawn() -> None:
            t = self._t0
            for s in workload.sessions:
                if self._stopped():
                    break
                tasks.append(asyncio.create_task(one(s)))
                t += self.rng.expovariate(rate)
                await self._sleep_until(t)
            await asyncio.gather(*tasks)

        await self._bounded(spawn(), tasks)

    async def _open_loop(self, workload: Workload) -> None:
        tasks: list[asyncio.Task[None]] = []

        async def spawn() -> None:
            for arrival, session, i, turn, ids in _arrivals(workload):
                await self._sleep_until(self._t0 + arrival / self.cfg.time_scale)
                if self._stopped():
                    break
                spec = PromptSpec(session.namespace, session.id, session.block_size, session.system_blocks)
                messages = self.renderer.messages(spec, ids, turn.in_tokens, i)
                self.counters.sent += 1
                tasks.append(asyncio.create_task(self._request(session, i, turn, messages)))
            await asyncio.gather(*tasks)

        await self._bounded(spawn(), tasks)

    async def _bounded(self, main: Any, tasks: list[asyncio.Task[None]] | None = None) -> None:
        """Run ``main``; past the deadline, give in-flight work ``grace_s`` then cancel."""
        job = asyncio.ensure_future(main)
        if self._deadline == float("inf"):
            await job
            return
        await asyncio.wait([job], timeout=max(0.0, self._deadline - self._now()) + self.cfg.grace_s)
        if not job.done():
            job.cancel()
            for t in tasks or ():
                t.cancel()
            await asyncio.gather(job, *(tasks or ()), return_exceptions=True)

    async def _session(self, session: Session) -> None:
        spec = PromptSpec(session.namespace, session.id, session.block_size, session.system_blocks)
        subs: list[asyncio.Task[None]] = []
        ready = self._now() + (self._think_wall(session.start_delay_s) if session.parent else 0.0)
        try:
            for i, (turn, ids) in enumerate(zip(session.turns, session.hash_id_lists())):
                if i > 0:
                    ready += self._think_wall(turn.think_time_s)
                await self._sleep_until(ready)
                if subs:
                    await asyncio.gather(*subs)
                    subs = []
                if self._stopped():
                    break
                self.counters.sent += 1
                await self._request(session, i, turn, self.renderer.messages(spec, ids, turn.in_tokens, i))
                ready = self._now()
                subs = [asyncio.create_task(self._session(s)) for s in turn.subagents]
            await asyncio.gather(*subs)
        finally:
            for t in subs:
                t.cancel()

    # ---- one request ----------------------------------------------------------------
    async def _request(self, session: Session, i: int, turn: Turn, messages: list[dict[str, str]]) -> None:
        previous, n_messages = None, len(messages)
        chained = self.cfg.api == "responses" and self.cfg.responses_chain
        if chained and i > 0 and (last := self._chains.get(session.id)) is not None:
            previous, sent = last
            messages = [m for m in messages if m["role"] == "system"] + messages[max(sent, 1):]
            if len(messages) == 1 or messages[-1]["role"] != "user":
                messages.append({"role": "user", "content": "Continue."})
        body = request_body(self.cfg.api, self.model, messages, turn.out_tokens, self.cfg.extra_body, previous)
        headers = {"content-type": "application/json", **session.headers}
        async with self._gate:
            c = self.counters
            c.inflight += 1
            c.max_inflight = max(c.max_inflight, c.inflight)
            try:
                rec = await self._stream(session, i, turn, orjson.dumps(body), headers, n_messages)
            finally:
                c.inflight -= 1
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)

    async def _stream(self, session: Session, i: int, turn: Turn, payload: bytes,
                      headers: dict[str, str], n_messages: int = 0) -> RequestRecord:
        scale = self.cfg.time_scale
        t_send = self._now()
        base: dict[str, Any] = {"session": session.id, "turn": i, "t_start_s": (t_send - self._t0) * scale,
                                "trace_in_tokens": turn.in_tokens, "trace_out_tokens": turn.out_tokens,
                                "agent": session.parent is not None}
        parser = StreamParser(self.cfg.api)
        try:
            req = self.client.build_request("POST", self.base + API_PATHS[self.cfg.api],
                                            content=payload, headers=headers)
            resp = await self.client.send(req, stream=True)
            try:
                replica = resp.headers.get("x-kvgate-replica")
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode(errors="replace")
                    return RequestRecord(**base, status=resp.status_code, replica=replica,
                                         e2e_s=(self._now() - t_send) * scale,
                                         rejected=resp.status_code in (429, 503), error=text)
                async for chunk in resp.aiter_raw():
                    parser.feed(chunk, self._now())
            finally:
                await resp.aclose()
        except httpx.HTTPError as e:
            return RequestRecord(**base, status=0, e2e_s=(self._now() - t_send) * scale,
                                 error=f"{type(e).__name__}: {e}"[:300])
        if parser.response_id is not None:
            self._chains[session.id] = (parser.response_id, n_messages)
        return build_record(base, parser, t_send, self._now(), scale, replica, self.cfg.keep_itl)


def _arrivals(workload: Workload) -> Iterator[tuple[float, Session, int, Turn, list[int]]]:
    """Every turn of an open-loop workload, in arrival order (hash id lists copied)."""
    items = [(turn.arrival_s, s, i, turn, list(ids)) for s in workload.sessions
             for i, (turn, ids) in enumerate(zip(s.turns, s.hash_id_lists()))]
    items.sort(key=lambda x: x[0])
    return iter(items)


def make_client(connections: int = 1024, request_timeout_s: float = 600.0) -> httpx.AsyncClient:
    """The one shared client: enough connections for every in-flight stream."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def drive(workload: Workload, config: DriverConfig,
                on_record: RecordCallback | None = None) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Run a workload; returns the records and driver stats (CPU, reached concurrency)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    conns = max(64, 2 * (config.sessions_concurrent or 0), 256 if workload.open_loop else 0)
    async with make_client(conns, config.request_timeout_s) as client:
        driver = Driver(config, client, on_record)
        records = await driver.run(workload)
    wall = time.monotonic() - wall0
    stats = {"wall_s": wall, "driver_cpu_s": time.process_time() - cpu0,
             "driver_cpu_frac": (time.process_time() - cpu0) / wall if wall > 0 else 0.0,
             "max_inflight": driver.counters.max_inflight, "sent": driver.counters.sent,
             "model": driver.model}
    return records, stats
