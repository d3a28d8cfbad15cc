"""Reading a request body within a bound (413 beyond it, without reading it all)."""
from __future__ import annotations

from starlette.requests import Request

from gateway.errors import PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
