"""What the proxy relays back: usage parsing, the SSE error event, the stream response.

- ``usage_of``: (prompt, cached, completion) tokens from a parsed OpenAI ``usage`` or a
  ``/generate`` ``meta_info``; ``usage_of_body`` finds it in a buffered JSON body by
  parsing only from the ``"usage"`` key on when it is near the end (the OpenAI and SGLang
  bodies put it last), else the whole body.
- ``UsageSniffer``: keeps the last complete SSE line mentioning ``"usage"`` while a stream
  is relayed, parses it once at the end.
- ``sse_error``: the event sent when a stream breaks after the first byte.
- headers: ``upstream_headers`` (the client's, cleaned: hop-by-hop, ``Expect``,
  ``x-kvgate-*``, credentials; ``X-Forwarded-*`` added), ``downstream_headers`` (the
  replica's, cleaned), the routing headers; ``json_response`` / ``error_response`` (OpenAI-shaped errors).
- ``RelayResponse``: a StreamingResponse whose cleanup always runs (end, error, client
  disconnect), shielded from cancellation.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import anyio
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamError, error_body
from gateway.upstream_config import UpstreamConfig

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
})
# response headers the gateway's own server sets
NOT_RELAYED = HOP_BY_HOP | {b"date", b"server"}
_OWN_PREFIX = b"x-kvgate-"  # the gateway's own headers: never taken from a client or a replica


@dataclass(frozen=True, slots=True)
class HeaderPolicy:
    """What ``upstream_headers`` does with credentials (``upstream.forward_authorization``,
    ``upstream.replica_api_key``)."""

    forward_authorization: bool = False
    replica_authorization: bytes | None = None  # b"Bearer <key>", sent to every replica

    @classmethod
    def from_config(cls, config: UpstreamConfig) -> HeaderPolicy:
        key = config.replica_api_key
        return cls(config.forward_authorization,
                   None if key is None else b"Bearer " + key.get_secret_value().encode("latin-1"))


def _connection_named(raw: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in ``Connection:`` (hop-by-hop by declaration, RFC 9110 7.6.1)."""
    named = [t.strip().lower() for k, v in raw if k.lower() == b"connection" for t in v.split(b",")]
    return frozenset(n for n in named if n)


def _drop(name: bytes, named: frozenset[bytes]) -> bool:
    return name in HOP_BY_HOP or name in named or name.startswith((b"proxy-", _OWN_PREFIX))


def upstream_headers(raw: list[tuple[bytes, bytes]], policy: HeaderPolicy = HeaderPolicy(),
                     client: str | None = None, scheme: str = "http") -> list[tuple[bytes, bytes]]:
    """The client's headers as sent to the replica.

    Dropped: hop-by-hop headers (``HOP_BY_HOP``, every ``proxy-*``, every header named in
    the client's ``Connection:``), ``Expect`` (the gateway has read the whole body already;
    a replica's ``100 Continue`` must not be awaited), the client's ``x-kvgate-*``, and the
    client's ``Authorization`` unless ``policy.forward_authorization`` (a configured
    replica key replaces it). ``client`` is appended to ``X-Forwarded-For``;
    ``X-Forwarded-Proto`` / ``X-Forwarded-Host`` are set when the client sent none."""
    named = _connection_named(raw)
    keep_auth = policy.forward_authorization and policy.replica_authorization is None
    out: list[tuple[bytes, bytes]] = []
    forwarded_for: list[bytes] = []
    host = b""
    proto = fhost = False
    for k, v in raw:
        name = k.lower()
        if name == b"host":
            host = v
        if _drop(name, named) or (name == b"authorization" and not keep_auth):
            continue
        if name == b"x-forwarded-for":
            forwarded_for.append(v)
            continue
        proto = proto or name == b"x-forwarded-proto"
        fhost = fhost or name == b"x-forwarded-host"
        out.append((k, v))
    if client:
        forwarded_for.append(client.encode("latin-1"))
    if forwarded_for:
        out.append((b"x-forwarded-for", b", ".join(forwarded_for)))
    if not proto:
        out.append((b"x-forwarded-proto", scheme.encode("latin-1")))
    if host and not fhost:
        out.append((b"x-forwarded-host", host))
    if policy.replica_authorization is not None:
        out.append((b"authorization", policy.replica_authorization))
    return out


def downstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The replica's response headers as relayed: hop-by-hop ones (also those its
    ``Connection:`` names), ``date``/``server`` (the gateway's server sets them) and any
    ``x-kvgate-*`` dropped."""
    named = _connection_named(raw)
    return [(k, v) for k, v in raw if not _drop(k.lower(), named) and k.lower() not in NOT_RELAYED]


def route_headers(replica: str, reason: str) -> dict[str, str]:
    return {"x-kvgate-replica": replica, "x-kvgate-route-reason": reason}


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


def error_response(error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """The OpenAI-shaped JSON body of a gateway error, with the routing headers."""
    return Response(orjson.dumps(error.body()), status_code=error.status,
                    headers=headers or route_headers("none", "none"), media_type="application/json")


Usage = tuple[int | None, int | None, int | None]  # prompt, cached, completion tokens


def usage_of(document: object) -> Usage:
    """(prompt, cached, completion) tokens from an OpenAI ``usage`` or a /generate ``meta_info``."""
    if not isinstance(document, dict):
        return None, None, None
    usage = document.get("usage") or document.get("meta_info")
    if not isinstance(usage, dict):
        return None, None, None
    cached = usage.get("cached_tokens")  # /generate meta_info
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens", cached)
    return _count(usage.get("prompt_tokens")), _count(cached), _count(usage.get("completion_tokens"))


def _count(value: object) -> int | None:
    """A token count as reported, or None when absent or not a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class UsageSniffer:
    """Keeps the last complete SSE line mentioning ``"usage"``; parses it once at the end."""

    __slots__ = ("carry", "last_line")
    MAX_CARRY = 4 * 1024 * 1024

    def __init__(self) -> None:
        self.carry = b""
        self.last_line = b""

    def feed(self, chunk: bytes) -> None:
        data = self.carry + chunk if self.carry else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self.carry = data if len(data) <= self.MAX_CARRY else b""
            return
        self.carry = data[end + 1:]
        hit = data.rfind(b'"usage"', 0, end)
        if hit >= 0:
            self.last_line = data[data.rfind(b"\n", 0, hit) + 1: data.find(b"\n", hit)]

    def usage(self) -> Usage:
        line = self.last_line.strip()
        if not line.startswith(b"data:"):
            return None, None, None
        try:
            return usage_of(orjson.loads(line[5:]))
        except orjson.JSONDecodeError:
            return None, None, None


def sse_error(message: str, type_: str = UpstreamError.type, code: str | int = 502) -> bytes:
    """The event that ends a stream the gateway cannot finish (``[DONE]`` after it)."""
    return b"data: " + orjson.dumps(error_body(message, type_, code)) + b"\n\ndata: [DONE]\n\n"


class RelayResponse(StreamingResponse):
    """A StreamingResponse whose cleanup always runs (end, error, client disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int,
                 headers: Mapping[str, str] | list[tuple[bytes, bytes]],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        """``headers``: a mapping, or raw (name, value) pairs relayed as they are."""
        if isinstance(headers, list):
            super().__init__(content, status_code=status_code)
            self.raw_headers = headers
        else:
            super().__init__(content, status_code=status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


TAIL_PARSE_MIN_BYTES = 4096  # smaller bodies are parsed whole


def usage_of_body(body: bytes) -> Usage:
    """Usage of a buffered JSON response, parsing only its tail when that suffices.

    ``{"id": ..., "choices": [...], "usage": {...}}``: the text from the last top-level
    ``"usage"`` (or ``"meta_info"``) key to the end, wrapped as ``{...``, is itself a JSON
    object when that key belongs to the outer object (orjson rejects anything else, e.g.
    a key nested deeper, which leaves trailing text); otherwise the whole body is parsed."""
    if len(body) >= TAIL_PARSE_MIN_BYTES:
        for key in (b'"usage"', b'"meta_info"'):
            at = body.rfind(key)
            if at > 0:
                try:
                    return usage_of(orjson.loads(b"{" + body[at:]))
                except orjson.JSONDecodeError:
                    break
    try:
        return usage_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None, None, None  # not JSON: relayed as is, without usage feedback
