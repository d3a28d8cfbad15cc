"""A local Kubernetes API server for the discovery and scale-in tests: real HTTPS on 127.0.0.1.

Starlette under uvicorn on a free port, with a certificate issued for 127.0.0.1 by a test CA
(made with the ``openssl`` command), so the client is tested as it runs in a pod: the
service account's CA, token and namespace files (:func:`service_account`), or a kubeconfig
(:func:`kubeconfig`). It serves scripted EndpointSlice lists and watch streams (filtered by
the request's equality-based label selector, as the API server does), pod lists and pod
patches, and records what it was asked.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.procs import free_port

Doc = dict[str, Any]
Script = list[Doc] | int | None  # events then end / an HTTP status / hold the stream open


@dataclass(frozen=True)
class Tls:
    ca: Path
    cert: Path
    key: Path


def make_tls(folder: Path, name: str = "test") -> Tls:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl, EC P-256)."""
    ca, ca_key = folder / f"{name}-ca.crt", folder / f"{name}-ca.key"
    cert, key, csr = folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}.csr"
    ext = folder / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", f"/CN={name}-ca",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
    return Tls(ca, cert, key)


def service_account(folder: Path, tls: Tls, port: int, monkeypatch: pytest.MonkeyPatch,
                    token: str = "sa-token", namespace: str = "llm") -> Path:
    """A pod's view: token, ca.crt and namespace files, KUBERNETES_SERVICE_HOST/PORT."""
    from replicas import kube

    sa = folder / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)  # as the kubelet writes it: no newline
    (sa / "ca.crt").write_bytes(tls.ca.read_bytes())
    (sa / "namespace").write_text(namespace + "\n")
    monkeypatch.setattr(kube, "SA_DIR", sa)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    return sa


def kubeconfig(folder: Path, tls: Tls, port: int, token: str, namespace: str) -> Path:
    """A kubeconfig whose current context reaches the fake server (token, CA file, namespace)."""
    path = folder / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "certificate-authority": str(tls.ca)}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "other", "context": {"cluster": "c", "user": "u", "namespace": "elsewhere"}},
                     {"name": "test", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
    }))
    return path


def endpoint_slice(name: str, rv: int, *endpoints: tuple[str, dict[str, bool]], service: str = "sglang",
                   labels: dict[str, str] | None = None) -> Doc:
    """A slice of ``service`` with its labels (those the controller copies from the Service)."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "resourceVersion": str(rv),
                     "labels": {"kubernetes.io/service-name": service} | (labels or {})},
        "ports": [{"name": "metrics", "port": 9999}, {"name": "http", "port": 30000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": cond, "targetRef": {"kind": "Pod", "name": f"pod-{ip}"}}
                      for ip, cond in endpoints],
    }


def selects(selector: str, obj: Doc) -> bool:
    """Whether an equality-based label selector (``k=v,k2=v2``, ``k`` = has the key) matches."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True


@dataclass
class FakeApi:
    """Namespace ``llm``: EndpointSlice list/watch (scripted), pods (list, merge-patch)."""

    lists: list[tuple[int, list[Doc]]] = field(default_factory=list)  # the n-th list answers lists[n]
    watches: dict[str, Script] = field(default_factory=dict)  # resourceVersion -> script
    pods: list[Doc] = field(default_factory=list)
    namespace: str = "llm"
    listed: int = 0
    watched: list[str] = field(default_factory=list)
    auth: set[str | None] = field(default_factory=set)
    patches: list[tuple[str, str, Doc]] = field(default_factory=list)  # (pod, content type, body)
    slice_selectors: set[str] = field(default_factory=set)  # the label selectors slices were asked by

    def app(self) -> Starlette:
        ns = self.namespace
        return Starlette(routes=[
            Route(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self.endpoint_slices),
            Route(f"/api/v1/namespaces/{ns}/pods", self.pod_list),
            Route(f"/api/v1/namespaces/{ns}/pods/{{name}}", self.pod_patch, methods=["PATCH"]),
        ])

    async def endpoint_slices(self, request: Request) -> Response:
        selector = request.query_params["labelSelector"]
        self.slice_selectors.add(selector)
        self.auth.add(request.headers.get("authorization"))
        if request.query_params.get("watch") not in ("true", "True", "1"):
            rv, items = self.lists[min(self.listed, len(self.lists) - 1)]
            self.listed += 1
            return JSONResponse({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                 "metadata": {"resourceVersion": str(rv)},
                                 "items": [i for i in items if selects(selector, i)]})
        assert request.query_params["allowWatchBookmarks"] in ("true", "True")
        assert "timeoutSeconds" in request.query_params
        version = request.query_params["resourceVersion"]
        self.watched.append(version)
        script = self.watches[version]
        if isinstance(script, int):
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": script,
                                 "reason": "Expired", "message": "too old resource version"},
                                status_code=script)
        return StreamingResponse(self._stream(script, selector), media_type="application/json")

    async def _stream(self, events: list[Doc] | None, selector: str) -> AsyncIterator[bytes]:
        for event in events or []:
            if event["type"] in ("ADDED", "MODIFIED", "DELETED") and not selects(selector, event["object"]):
                continue  # the API server sends only the objects the selector matches
            yield (json.dumps(event) + "\n").encode()
        if events is None:
            await asyncio.sleep(60)

    async def pod_list(self, request: Request) -> Response:
        self.auth.add(request.headers.get("authorization"))
        assert request.query_params["labelSelector"] == "app.kubernetes.io/name=sglang"
        return JSONResponse({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
                             "items": self.pods})

    async def pod_patch(self, request: Request) -> Response:
        self.auth.add(request.headers.get("authorization"))
        name = request.path_params["name"]
        body = json.loads(await request.body())
        self.patches.append((name, request.headers.get("content-type", ""), body))
        pod = next(p for p in self.pods if p["metadata"]["name"] == name)
        pod["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
        return JSONResponse(pod)


class Served:
    """``async with Served(api, tls) as port``: the fake API server on 127.0.0.1 over HTTPS."""

    def __init__(self, api: FakeApi, tls: Tls, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server = uvicorn.Server(uvicorn.Config(
            api.app(), host="127.0.0.1", port=self.port, log_level="warning",
            ssl_certfile=str(tls.cert), ssl_keyfile=str(tls.key)))
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> int:
        self._task = asyncio.create_task(self._server.serve())
        async with asyncio.timeout(20):
            while not self._server.started:
                await asyncio.sleep(0.02)
        return self.port

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)
