"""EndpointSlice discovery against a local server speaking the Kubernetes list+watch protocol.

The fake API server (starlette under uvicorn on 127.0.0.1, a free port) serves recorded
lists and watch streams: ADDED ready, MODIFIED terminating, a BOOKMARK, DELETED, an
ERROR 410 event forcing a relist, then a watch refused with HTTP 410 forcing another.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefix_index.base import ReplicaId
from replicas.discovery_k8s import ApiServer, EndpointSliceDiscovery, EndpointState, slice_endpoints
from tests.support.procs import free_port

PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


def eps(name: str, rv: int, *endpoints: tuple[str, dict[str, bool]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "resourceVersion": str(rv), "labels": {"kubernetes.io/service-name": "sglang"}},
        "ports": [{"name": "metrics", "port": 9999}, {"name": "http", "port": 30000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": cond, "targetRef": {"kind": "Pod", "name": f"pod-{ip}"}}
                      for ip, cond in endpoints],
    }


READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}
A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
LISTS = [
    (10, [eps("s1", 10, (A, READY))]),
    (20, [eps("s2", 20, (B, READY)), eps("s3", 20, (C, READY))]),
    (30, [eps("s2", 30, (B, READY)), eps("s3", 30, (C, READY))]),
]
WATCHES: dict[str, list[dict[str, Any]] | int | None] = {
    "10": [
        {"type": "ADDED", "object": eps("s2", 11, (B, READY))},
        {"type": "MODIFIED", "object": eps("s1", 12, (A, TERMINATING))},
        {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "metadata": {"resourceVersion": "13"}}},
    ],  # the stream then ends (a watch timeout): re-watch from the bookmark's version
    "13": [
        {"type": "DELETED", "object": eps("s1", 14, (A, TERMINATING))},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}},
    ],
    "20": 410,  # the watch itself is refused: relist
    "30": None,  # hold the stream open until the test ends
}


class FakeApi:
    def __init__(self) -> None:
        self.lists = 0
        self.watched: list[str] = []
        self.auth: list[str | None] = []
        self.app = Starlette(routes=[Route(PATH, self.endpoint)])

    async def endpoint(self, request: Request) -> Response:
        assert request.query_params["labelSelector"] == "kubernetes.io/service-name=sglang"
        self.auth.append(request.headers.get("authorization"))
        if request.query_params.get("watch") != "1":
            rv, items = LISTS[min(self.lists, len(LISTS) - 1)]
            self.lists += 1
            return JSONResponse({"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(rv)}, "items": items})
        assert request.query_params["allowWatchBookmarks"] == "true"
        version = request.query_params["resourceVersion"]
        self.watched.append(version)
        script = WATCHES[version]
        if isinstance(script, int):
            return JSONResponse({"kind": "Status", "code": script}, status_code=script)
        return StreamingResponse(self._stream(script), media_type="application/json")

    async def _stream(self, events: list[dict[str, Any]] | None) -> AsyncIterator[bytes]:
        for event in events or []:
            yield (json.dumps(event) + "\n").encode()
        if events is None:
            await asyncio.sleep(60)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def add(self, url: ReplicaId) -> None:
        self._record("add", url)

    async def drain(self, url: ReplicaId) -> None:
        self._record("drain", url)

    async def remove(self, url: ReplicaId) -> None:
        self._record("remove", url)

    def _record(self, op: str, url: str) -> None:
        self.calls.append((op, url))


async def test_list_watch_bookmark_gone_relist(tmp_path: Any) -> None:
    api = FakeApi()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning"))
    serve = asyncio.create_task(server.serve())
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    target = Recorder()
    expected = [("add", f"http://{A}:30000"), ("add", f"http://{B}:30000"), ("drain", f"http://{A}:30000"),
                ("remove", f"http://{A}:30000"), ("add", f"http://{C}:30000")]
    api_server = ApiServer(f"http://127.0.0.1:{port}", token, None, "llm")
    async with api_server.client(httpx.Timeout(5.0, read=120.0)) as client:
        disc = EndpointSliceDiscovery(api_server, "sglang", target, port_name="http", retry_s=0.05, client=client)
        task = asyncio.create_task(disc.run())
        try:
            async with asyncio.timeout(20):
                while api.watched[-1:] != ["30"] or len(target.calls) < len(expected):
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.should_exit = True
            await asyncio.wait_for(serve, 10)
    assert target.calls == expected
    assert api.lists == 3 and api.watched == ["10", "13", "20", "30"]
    assert set(api.auth) == {"Bearer sa-token"}


def test_slice_states_and_port_choice() -> None:
    obj = eps("s", 1, ("10.0.0.9", {"ready": False, "serving": False, "terminating": False}),
              ("10.0.0.8", {}), ("fd00::1", {"ready": False, "serving": True}))
    got = slice_endpoints(obj, "http")
    assert got == {ReplicaId("http://10.0.0.9:30000"): EndpointState.NOT_READY,
                   ReplicaId("http://10.0.0.8:30000"): EndpointState.READY,
                   ReplicaId("http://[fd00::1]:30000"): EndpointState.DRAINING}
    assert slice_endpoints(obj, "nope") == {}
    assert ReplicaId("http://10.0.0.8:9999") in slice_endpoints(obj, None)


class Forgetful(Recorder):
    """Like the Registry: drain/remove of a replica it no longer knows raise KeyError."""

    async def remove(self, url: ReplicaId) -> None:
        raise KeyError(url)


async def test_readiness_blip_is_left_to_probes_and_unknown_remove_is_fine() -> None:
    target = Forgetful()
    disc = EndpointSliceDiscovery(ApiServer("http://unused"), "sglang", target, port_name="http")
    unready = {"ready": False, "serving": False, "terminating": False}
    for version, cond in ((1, READY), (2, unready), (3, READY), (4, TERMINATING)):
        await disc._apply({"type": "MODIFIED", "object": eps("s1", version, (A, cond))}, str(version))
    await disc._apply({"type": "DELETED", "object": eps("s1", 5, (A, TERMINATING))}, "5")
    url = f"http://{A}:30000"
    assert target.calls == [("add", url), ("drain", url)]
    with pytest.raises(ValueError):
        await disc._apply({"type": "ERROR", "object": {"code": 500, "message": "boom"}}, "3")


def test_in_cluster_config(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import replicas.discovery_k8s as k8s

    (tmp_path / "namespace").write_text("llm\n")
    monkeypatch.setattr(k8s, "SA_DIR", tmp_path)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError):
        ApiServer.in_cluster()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    api = ApiServer.in_cluster()
    assert (api.url, api.namespace, api.token_path) == ("https://[fd00::1]:6443", "llm", tmp_path / "token")
    assert ApiServer.in_cluster("other").namespace == "other"
