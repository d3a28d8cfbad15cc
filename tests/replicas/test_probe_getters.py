"""The probe Getters over real HTTP on 127.0.0.1: answers, bounds, timeouts, failures, TLS."""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import orjson
import pytest
from aiohttp import web

from replicas import probe
from replicas.health import HealthEvent
from tests.support.tls import make_pki

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


async def _serve(tls: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", _handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"{'https' if tls else 'http'}://127.0.0.1:{port}"


@pytest.fixture
async def server() -> AsyncIterator[str]:
    runner, url = await _serve()
    yield url
    await runner.cleanup()


def _aiohttp() -> probe.Getter:
    return probe.AiohttpGetter()


def _httpx() -> probe.Getter:
    return probe.HttpxGetter(httpx.AsyncClient(trust_env=False))


GETTERS = pytest.mark.parametrize("make", [_aiohttp, _httpx], ids=["aiohttp", "httpx"])


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


async def test_aiohttp_sends_a_plain_get_and_keeps_its_connection(server: str) -> None:
    """A GET without a body, content-length or accept-encoding, the query and the replica
    URL's own path kept; answers read to their end leave one keep-alive connection, reused."""
    get = probe.AiohttpGetter()
    try:
        answers = [orjson.loads((await get(server + "/base/echo?include=core", 2.0))[1]) for _ in range(3)]
        first = answers[0]
        assert (first["method"], first["path"], first["query"]) == ("GET", "/base/echo", "include=core")
        for name in ("content-length", "transfer-encoding", "accept-encoding", "user-agent"):
            assert name not in first["headers"], name
        assert len({a["port"] for a in answers}) == 1
    finally:
        await get.close()


async def test_aiohttp_verifies_https_replicas_as_its_ssl_says(tmp_path: Path) -> None:
    """``ssl``: a context with the replica's CA succeeds; the system store (default) refuses
    a certificate it does not know (ProbeFailed naming it); False accepts any."""
    pki = make_pki(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki.cert_file, pki.key_file)
    runner, url = await _serve(tls)
    getters = [probe.AiohttpGetter(ssl=ssl.create_default_context(cafile=str(pki.ca_file))),
               probe.AiohttpGetter(), probe.AiohttpGetter(ssl=False)]
    try:
        trusted, system, unverified = getters
        assert await trusted(url + "/ready", 2.0) == (200, b"ok")
        with pytest.raises(probe.ProbeFailed, match="certificate"):
            await system(url + "/ready", 2.0)
        assert await unverified(url + "/ready", 2.0) == (200, b"ok")
    finally:
        for get in getters:
            await get.close()
        await runner.cleanup()
