"""Errors the gateway returns, as a small hierarchy mapped to OpenAI-shaped bodies.

    GatewayError                      -> {"error": {"message", "type", "code", "param"}}
     +-- InvalidRequest (400)            malformed JSON, missing messages/prompt, bad field
     |    +-- UnsupportedMediaType (415) content type is not application/json
     |    +-- PayloadTooLarge (413)      body over max_body_bytes
     +-- Unauthorized (401)              admin API without a bearer token
     +-- Forbidden (403)                 admin API with a wrong token
     +-- NotFound (404)                  unknown replica / model / route
     +-- NoReplicaAvailable (503)        nothing routable
     +-- UpstreamError (502)             every attempt failed before the first byte
     +-- UpstreamTimeout (504)           the replica did not answer in time
"""
from __future__ import annotations

from typing import Any


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape, for the gateway's JSON errors and its SSE error events."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "payload_too_large"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "unauthorized"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class NoReplicaAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_replica_available"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
