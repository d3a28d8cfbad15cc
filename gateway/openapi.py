"""The gateway's OpenAPI document, served on ``GET /openapi.json``.

Written by hand rather than generated from the routes: the inference endpoints are plain
Starlette routes that pass the body through unchanged, so their schemas here are the
minimal OpenAI/SGLang request shapes the gateway itself reads (``model``, ``messages``
with ``role``/``content``, ``prompt``, ``text``, ``stream``, ``max_tokens``, session
fields; Anthropic Messages and OpenAI Responses, whose errors are in their own shapes:
docs/agents.md); any other field is allowed and reaches the replica as sent. The admin routes
take their request bodies from the pydantic models in ``gateway/admin.py`` and carry the
``adminToken`` bearer security scheme, as does SGLang's ``/flush_cache`` (an admin
action on the main port, fanned out to every replica); SGLang's ``/model_info`` and
``/server_info`` (relayed from a replica) are open like ``/v1/models``. Schema-driven fuzzers (schemathesis,
``tests/safety/test_fuzz.py``) work from this document.
"""
from __future__ import annotations

from typing import Any

from gateway.admin import DrainRequest, PrepareRemoval, ReplicaRef

ERROR = {"$ref": "#/components/schemas/Error"}
ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _responses(ok: dict[str, Any], *errors: int, ok_status: str = "200", sse: bool = False,
               error: dict[str, Any] = ERROR) -> dict[str, Any]:
    content = _json(ok) | ({"text/event-stream": {"schema": {"type": "string"}}} if sse else {})
    out: dict[str, Any] = {ok_status: {"description": "success", "content": content}}
    shape = "Anthropic" if error is ANTHROPIC_ERROR else "OpenAI"
    for status in errors:
        out[str(status)] = {"description": f"error ({shape}-shaped)", "content": _json(error)}
    return out


INFERENCE_ERRORS = (400, 404, 413, 415, 429, 500, 502, 503, 504)
MESSAGE = {
    "type": "object", "required": ["role", "content"], "additionalProperties": True,
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": ANY_OBJECT}]},
    },
}
COMMON = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "user": {"type": "string"},
    "session_id": {"type": "string"},
}


def _inference(summary: str, required: str, field: dict[str, Any]) -> dict[str, Any]:
    body = {"type": "object", "required": [required], "additionalProperties": True,
            "properties": COMMON | {required: field}}
    return {"post": {"summary": summary, "operationId": summary.replace(" ", "_"),
                     "requestBody": {"required": True, "content": _json(body)},
                     "responses": _responses(ANY_OBJECT, *INFERENCE_ERRORS, sse=True)}}


ANTHROPIC_MESSAGE = {
    "type": "object", "required": ["role", "content"], "additionalProperties": True,
    "properties": {"role": {"type": "string", "enum": ["user", "assistant", "system"]},
                   "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": ANY_OBJECT}]}},
}


def _agents() -> dict[str, Any]:
    """Anthropic Messages (Claude Code) and OpenAI Responses (Codex): see docs/agents.md."""
    messages = {"type": "array", "items": ANTHROPIC_MESSAGE}
    system = {"oneOf": [{"type": "string"}, {"type": "array", "items": ANY_OBJECT}]}
    anthropic = {"model": {"type": "string", "minLength": 1}, "messages": messages, "system": system,
                 "stream": {"type": "boolean"}, "max_tokens": {"type": "integer", "minimum": 1},
                 "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}}}

    def op(summary: str, required: list[str], props: dict[str, Any], error: dict[str, Any] = ERROR,
           sse: bool = True) -> dict[str, Any]:
        body = {"type": "object", "required": required, "additionalProperties": True, "properties": props}
        return {"post": {"summary": summary, "operationId": summary.replace(" ", "_"),
                         "requestBody": {"required": True, "content": _json(body)},
                         "responses": _responses(ANY_OBJECT, *INFERENCE_ERRORS, sse=sse, error=error)}}

    responses = {"model": {"type": "string", "minLength": 1}, "stream": {"type": "boolean"},
                 "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": ANY_OBJECT}]},
                 "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
                 "previous_response_id": {"type": "string", "pattern": "^resp_"}}
    rid = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    stored = {"parameters": rid, "responses": _responses(ANY_OBJECT, 400, 404, 502)}
    return {
        "/v1/messages": op("anthropic messages", ["model", "max_tokens", "messages"], anthropic, ANTHROPIC_ERROR),
        "/v1/messages/count_tokens": op("anthropic count tokens", ["model", "messages"],
                                        {k: v for k, v in anthropic.items() if k != "max_tokens"},
                                        ANTHROPIC_ERROR, sse=False),
        "/v1/responses": op("responses", ["model", "input"], responses),
        "/v1/responses/{response_id}": {"get": {"summary": "retrieve response", "operationId": "retrieve_response",
                                                **stored},
                                        "delete": {"summary": "delete response", "operationId": "delete_response",
                                                   **stored}},
        "/v1/responses/{response_id}/cancel": {"post": {"summary": "cancel response",
                                                        "operationId": "cancel_response", **stored}},
        "/v1/models/{model}": {"get": {"summary": "retrieve model", "operationId": "retrieve_model",
                                       "parameters": [{"name": "model", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                                       "responses": _responses(ANY_OBJECT, 404)}},
    }


def _admin(method: str, summary: str, body: type | None = None, *, status: str = "200",
           params: list[dict[str, Any]] | None = None, errors: tuple[int, ...] = (400, 401, 403)) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "operationId": "admin_" + summary.replace(" ", "_"),
                          "security": [{"adminToken": []}],
                          "responses": _responses(ANY_OBJECT, *errors, ok_status=status)}
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body.model_json_schema())}  # type: ignore[attr-defined]
    if params:
        op["parameters"] = params
    return {method: op}


def _get(summary: str, *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": summary.replace(" ", "_"),
                    "responses": _responses(ANY_OBJECT, *errors)}}


def _sglang() -> dict[str, Any]:
    """SGLang's own routes the benchmark tools call (``gateway.api_routes``)."""
    wait = [{"name": "timeout", "in": "query", "required": False,
             "schema": {"type": "number", "minimum": 0, "maximum": 300}}]
    flush = (_admin("get", "flush cache get", params=wait, errors=(400, 401, 403, 502, 503))
             | _admin("post", "flush cache", params=wait, errors=(400, 401, 403, 502, 503)))
    return {"/model_info": _get("model info", 502, 503), "/get_model_info": _get("get model info", 502, 503),
            "/server_info": _get("server info", 502, 503), "/get_server_info": _get("get server info", 502, 503),
            "/flush_cache": flush}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every endpoint the gateway serves."""
    url_param = [{"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}]
    paths: dict[str, Any] = {
        "/v1/chat/completions": _inference("chat completions", "messages",
                                           {"type": "array", "minItems": 1, "items": MESSAGE}),
        "/v1/completions": _inference("completions", "prompt",
                                      {"oneOf": [{"type": "string", "minLength": 1},
                                                 {"type": "array", "minItems": 1, "items": {"type": "string"}}]}),
        "/generate": _inference("generate", "text", {"type": "string", "minLength": 1}),
        **_agents(),
        "/v1/models": _get("list models"),
        **_sglang(),
        "/health": _get("liveness"),
        "/ready": _get("readiness", 503),
        "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                             "responses": {"200": {"description": "text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/admin/replicas": (_admin("get", "list replicas")
                            | _admin("post", "add replica", ReplicaRef, status="201")
                            | _admin("delete", "remove replica", params=url_param, errors=(400, 401, 403, 404))),
        "/admin/replicas/drain": _admin("post", "drain replica", DrainRequest, errors=(400, 401, 403, 404)),
        "/admin/replicas/undrain": _admin("post", "undrain replica", ReplicaRef, errors=(400, 401, 403, 404)),
        "/admin/config": _admin("get", "effective config"),
        "/admin/scale": _admin("get", "scale advice"),
        "/admin/scale/prepare-removal": _admin("post", "prepare removal", PrepareRemoval,
                                                       errors=(400, 401, 403, 404)),
    }
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}}}
    anthropic_error = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvgate", "version": "0.1.0",
                 "description": "Cache-aware gateway in front of SGLang replicas (OpenAI-compatible)."},
        "paths": paths,
        "components": {"schemas": {"Error": error, "AnthropicError": anthropic_error},
                       "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}}},
    }
