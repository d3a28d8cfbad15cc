"""What the proxy relays back: usage parsing, the SSE error event, the stream response.

- ``usage_of``: (prompt, cached, completion) tokens from a parsed OpenAI ``usage`` or a
  ``/generate`` ``meta_info``; ``usage_of_body`` finds it in a buffered JSON body by
  parsing only from the ``"usage"`` key on when it is near the end (the OpenAI and SGLang
  bodies put it last), else the whole body.
- ``UsageSniffer``: keeps the first and last complete SSE lines mentioning ``"usage"``
  while a stream is relayed, parses them once at the end.
- ``sse_error``: the event sent when a stream breaks after the first byte, in the
  grammar of the request's API.
- headers: ``upstream_headers`` (the client's, cleaned: hop-by-hop, ``Expect``,
  ``x-kvgate-*``, credentials; ``X-Forwarded-*`` added), ``downstream_headers`` (the
  replica's, cleaned), the routing headers; ``json_response`` / ``error_response`` (errors in the request's API's shape).
- ``RelayResponse``: the relayed stream, one ASGI send per chunk read; its cleanup always
  runs (end, error, client disconnect), shielded from cancellation.
- ``AnsweredResponse``: a replica's buffered answer; the request's bookkeeping runs after
  the body is handed to the client's transport (off the added latency), and always.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.client_watch import ClientWatch
from gateway.errors import GatewayError, UpstreamError, anthropic_error_body, api_of, error_body
from gateway.upstream_config import UpstreamConfig

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
})
# response headers the gateway's own server sets
NOT_RELAYED = HOP_BY_HOP | {b"date", b"server"}
_OWN_PREFIX = b"x-kvgate-"
CREDENTIALS = frozenset({b"authorization", b"x-api-key"})  # OpenAI's and Anthropic's client keys  # the gateway's own headers: never taken from a client or a replica


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


SSE_MEDIA = b"text/event-stream"  # the content type of a streamed (SSE) answer


def _connection_named(raw: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in ``Connection:`` (hop-by-hop by declaration, RFC 9110 7.6.1)."""
    named: set[bytes] | None = None
    for k, v in raw:
        if k.lower() == b"connection":
            if named is None:
                named = set()
            named.update(t.strip().lower() for t in v.split(b","))
    if named is None:
        return _NONE
    named.discard(b"")
    return frozenset(named)


_NONE: frozenset[bytes] = frozenset()
_DROPPED_PREFIXES = (b"proxy-", _OWN_PREFIX)
_HOP_AND_CREDENTIALS = HOP_BY_HOP | CREDENTIALS


def upstream_headers(raw: list[tuple[bytes, bytes]], policy: HeaderPolicy = HeaderPolicy(),
                     client: str | None = None, scheme: str = "http") -> list[tuple[bytes, bytes]]:
    """The client's headers as sent to the replica.

    Dropped: hop-by-hop headers (``HOP_BY_HOP``, every ``proxy-*``, every header named in
    the client's ``Connection:``), ``Expect`` (the gateway has read the whole body already;
    a replica's ``100 Continue`` must not be awaited), the client's ``x-kvgate-*``, and the
    client's credentials (``Authorization``, Anthropic's ``x-api-key``) unless
    ``policy.forward_authorization`` (a configured replica key replaces them). ``client`` is appended to ``X-Forwarded-For``;
    ``X-Forwarded-Proto`` / ``X-Forwarded-Host`` are set when the client sent none."""
    keep_auth = policy.forward_authorization and policy.replica_authorization is None
    dropped = HOP_BY_HOP if keep_auth else _HOP_AND_CREDENTIALS
    out, forwarded_for, host, proto, fhost, connection = _kept(raw, dropped)
    if connection:  # (rare) the names its Connection: lists are hop-by-hop too: again, without them
        named = _connection_named(raw)
        if named:
            out, forwarded_for, host, proto, fhost, _ = _kept(raw, dropped | named)
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


def _kept(raw: list[tuple[bytes, bytes]], dropped: frozenset[bytes]
          ) -> tuple[list[tuple[bytes, bytes]], list[bytes], bytes, bool, bool, bool]:
    """``upstream_headers``' pass over the client's headers: those kept, the
    ``X-Forwarded-For`` values, the host, whether ``X-Forwarded-Proto`` / ``-Host`` came,
    whether a ``Connection:`` did (each name lowered once)."""
    out: list[tuple[bytes, bytes]] = []
    forwarded_for: list[bytes] = []
    host = b""
    proto = fhost = connection = False
    for k, v in raw:
        name = k.lower()
        if name == b"host":
            host = v
        if name in dropped or name.startswith(_DROPPED_PREFIXES):
            connection = connection or name == b"connection"
            continue
        if name == b"x-forwarded-for":
            forwarded_for.append(v)
            continue
        if name == b"x-forwarded-proto":
            proto = True
        elif name == b"x-forwarded-host":
            fhost = True
        out.append((k, v))
    return out, forwarded_for, host, proto, fhost, connection


def downstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The replica's response headers as relayed: hop-by-hop ones (also those its
    ``Connection:`` names), ``date``/``server`` (the gateway's server sets them) and any
    ``x-kvgate-*`` dropped."""
    out: list[tuple[bytes, bytes]] = []
    connection = False
    for k, v in raw:
        name = k.lower()
        if name in NOT_RELAYED or name.startswith(_DROPPED_PREFIXES):
            connection = connection or name == b"connection"
            continue
        out.append((k, v))
    if connection:  # (rare) the names its Connection: lists are hop-by-hop too
        named = _connection_named(raw)
        out = [(k, v) for k, v in out if k.lower() not in named]
    return out


def route_headers(replica: str, reason: str) -> dict[str, str]:
    return {"x-kvgate-replica": replica, "x-kvgate-route-reason": reason}


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


RETRY_STATUSES = frozenset({429, 503})  # the gateway's own answers that ask the client to come back
RETRY_AFTER_S = "1"  # seconds: replicas rejoin within a probe interval; the edge's refusals say the same


def error_response(error: GatewayError, headers: dict[str, str] | None = None, api: str = "chat") -> Response:
    """The JSON body of a gateway error in the shape of ``api``'s API (an endpoint name:
    Anthropic's for messages, OpenAI's otherwise), with the routing headers. A 503 or 429
    the gateway answers itself (no replica, overloaded) carries ``Retry-After`` (``RETRY_AFTER_S``),
    as the edge's own refusals do: SDKs wait that long before their retry instead of guessing."""
    out = headers or route_headers("none", "none")
    if error.status in RETRY_STATUSES:
        out = {**out, "retry-after": RETRY_AFTER_S}
    return Response(orjson.dumps(error.body(api_of(api))), status_code=error.status, headers=out,
                    media_type="application/json")


Usage = tuple[int | None, int | None, int | None]  # prompt, cached, completion tokens


def usage_of(document: object) -> Usage:
    """(prompt, cached, completion) tokens from any usage the replica reports.

    OpenAI chat/completions ``usage`` (``prompt_tokens_details.cached_tokens``), a
    /generate ``meta_info``, OpenAI Responses ``usage`` (``input_tokens`` includes the
    cached ``input_tokens_details.cached_tokens``), Anthropic ``usage`` (``input_tokens``
    *excludes* ``cache_read_input_tokens``, which SGLang omits when 0), also nested in a
    Responses stream event (``response.usage``) or Anthropic's ``message_start``
    (``message.usage``)."""
    if not isinstance(document, dict):
        return None, None, None
    usage = document.get("usage") or document.get("meta_info")
    if usage is None and isinstance(inner := document.get("response") or document.get("message"), dict):
        usage = inner.get("usage")
    if not isinstance(usage, dict):
        return None, None, None
    if "prompt_tokens" not in usage and ("input_tokens" in usage or "output_tokens" in usage):
        return _agent_usage(usage)
    cached = usage.get("cached_tokens")  # /generate meta_info
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens", cached)
    return _count(usage.get("prompt_tokens")), _count(cached), _count(usage.get("completion_tokens"))


def _agent_usage(usage: dict[str, object]) -> Usage:
    """Responses (``input_tokens_details``) or Anthropic (``cache_*_input_tokens``) usage."""
    prompt, completion = _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):
        return prompt, _count(details.get("cached_tokens")), completion
    read = _count(usage.get("cache_read_input_tokens"))
    if prompt is None:
        return None, read, completion
    written = _count(usage.get("cache_creation_input_tokens")) or 0
    return prompt + (read or 0) + written, read or 0, completion


def _count(value: object) -> int | None:
    """A token count as reported, or None when absent or not a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class UsageSniffer:
    """Keeps the first and the last complete SSE lines mentioning ``"usage"``; parses
    them once at the end, the last one's counts winning (Anthropic reports the prompt in
    ``message_start`` and the output in ``message_delta``; chat and Responses report
    everything last)."""

    __slots__ = ("carry", "first_line", "last_line")
    MAX_CARRY = 4 * 1024 * 1024

    def __init__(self) -> None:
        self.carry = b""
        self.first_line = b""
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
            self.last_line = _line_at(data, hit)
            if not self.first_line:
                self.first_line = _line_at(data, data.find(b'"usage"', 0, end))

    def usage(self) -> Usage:
        last = _sse_usage(self.last_line)
        if self.first_line == self.last_line:
            return last
        first = _sse_usage(self.first_line)
        return (last[0] if last[0] is not None else first[0], last[1] if last[1] is not None else first[1],
                last[2] if last[2] is not None else first[2])


def _line_at(data: bytes, at: int) -> bytes:
    return data[data.rfind(b"\n", 0, at) + 1: data.find(b"\n", at)]


def _sse_usage(line: bytes) -> Usage:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None, None, None
    try:
        return usage_of(orjson.loads(line[5:]))
    except orjson.JSONDecodeError:
        return None, None, None


def sse_error(message: str, type_: str = UpstreamError.type, code: str | int = 502, api: str = "chat") -> bytes:
    """The event that ends a stream the gateway cannot finish, in the grammar of the
    request's API (``api``: a ``RequestContext.endpoint``): OpenAI's ``data: {"error"}``
    then ``[DONE]``; Anthropic's ``event: error`` (``overloaded_error`` / ``api_error``);
    Responses' ``event: error`` (``{"type": "error", "code", "message", "param"}``)."""
    if api_of(api) == "anthropic":
        status = code if isinstance(code, int) else 503 if "unavailable" in type_ or "shutdown" in type_ else 500
        return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(message, status)) + b"\n\n"
    if api == "responses":
        event = {"type": "error", "code": str(code) if isinstance(code, int) else code, "message": message,
                 "param": None, "sequence_number": 0}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + orjson.dumps(error_body(message, type_, code)) + b"\n\ndata: [DONE]\n\n"


class ClosingResponse(Response):
    """A response whose ``on_close`` (the request's bookkeeping) must run once, whatever happens."""

    _on_close: Callable[[], Awaitable[None]]

    async def abandon(self) -> None:
        """Never sent (the gateway failed before): the bookkeeping all the same."""
        await asyncio.shield(self._on_close())


class RelayResponse(ClosingResponse):
    """A relayed stream: the head, then each chunk of ``body_iterator`` as it comes, one
    ASGI ``send`` per chunk. It ends when the content does, or when the client leaves
    (``ClientWatch`` cancels the relay; the replica's request is then closed by
    ``on_close``); ``on_close`` always runs, shielded from cancellation. Plain asyncio: no
    anyio task group per stream (Starlette's ``StreamingResponse`` starts one, with two
    tasks, to watch for the disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int,
                 headers: Mapping[str, str] | list[tuple[bytes, bytes]],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        """``headers``: a mapping, or raw (name, value) pairs relayed as they are."""
        self.body_iterator = content
        self.status_code = status_code
        self.background = None
        if isinstance(headers, list):
            self.raw_headers = headers
        else:
            self.init_headers(headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with ClientWatch(receive):
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await asyncio.shield(self._on_close())


class AnsweredResponse(ClosingResponse):
    """A replica's whole (buffered) answer, relayed at once; ``on_close`` then runs.

    ``on_close`` is the request's bookkeeping (load lease, upstream connection, usage,
    feedback, metrics). It runs right after the body is handed to the client's transport,
    so the client does not wait for it, and before this task yields to the event loop
    (nothing in between awaits), so the client's next request is still decided after it.
    It always runs: a failed or cancelled send runs it shielded from the cancellation."""

    def __init__(self, body: bytes, status_code: int, headers: list[tuple[bytes, bytes]],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        """``headers``: raw (name, value) pairs; ``content-length`` is added."""
        self.body = body
        self.status_code = status_code
        self.background = None
        self.raw_headers = [*headers, (b"content-length", b"%d" % len(body))]
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        except BaseException:
            await asyncio.shield(self._on_close())
            raise
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
