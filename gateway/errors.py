"""Errors the gateway returns, as a small hierarchy mapped to each API's error body.

    GatewayError                      -> {"error": {"message", "type", "code", "param"}}
     +-- InvalidRequest (400)            malformed JSON, missing messages/prompt, bad field
     |    +-- UnsupportedMediaType (415) content type is not application/json
     |    +-- PayloadTooLarge (413)      body over max_body_bytes
     +-- Unauthorized (401)              admin API without a bearer token
     +-- Forbidden (403)                 admin API with a wrong token
     +-- NotFound (404)                  unknown replica / model / route
     |    +-- ModelNotFound (404)        a model no replica serves (code model_not_found)
     +-- NoReplicaAvailable (503)        nothing routable
     +-- UpstreamError (502)             every attempt failed before the first byte
     +-- UpstreamTimeout (504)           the replica did not answer in time

Two shapes (``GatewayError.body(api)``): OpenAI's ``{"error": {"message", "type",
"code", "param"}}`` for every endpoint but Anthropic's, and Anthropic's
``{"type": "error", "error": {"type", "message"}}`` for ``/v1/messages`` and
``/v1/messages/count_tokens`` (``api_of(endpoint)`` says which), whose error type is
named by the status (``ANTHROPIC_TYPES``: 400 invalid_request_error, 404
not_found_error, 413 request_too_large, 503 overloaded_error, ...).
"""
from __future__ import annotations

from typing import Any, Literal

Api = Literal["openai", "anthropic"]
ANTHROPIC_ENDPOINTS = frozenset({"messages", "count_tokens"})
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def endpoint_of(path: str) -> str:
    """The API a request path belongs to, as a ``RequestContext.endpoint`` (for the error
    shapes of what is answered before, or without, a parsed request)."""
    if path.startswith("/v1/messages"):
        return "messages"
    return "responses" if path.startswith("/v1/responses") else "chat"


def api_of(endpoint: str) -> Api:
    """Whose error shapes an endpoint speaks (``RequestContext.endpoint`` values)."""
    return "anthropic" if endpoint in ANTHROPIC_ENDPOINTS else "openai"


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error shape; the type follows the status (5xx other than 503: api_error)."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                                     else "invalid_request_error"),
                                       "message": message}}


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

    def body(self, api: Api = "openai") -> dict[str, Any]:
        if api == "anthropic":
            return anthropic_error_body(self.message, self.status)
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


class ModelNotFound(NotFound):
    """A request (or ``GET /v1/models/{id}``) names a model no replica serves; SGLang's
    own wording and code (Anthropic's shape: ``not_found_error``)."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")


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
