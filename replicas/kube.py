"""The Kubernetes API calls kvgate makes, on kubernetes-asyncio (a maintained client).

Four calls, used by EndpointSlice discovery (``replicas.discovery_k8s``) and the
pod-deletion-cost annotator of scale-in (``replicas.scale``): list and watch the
EndpointSlices of a Service, list pods by label, patch a pod's annotations. The
rest of the package sees plain JSON dicts (the API's own field names) and two errors,
:class:`KubeError` and :class:`Gone`. Why this client and not lightkube or plain httpx:
replicas/README.md, "Kubernetes client".

Where the API server is (:class:`ApiServer`):

- **in a pod** (``KUBERNETES_SERVICE_HOST`` set): the service account, as client-go does:
  ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, the cluster CA
  (``ca.crt``), the projected token (the kubelet rotates it; the client re-reads it every
  minute), the pod's namespace (``namespace`` file) unless one is configured;
- **elsewhere**: a kubeconfig (``$KUBECONFIG``'s first file, else ``~/.kube/config``), its
  current context (or ``context``), the context's namespace unless one is configured.

The library takes ~0.3 s to import: it is imported when a client is made, so a gateway
that neither discovers replicas through Kubernetes nor annotates pods never loads it.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CALL_TIMEOUT_S = 10.0  # a list or a patch (a watch waits up to its own timeout + 30 s)


class KubeError(Exception):
    """A call to the API server failed (an HTTP status, a connection or TLS error, a timeout)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Gone(KubeError):
    """The watch's resourceVersion is too old (HTTP 410 or an ERROR event with code 410): relist."""


@dataclass(frozen=True)
class KubeClient:
    """A connected client and the namespace its calls address. ``aclose()`` when done."""

    api: ApiClient
    namespace: str

    async def aclose(self) -> None:
        await self.api.close()


@dataclass(frozen=True)
class ApiServer:
    """How to reach the API server (module doc); :meth:`connect` makes the client."""

    kubeconfig: Path | None = None  # None: in cluster (the pod's service account)
    context: str | None = None  # kubeconfig only; None: its current context
    namespace: str | None = None  # None: the pod's, else the context's, else "default"

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> ApiServer:
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise RuntimeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset)")
        return cls(namespace=namespace)

    @classmethod
    def from_environment(cls, namespace: str | None = None, *, context: str | None = None) -> ApiServer:
        """In a pod: the service account; else the kubeconfig (``$KUBECONFIG``, ``~/.kube/config``)."""
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls(namespace=namespace)
        paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        path = Path(paths[0]) if paths else Path.home() / ".kube" / "config"
        if not path.is_file():
            raise RuntimeError(f"not in a Kubernetes pod and no kubeconfig at {path}")
        return cls(kubeconfig=path, context=context, namespace=namespace)

    async def connect(self) -> KubeClient:
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        if self.kubeconfig is None:
            config.load_incluster_config(  # type: ignore[no-untyped-call]  # untyped in the library
                client_configuration=configuration, token_filename=str(SA_DIR / "token"),
                cert_filename=str(SA_DIR / "ca.crt"))
            ns_file = SA_DIR / "namespace"
            namespace = self.namespace or (ns_file.read_text().strip() if ns_file.is_file() else "default")
        else:
            await config.load_kube_config(
                config_file=str(self.kubeconfig), context=self.context,
                client_configuration=configuration, persist_config=False)
            namespace = self.namespace or _context_namespace(self.kubeconfig, self.context)
        return KubeClient(client.ApiClient(configuration), namespace)


def _context_namespace(path: Path, context: str | None) -> str:
    """The namespace of the kubeconfig's ``context`` (its current one when None), else "default"."""
    from kubernetes_asyncio import config

    contexts, current = config.list_kube_config_contexts(str(path))
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


def _error(exc: BaseException) -> KubeError:
    """The library's exception as ours (410 -> :class:`Gone`)."""
    status = getattr(exc, "status", None)
    status = status if isinstance(status, int) else None
    kind = Gone if status == 410 else KubeError
    reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    return kind(f"{type(exc).__name__}: {reason}".strip(), status)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: Mapping[str, Any]  # the API's JSON (a BOOKMARK carries only metadata.resourceVersion)
    resource_version: str  # where to resume a watch after this event


async def list_endpoint_slices(kube: KubeClient, selector: str) -> tuple[str, list[dict[str, Any]]]:
    """(the list's resourceVersion, the EndpointSlices matching ``selector``, as JSON)."""
    from kubernetes_asyncio.client import DiscoveryV1Api

    return await _list(kube, DiscoveryV1Api(kube.api).list_namespaced_endpoint_slice, selector)


async def _list(kube: KubeClient, call: Any, selector: str) -> tuple[str, list[dict[str, Any]]]:
    """One ``list_namespaced_*`` call: (its resourceVersion, its items as JSON)."""
    from kubernetes_asyncio.client import ApiException

    try:
        result = await call(kube.namespace, label_selector=selector, _request_timeout=CALL_TIMEOUT_S)
    except (ApiException, aiohttp.ClientError, TimeoutError) as e:
        raise _error(e) from e
    items = [kube.api.sanitize_for_serialization(item) for item in result.items or []]
    return str(result.metadata.resource_version), items


async def watch_endpoint_slices(kube: KubeClient, selector: str, version: str,
                                timeout_s: int) -> AsyncIterator[WatchEvent]:
    """One watch request from ``version`` with bookmarks; ends when the server closes it
    (after ``timeout_s``). Raises :class:`Gone` (relist) or :class:`KubeError`."""
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client import ApiException, DiscoveryV1Api

    api = DiscoveryV1Api(kube.api)
    timeout = aiohttp.ClientTimeout(sock_connect=CALL_TIMEOUT_S, sock_read=timeout_s + 30.0)
    async with watch.Watch() as w:
        # timeout_seconds set: the library neither retries a 410 nor reconnects by itself
        stream = w.stream(api.list_namespaced_endpoint_slice, kube.namespace, label_selector=selector,
                          resource_version=version, allow_watch_bookmarks=True,
                          timeout_seconds=timeout_s, _request_timeout=timeout)
        try:
            async for event in stream:
                version = str(w.resource_version or version)
                yield WatchEvent(str(event["type"]), event["raw_object"], version)
        except (ApiException, aiohttp.ClientError, TimeoutError) as e:
            raise _error(e) from e


async def list_pods(kube: KubeClient, selector: str) -> list[dict[str, Any]]:
    """The pods matching ``selector``, as JSON."""
    from kubernetes_asyncio.client import CoreV1Api

    return (await _list(kube, CoreV1Api(kube.api).list_namespaced_pod, selector))[1]


async def annotate_pod(kube: KubeClient, name: str, annotations: Mapping[str, str]) -> None:
    """Patch ``annotations`` onto pod ``name``: a strategic merge patch (the client's default
    for a dict body, as ``kubectl patch``), so other annotations stay."""
    from kubernetes_asyncio.client import ApiException, CoreV1Api

    api = CoreV1Api(kube.api)
    body = {"metadata": {"annotations": dict(annotations)}}
    try:
        await api.patch_namespaced_pod(
            name, kube.namespace, body, _request_timeout=CALL_TIMEOUT_S)
    except (ApiException, aiohttp.ClientError, TimeoutError) as e:
        raise _error(e) from e
