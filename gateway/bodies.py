"""A request's headers as a map, and its body read within a bound (413 beyond it,
without reading it all)."""
from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import ClientDisconnect, Request

from gateway.errors import PayloadTooLarge


def header_map(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """Lower-case name -> the first value (latin-1), as Starlette's ``Headers.get`` reads
    them, built once: ``Headers.get`` scans every header on each call, and a request's
    context looks up a dozen names, most of them absent."""
    out: dict[str, str] = {}
    for name, value in raw:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


async def read_body(request: Request, limit: int, headers: Mapping[str, str] | None = None) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without reading it
    all. ``headers``: the request's ``header_map`` when the caller has it."""
    declared = (request.headers if headers is None else headers).get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    # ASGI's receive() directly, as Starlette's Request.stream() reads it, without its
    # async generator (~10 us a request here); the body is read once, by this function
    receive = request.receive
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)
