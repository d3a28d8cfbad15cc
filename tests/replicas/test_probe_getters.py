"""The probe Getters over real HTTP on 127.0.0.1: answers, bounds, timeouts, failures."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.h1_probes import H1Getter
from replicas import probe
from replicas.health import HealthEvent

BIG = probe.MAX_PROBE_BODY_BYTES + 1


async def _handler(request: web.Request) -> web.StreamResponse:
    path = request.path
    if path == "/ready":
        return web.Response(status=200, text="ok")
    if path == "/v1/loads":
        return web.json_response({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 2}]})
    if path.startswith("/slow"):
        await asyncio.sleep(1.5)
        return web.Response(text="late")
    if path == "/big":
        response = web.StreamResponse()  # chunked: no content-length to refuse it early
        await response.prepare(request)
        for _ in range(BIG // 65536 + 1):
            await response.write(b"x" * 65536)
        return response
    if path.startswith("/trickle/"):  # /trickle/<chunks>/<ms>: the head at once, then the chunks
        _, _, chunks, ms = path.split("/")
        gap_s = int(ms) / 1000
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(int(chunks)):
            await asyncio.sleep(gap_s)
            await response.write(b"x")
        return response
    if path.endswith("/echo"):  # what arrived, and from which client port
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return web.json_response({"method": request.method, "path": path, "query": request.query_string,
                                  "headers": {k.lower(): v for k, v in request.headers.items()},
                                  "port": peer[1] if peer else None})
    if path == "/broken":
        return web.Response(status=200, text="{not json", content_type="application/json")
    return web.Response(status=404)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", _handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _aiohttp() -> probe.Getter:
    return probe.AiohttpGetter()


def _httpx() -> probe.Getter:
    return probe.HttpxGetter(httpx.AsyncClient(trust_env=False))


GETTERS = pytest.mark.parametrize("make", [_aiohttp, _httpx, H1Getter], ids=["aiohttp", "httpx", "h1"])


@GETTERS
async def test_answers_and_json(server: str, make: Callable[[], probe.Getter]) -> None:
    get = make()
    try:
        assert await get(server + "/ready", 2.0) == (200, b"ok")
        assert (await get(server + "/nothing", 2.0))[0] == 404
        loads = await probe.fetch_loads(get, server, 2.0)
        assert loads is not None and (loads.running, loads.waiting) == (3, 2)
        result = await probe.probe_readiness(get, server, probe.ReadyPath.READY, 2.0)
        assert result.event is HealthEvent.PROBE_OK
        assert await probe.fetch_models(get, server, 2.0) is None  # 404
    finally:
        await get.close()


@GETTERS
async def test_bounds_and_failures(server: str, make: Callable[[], probe.Getter]) -> None:
    get = make()
    try:
        with pytest.raises(probe.ProbeFailed, match="answer over"):
            await get(server + "/big", 5.0)
        with pytest.raises(probe.ProbeTimedOut):
            await get(server + "/slow", 0.2)
        with pytest.raises(probe.ProbeFailed):
            await probe._get_json(get, server + "/broken", 2.0)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            refused = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(probe.ProbeFailed):
            await get(refused + "/ready", 2.0)
        again = await probe.probe_readiness(get, server, probe.ReadyPath.READY, 2.0)
        assert again.event is HealthEvent.PROBE_OK  # the getter still works after failures
        slow = await probe.probe_readiness(get, server + "/slow", probe.ReadyPath.READY, 0.2)
        assert slow.event is HealthEvent.PROBE_FAILED and slow.timed_out
    finally:
        await get.close()


@GETTERS
async def test_each_step_within_the_timeout_and_the_whole_within_its_multiple(
        server: str, make: Callable[[], probe.Getter]) -> None:
    """As httpx's timeout: connect and every read within t, so a body whose chunks each come
    within t passes though the whole takes longer (4 x 0.15 s > t = 0.25 s); and the whole
    GET within PROBE_TOTAL_FACTOR x t (10 x 0.1 s > 4 x 0.15 s, every gap within t)."""
    get = make()
    try:
        assert await get(server + "/trickle/4/150", 0.25) == (200, b"xxxx")
        with pytest.raises(probe.ProbeTimedOut):
            await get(server + "/trickle/10/100", 0.15)
    finally:
        await get.close()


async def test_h1_sends_a_plain_get_and_keeps_its_connection(server: str) -> None:
    """A GET without a body or content-length, the query and the replica URL's own path
    kept; answers read to their end leave one keep-alive connection, reused."""
    get = H1Getter()
    try:
        answers = [orjson.loads((await get(server + "/base/echo?include=core", 2.0))[1]) for _ in range(3)]
        first = answers[0]
        assert (first["method"], first["path"], first["query"]) == ("GET", "/base/echo", "include=core")
        assert "content-length" not in first["headers"] and "transfer-encoding" not in first["headers"]
        assert len({a["port"] for a in answers}) == 1
        assert (await get(server + "/nothing", 2.0))[0] == 404  # an error answer: its connection is closed
        assert orjson.loads((await get(server + "/echo", 2.0))[1])["port"] != first["port"]
    finally:
        await get.close()
