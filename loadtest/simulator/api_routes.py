"""The agents' API routes of the simulated replica: Messages, count_tokens, Responses.

Bodies are read and shaped by :mod:`.api_agents`; requests run through the common path
of :class:`~.generation.Generation` (fault injection, pause, engine, disconnects), which
hands streams and finished results of these kinds back here:

- ``POST /v1/messages`` (stream and not), ``POST /v1/messages/count_tokens``;
- ``POST /v1/responses`` (stream and not), with ``previous_response_id`` from the
  replica's own store; ``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel``.

Anthropic's ``message_start`` reports the cached prompt tokens at the first token; the
engine only reports them at the finish, so ``cached_now`` reads the running request's
match from the engine (``ReplicaEngine._lives``; see the report for the accessor wanted).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.simulator import api_agents, api_wire, protocol, tokenizer
from loadtest.simulator.api_agents import MESSAGES, RESPONSES
from loadtest.simulator.engine import RequestResult
from loadtest.simulator.intake import Job

if TYPE_CHECKING:
    from loadtest.simulator.api_choices import ChoiceOptions
    from loadtest.simulator.intake import Limits
    from loadtest.simulator.requests import Listener


class AgentHost(Protocol):
    """What these routes use of the generation routes (``generation.Generation``)."""

    def limits(self) -> Limits: ...

    def refusal(self, job: Job) -> str: ...

    def cancel(self, rid: str) -> bool: ...

    def cached_tokens(self, rid: str) -> int: ...

    async def serve(self, request: Request, job: Job, opts: ChoiceOptions | None = None) -> Response: ...


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class AgentRoutes:
    """The routes above over one :class:`~.generation.Generation`."""

    def __init__(self, generation: AgentHost) -> None:
        self.g = generation
        self.store = api_agents.ReplicaResponseStore()

    async def messages(self, request: Request) -> Response:
        try:
            job = api_agents.messages_job(await request.body(), self.g.limits())
        except api_agents.AgentBadRequest as e:
            return _json(e.body, e.status)
        return await self.g.serve(request, job)

    async def count_tokens(self, request: Request) -> Response:
        try:
            return _json(api_agents.count_tokens(await request.body()))
        except api_agents.AgentBadRequest as e:
            return _json(e.body, e.status)

    async def responses(self, request: Request) -> Response:
        try:
            job = api_agents.responses_job(await request.body(), self.g.limits(), self.store)
        except api_agents.AgentBadRequest as e:
            return _json(e.body, e.status)
        return await self.g.serve(request, job)

    async def stored_response(self, request: Request) -> Response:
        """GET / DELETE ``/v1/responses/{id}``, POST ``.../cancel``."""
        rid = request.path_params["response_id"]
        if not rid.startswith("resp_"):
            return _json(api_agents.responses_error(
                f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'.", param="response_id"), 400)
        stored = self.store.responses.get(rid)
        if request.method == "POST" and stored is None and self.g.cancel(rid):
            # a stream still running was cancelled (its store entry comes at its end)
            return _json({"id": rid, "object": "response", "status": "cancelled"})
        if stored is None:
            return _json(api_agents.responses_error(f"Response with id '{rid}' not found.", 404, "response_id"), 404)
        if request.method == "DELETE":
            self.store.delete(rid)
            return _json({"id": rid, "object": "response", "deleted": True})
        return _json(stored)

    def stored(self, job: Job, text: str, f: protocol.Finish) -> dict[str, Any]:
        """The finished Responses object, stored with its conversation (unless ``store: false``)."""
        body, conversation = self.store.pending.pop(job.rid, ({}, []))
        obj = api_wire.response_object(job, body, text, f)
        if obj["store"]:
            self.store.put(obj, [*conversation, {"role": "assistant", "content": text}])
        return obj

    def cached_now(self, rid: str) -> int:
        """Cached prompt tokens of a running request (Anthropic reports them at the first token)."""
        return self.g.cached_tokens(rid)

    async def events(self, job: Job, listener: Listener, box: list[RequestResult]) -> AsyncIterator[bytes]:
        events = api_wire.ResponseEvents(job, self.store.pending[job.rid][0]) if job.kind == RESPONSES else None
        if events is not None:
            yield events.head()
        text, started = "", False
        async for tokens, result in listener.updates():
            piece = tokenizer.decode(tokens) if tokens else ""
            if result is not None:
                box.append(result)
                if protocol.refused(result):
                    yield stream_error(job, self.g.refusal(job))
                    return
            f = protocol.finish_of(result) if result is not None else None
            if events is None and not started and (tokens or f):
                started = True
                yield api_wire.message_head(job, f.cached_tokens if f else self.cached_now(job.rid))
            if piece:
                text += piece
                yield events.delta(piece) if events is not None else api_wire.message_delta(piece)
            if f is not None:
                if events is None:
                    yield api_wire.message_tail(f)
                else:
                    tail, _ = events.tail(text, f)
                    self.stored(job, text, f)
                    yield tail

    def whole(self, job: Job, text: str, f: protocol.Finish) -> Response:
        """A finished non-streaming request of these kinds."""
        if job.kind == MESSAGES:
            return _json(api_wire.message_body(job, text, f))
        return _json(self.stored(job, text, f))

    def refusal_body(self, job: Job, message: str) -> dict[str, Any]:
        return api_agents.anthropic_error(message) if job.kind == MESSAGES else api_agents.responses_error(message)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.stored_response, methods=["POST"]),
        ]


def stream_error(job: Job, message: str) -> bytes:
    """A stream's error event in its API's grammar."""
    if job.kind == MESSAGES:
        body = api_agents.anthropic_error(message)
    else:
        body = {"type": "error", "code": "400", "message": message, "param": None, "sequence_number": 0}
    return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
