"""HTTP calls to a replica, and parsers for what SGLang answers.

Every function takes a ``Getter`` (one GET: status and body; the connection and each read
within the probe timeout, the whole GET within ``PROBE_TOTAL_FACTOR`` of them, the body
bounded by ``MAX_PROBE_BODY_BYTES``) and never raises for an unreachable or misbehaving
replica: it returns a result the registry can act on. ``AiohttpGetter`` is the gateway's
probe client (its own aiohttp session; ``https://`` replicas verified as its ``ssl``
says, ``gateway.upstream.replica_ssl`` of the settings); ``HttpxGetter`` wraps an
``httpx.AsyncClient`` (unit tests inject an ``httpx.MockTransport`` there). Parsers are
pure and tested against bodies shaped like SGLang 0.5.23's
(``/server_info``, ``/v1/models``, ``/v1/loads``: SGLang's ``entrypoints/http_server.py``
and ``v1_loads.py``; the simulated replica serves the same shapes, compared with the
real server in ``tests/sglang_real``).

- ``probe_readiness``: ``GET /ready`` (SGLang >= 0.5.22: 200 ready, 503 starting,
  paused or SIGTERM-draining). A 404 means an older SGLang: the caller switches the
  replica to ``GET /health`` for good (200 healthy; 503 is a failure there, because
  old releases cannot tell "draining" from "broken").
- ``fetch_capacity``: ``GET /server_info`` (``/get_server_info`` on 404).
- ``fetch_loads``: ``GET /v1/loads?include=core,spec`` (SGLang splits ``include`` on
  commas and checks each section name: both are valid in 0.5.23, and ``speculative`` is
  absent while speculative decoding is off or has not run a step); None when unavailable
  (404 on old releases, errors).
- ``fetch_models``: ``GET /v1/models`` cards (the model ids routing filters on);
  ``served_cards`` falls back to ``/server_info``'s ``served_model_name`` when it fails.
- ``ProbeLog``: failing probes at WARNING, rate-limited per replica (the first failure
  of a streak, then at most once per ``registry.probe_log_interval_s``), and the
  recovery once, with how long the replica failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import ssl as ssl_
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx
import orjson

from replicas.health import HealthEvent
from replicas.model import memory_bound

log = logging.getLogger(__name__)

_DEFAULT_HICACHE_RATIO = 2.0  # SGLang's default in `cache` host-memory mode
_BUFFER_ONLY_HICACHE_RATIO = 1.2


class ReadyPath(str, enum.Enum):
    READY = "/ready"
    HEALTH = "/health"


@dataclass(frozen=True, slots=True)
class Capacity:
    """KV capacity of a whole replica (all DP ranks), in tokens."""

    device_tokens: int = 0
    host_tokens: int = 0
    page_size: int = 64
    max_running_requests: int = 0
    served_model_name: str | None = None
    version: str | None = None
    # the longest context it serves (`/v1/models` max_model_len, else /server_info's
    # context_length; 0 unknown)
    context_tokens: int = 0

    @property
    def memory_bound(self) -> bool:
        return memory_bound(self.device_tokens, self.context_tokens)


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """`/v1/loads` summed over DP ranks (token_usage: mean over ranks)."""

    running: int = 0
    waiting: int = 0
    waiting_uncached_tokens: int = 0
    token_usage: float = 0.0
    max_running_requests: int = 0
    # speculative.accept_length (accepted tokens per forward over the scheduler's life), the
    # mean over the ranks reporting it; None: no rank reports one (no speculative decoding)
    spec_accept_length: float | None = None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    event: HealthEvent  # PROBE_OK, PROBE_NOT_READY or PROBE_FAILED
    path: ReadyPath  # the path to use next time
    detail: str = ""
    timed_out: bool = False  # connected (or not) but no answer within the probe timeout


MAX_PROBE_BODY_BYTES = 4 * 1024 * 1024  # /server_info of a large replica is a few KB
PROBE_TOTAL_FACTOR = 4  # a GET may take this many probe timeouts in all (each step: one)


class ProbeTimedOut(Exception):
    """No answer within the probe's timeout."""


class ProbeFailed(Exception):
    """The GET failed: refused, reset, a malformed answer, a body over the bound."""


class Getter(Protocol):
    """One GET to a replica: (status, body); raises ``ProbeTimedOut`` / ``ProbeFailed``."""

    async def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


class HttpxGetter:
    """A ``Getter`` over an ``httpx.AsyncClient`` the caller owns (``close`` leaves it open)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with (asyncio.timeout(PROBE_TOTAL_FACTOR * timeout_s),
                        self._client.stream("GET", url, timeout=timeout_s) as r):
                return r.status_code, await bounded_body(r.aiter_bytes())
        except (httpx.TimeoutException, TimeoutError) as e:
            raise ProbeTimedOut(f"{type(e).__name__}: {e}") from e
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise ProbeFailed(f"{type(e).__name__}: {e}") from e

    async def close(self) -> None:
        pass


class AiohttpGetter:
    """The gateway's ``Getter``: its own aiohttp session (made on first use, inside the
    running loop), at most ``per_replica`` connections to one replica, no environment
    proxies, no cookies. ``ssl`` verifies ``https://`` replicas as
    aiohttp's ``ssl=`` says: ``True`` (default) the system trust store, an
    ``ssl.SSLContext`` its own CAs, ``False`` nothing (any certificate)."""

    def __init__(self, per_replica: int = 4, ssl: ssl_.SSLContext | bool = True) -> None:
        self._per_replica = per_replica
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._per_replica, keepalive_timeout=30.0,
                                             ssl=self._ssl)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar(),
                                                  skip_auto_headers=("Accept-Encoding", "User-Agent"))
        # as httpx's Timeout(t): the connection (pool wait included) and every read within
        # t; and the whole GET within PROBE_TOTAL_FACTOR x t (a replica trickling bytes)
        per_step = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        try:
            async with (asyncio.timeout(PROBE_TOTAL_FACTOR * timeout_s),
                        self._session.get(url, allow_redirects=False, timeout=per_step) as r):
                return r.status, await bounded_body(r.content.iter_any())
        except TimeoutError as e:
            raise ProbeTimedOut(f"{type(e).__name__}: no answer within {timeout_s:g} s") from e
        except (aiohttp.ClientError, ValueError) as e:
            raise ProbeFailed(f"{type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def bounded_body(chunks: AsyncIterator[bytes]) -> bytes:
    """The whole body, or ProbeFailed once it passes ``MAX_PROBE_BODY_BYTES``."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > MAX_PROBE_BODY_BYTES:
            raise ProbeFailed(f"answer over {MAX_PROBE_BODY_BYTES} bytes")
    return bytes(body)


async def probe_readiness(get: Getter, url: str, path: ReadyPath, timeout_s: float) -> ProbeResult:
    try:
        status, _ = await get(url + path.value, timeout_s)
        if status == 404 and path is ReadyPath.READY:
            path = ReadyPath.HEALTH
            status, _ = await get(url + path.value, timeout_s)
    except ProbeTimedOut as e:
        return ProbeResult(HealthEvent.PROBE_FAILED, path, str(e), timed_out=True)
    except ProbeFailed as e:
        return ProbeResult(HealthEvent.PROBE_FAILED, path, str(e))
    if status == 200:
        return ProbeResult(HealthEvent.PROBE_OK, path)
    if status == 503 and path is ReadyPath.READY:
        return ProbeResult(HealthEvent.PROBE_NOT_READY, path, "503 on /ready")
    return ProbeResult(HealthEvent.PROBE_FAILED, path, f"HTTP {status} on {path.value}")


async def _get_json(get: Getter, url: str, timeout_s: float) -> Any:
    """The JSON body of a 200, None for 404; raises ProbeTimedOut / ProbeFailed otherwise."""
    status, body = await get(url, timeout_s)
    if status == 404:
        return None
    if not 200 <= status < 300:
        raise ProbeFailed(f"HTTP {status}")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ProbeFailed(f"not JSON: {e}") from e


async def fetch_capacity(get: Getter, url: str, timeout_s: float) -> Capacity | None:
    """Capacity from /server_info; ``Capacity()`` (unknown) when the route does not exist;
    None when the replica could not be asked (retry later)."""
    try:
        body = await _get_json(get, url + "/server_info", timeout_s)
        if body is None:
            body = await _get_json(get, url + "/get_server_info", timeout_s)
    except (ProbeTimedOut, ProbeFailed) as e:
        log.debug("server_info of %s failed: %s", url, e)
        return None
    return parse_server_info(body) if isinstance(body, dict) else Capacity()


async def fetch_loads(get: Getter, url: str, timeout_s: float) -> ReportedLoad | None:
    try:
        body = await _get_json(get, url + "/v1/loads?include=core,spec", timeout_s)
    except (ProbeTimedOut, ProbeFailed) as e:
        log.debug("/v1/loads of %s failed: %s", url, e)
        return None
    return parse_loads(body) if isinstance(body, dict) else None


async def fetch_models(
    get: Getter, url: str, timeout_s: float
) -> list[dict[str, Any]] | None:
    try:
        body = await _get_json(get, url + "/v1/models", timeout_s)
    except (ProbeTimedOut, ProbeFailed) as e:
        log.debug("/v1/models of %s failed: %s", url, e)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    return (
        [card for card in data if isinstance(card, dict) and "id" in card]
        if isinstance(data, list)
        else None
    )


def served_cards(cards: list[dict[str, Any]] | None, capacity: Capacity) -> list[dict[str, Any]]:
    """The replica's model cards: its ``/v1/models`` ones; when that failed, one card named
    by ``/server_info``'s ``served_model_name`` (nothing when neither is known). Pure."""
    if cards is not None:
        return cards
    name = capacity.served_model_name
    return [{"id": name, "object": "model", "owned_by": "sglang", "root": name}] if name else []


class ProbeLog:
    """Rate-limited WARNING logs of failing probes, per replica (see the module docstring)."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._failing: dict[str, tuple[float, float, int]] = {}  # url -> (since, last logged, failures)

    def failed(self, url: str, detail: str) -> None:
        now = self._clock()
        since, logged, count = self._failing.get(url, (now, 0.0, 0))
        count += 1
        if count == 1 or now - logged >= self.interval_s:
            log.warning("probe of %s failed: %s (%d in a row, for %.0f s)", url, detail, count, now - since)
            logged = now
        self._failing[url] = (since, logged, count)

    def answered(self, url: str) -> None:
        failing = self._failing.pop(url, None)
        if failing is not None:
            since, _, count = failing
            log.info("probe of %s answers again after %d failure(s) over %.0f s", url, count,
                        self._clock() - since)

    def forget(self, url: str) -> None:
        self._failing.pop(url, None)


def _int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool) or value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dp_ranks(body: dict[str, Any], states: list[dict[str, Any]]) -> int:
    if states:
        return len(states)
    return max(1, _int(body.get("attn_dp_size")), _int(body.get("dp_size")))


def _host_tokens(
    body: dict[str, Any], device_per_rank: int, state0: dict[str, Any], ranks: int
) -> int:
    """HiCache host pool: ``hicache_size`` GB (per rank) when set, else ratio x device."""
    if not body.get("enable_hierarchical_cache"):
        return 0
    size_gb = _float(body.get("hicache_size"))
    mem = _dict(state0.get("memory_usage"))
    kv_gb, capacity = _float(mem.get("kvcache")), _int(mem.get("token_capacity"))
    if size_gb > 0 and kv_gb > 0 and capacity > 0:
        return int(size_gb / (kv_gb / capacity)) * ranks
    ratio = _float(body.get("hicache_ratio"))
    if ratio <= 0:
        buffer_only = body.get("hicache_host_memory_mode") == "buffer_only"
        ratio = _BUFFER_ONLY_HICACHE_RATIO if buffer_only else _DEFAULT_HICACHE_RATIO
    return int(ratio * device_per_rank) * ranks


def parse_server_info(body: dict[str, Any]) -> Capacity:
    """Capacity of the whole replica from a /server_info body (see the module docstring).

    ``max_total_num_tokens`` is per DP rank (rank 0): device tokens = it x DP ranks (the
    number of ``internal_states``, else ``attn_dp_size``/``dp_size``). The page size is
    the KV-event block size when published (page_size x dcp_size), else ``page_size``.
    """
    raw_states = body.get("internal_states")
    states = [s for s in raw_states if isinstance(s, dict)] if isinstance(raw_states, list) else []
    state0 = states[0] if states else {}
    ranks = _dp_ranks(body, states)
    per_rank = _int(body.get("max_total_num_tokens"))
    if per_rank <= 0:
        per_rank = _int(_dict(state0.get("memory_usage")).get("token_capacity"))
    kv_events = _dict(body.get("kv_events"))
    page_size = _int(kv_events.get("block_size")) or _int(body.get("page_size")) or 1
    max_running = _int(body.get("max_running_requests"))
    if max_running <= 0:
        max_running = sum(_int(s.get("effective_max_running_requests_per_dp")) for s in states)
    name = body.get("served_model_name")
    version = body.get("version")
    return Capacity(
        device_tokens=per_rank * ranks,
        host_tokens=_host_tokens(body, per_rank, state0, ranks),
        page_size=page_size,
        max_running_requests=max_running,
        served_model_name=name if isinstance(name, str) else None,
        version=version if isinstance(version, str) else None,
        context_tokens=_int(body.get("context_length")),
    )


def with_context(capacity: Capacity, cards: Sequence[dict[str, Any]]) -> Capacity:
    """``capacity`` with the longest ``max_model_len`` of the model cards (SGLang's effective
    context length) where they report one; else as it is. Pure."""
    longest = max((_int(card.get("max_model_len")) for card in cards), default=0)
    return dataclasses.replace(capacity, context_tokens=longest) if longest > 0 else capacity


def parse_loads(body: dict[str, Any]) -> ReportedLoad | None:
    """Sum `/v1/loads` entries over DP ranks; None when the body has no `loads` list."""
    raw = body.get("loads")
    if not isinstance(raw, list):
        return None
    ranks = [x for x in raw if isinstance(x, dict)]
    if not ranks:
        return ReportedLoad()
    accepts = [a for x in ranks if (a := _float(_dict(x.get("speculative")).get("accept_length"))) > 0
               and math.isfinite(a)]
    return ReportedLoad(
        running=sum(_int(x.get("num_running_reqs")) for x in ranks),
        waiting=sum(_int(x.get("num_waiting_reqs")) for x in ranks),
        waiting_uncached_tokens=sum(_int(x.get("num_waiting_uncached_tokens")) for x in ranks),
        token_usage=sum(_float(x.get("token_usage")) for x in ranks) / len(ranks),
        max_running_requests=sum(_int(x.get("max_running_requests")) for x in ranks),
        spec_accept_length=sum(accepts) / len(accepts) if accepts else None,
    )
