"""Generation routes of the simulated replica: chat, completions, /generate, and the
agents' APIs (Anthropic ``/v1/messages`` + ``count_tokens``, OpenAI ``/v1/responses`` +
``GET``/``DELETE``/``cancel`` of a stored response; bodies and shapes in :mod:`.api_agents`).

Each route turns its body into a :class:`~.intake.Job` (:mod:`.intake`) and hands it to
:meth:`Generation.serve`, which applies fault injection and pause, submits the request to
the engine and relays its output in the route's wire shape (:mod:`.protocol`):

- engine callbacks land in a per-request ``asyncio.Queue`` (:class:`Listener`); what
  queued up while the consumer was busy is merged into one update, as SGLang does when
  its detokenizer lags;
- streaming: one SSE event per update (chat: role chunk on the first token, content
  chunks, a separate finish chunk, then sglext/usage/[DONE]; completions: the finish
  reason on the last text chunk; /generate: cumulative text and ids);
- non-streaming: wait for ``on_finish`` (the engine then skips ``on_tokens``);
- a client that leaves (disconnect while waiting or streaming) aborts its request.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from loadtest.simulator import api_choices, intake, protocol, tokenizer
from loadtest.simulator.api_agents import MESSAGES, RESPONSES
from loadtest.simulator.api_routes import AgentRoutes
from loadtest.simulator.clock import RealtimeDriver
from loadtest.simulator.engine import RequestResult, SimRequest
from loadtest.simulator.faults import FaultPlan, Faults
from loadtest.simulator.intake import CHAT, COMPLETION, GENERATE, Job
from loadtest.simulator.metrics import RequestSample, SimMetrics
from loadtest.simulator.profile import Profile
from loadtest.simulator.requests import Listener


class GenerationReplica(Protocol):
    """What the generation routes use of the replica (``server.Replica``)."""

    profile: Profile
    driver: RealtimeDriver
    metrics: SimMetrics
    faults: Faults
    in_flight: dict[str, Callable[[], None]]
    paused: bool
    resumed: asyncio.Event



class Generation:
    """The three generation routes over one replica."""

    def __init__(self, replica: GenerationReplica) -> None:
        self.r = replica
        self.agents = AgentRoutes(self)
        self.options: dict[str, api_choices.ChoiceOptions] = {}  # rid -> logprobs of a one-choice chat

    def limits(self) -> intake.Limits:
        return intake.Limits(self.r.profile.served_model_name, self.r.profile.context_length,
                             self.r.in_flight)

    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            job = intake.chat_job(request.headers.get("content-type", ""), raw, self.limits())
        except intake.BadRequest as e:
            return _json(e.body, 400)
        return await self.serve(request, job, api_choices.options(raw))

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        try:
            job = intake.completion_job(request.headers.get("content-type", ""), raw, self.limits())
        except intake.BadRequest as e:
            return _json(e.body, 400)
        return await self.serve(request, job)

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            job = intake.generate_job(raw, self.limits())
        except intake.BadRequest as e:
            return _json(e.body, 400)
        return await self.serve(request, job)

    def cancel(self, rid: str) -> bool:
        """Cancel a request still running; False when it is not (or no longer) running."""
        stop = self.r.in_flight.get(rid)
        if stop is None:
            return False
        stop()
        return True

    def cached_tokens(self, rid: str) -> int:
        """Cached prompt tokens of a running request (0 once it has left the engine)."""
        return self.r.driver.engine.cached_tokens(rid)

    # ---- the common path --------------------------------------------------------------
    async def serve(self, request: Request, job: Job, opts: api_choices.ChoiceOptions | None = None) -> Response:
        plan = self.r.faults.plan()
        if plan.latency_s:
            await asyncio.sleep(plan.latency_s)
        if plan.error_status is not None:
            msg = protocol.error_response("simulated failure (fault injection)", "ServiceUnavailable",
                                          plan.error_status)
            return _json(msg, plan.error_status)
        if plan.hang:
            await _disconnected(request)
            return Response(status_code=499)
        if self.r.paused:
            await self.r.resumed.wait()
        if opts is not None and opts.n > 1:
            return await self._many(request, job, opts, plan)
        if opts is not None:
            self.options[job.rid] = opts
        listener = Listener()
        self._submit(job, listener)
        if job.stream:
            box: list[RequestResult] = []
            events = _with_faults(self._events(job, listener, box), plan)
            return StreamingResponse(self._guard(job, events, box), media_type="text/event-stream",
                                     headers=protocol.SSE_HEADERS)
        return await self._whole(request, job, listener)

    def _submit(self, job: Job, listener: Listener) -> None:
        driver = self.r.driver
        self.r.in_flight[job.rid] = lambda: driver.abort(job.rid)
        req = SimRequest(rid=job.rid, prompt_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens,
                         ignore_eos=job.ignore_eos, seed=job.seed, stream=job.stream, prose=job.prose)
        driver.submit(req, listener)

    def _done(self, job: Job, result: RequestResult | None) -> None:
        """Bookkeeping when a request leaves: in-flight set, metrics, abort if unfinished."""
        abort = self.r.in_flight.pop(job.rid, None)
        self.options.pop(job.rid, None)
        if result is None:
            self.agents.store.pending.pop(job.rid, None)
            if abort is not None:
                abort()
            self.r.metrics.count_abort()
            return
        ttft = None if result.first_token_s is None else result.first_token_s - result.arrival_s
        self.r.metrics.observe_request(RequestSample(
            job.stream, result.prompt_tokens, result.completion_tokens, result.cached_device,
            result.cached_host, ttft, result.finish_s - result.arrival_s,
            result.finish_reason == "abort", result.spec_verify_ct))

    async def _many(self, request: Request, job: Job, opts: api_choices.ChoiceOptions, plan: FaultPlan) -> Response:
        """A chat request with ``n > 1`` choices (:mod:`.api_choices`)."""
        jobs = api_choices.choice_jobs(job, opts.n)
        listeners = [Listener() for _ in jobs]
        for one, listener in zip(jobs, listeners, strict=True):
            self._submit(one, listener)
        if job.stream:
            results: list[RequestResult | None] = [None] * len(jobs)
            events = api_choices.many_events(jobs, listeners, opts, results, lambda j: protocol.stream_error(
                self.refusal(j), "BadRequest", 400))
            return StreamingResponse(self._guard_many(jobs, _with_faults(events, plan), results),
                                     media_type="text/event-stream", headers=protocol.SSE_HEADERS)
        got = await api_choices.first_of(asyncio.gather(*(lst.result() for lst in listeners)), _disconnected(request))
        for k, one in enumerate(jobs):
            self._done(one, got[k] if got else None)
        if got is None:
            return Response(status_code=499)
        if any(protocol.refused(r) for r in got):
            return _json(protocol.error_response(self.refusal(job)), 400)
        return _json(api_choices.many_body(jobs, got, opts))

    async def _guard_many(self, jobs: list[Job], events: AsyncIterator[bytes],
                          results: list[RequestResult | None]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        finally:
            for one, result in zip(jobs, results, strict=True):
                self._done(one, result)

    async def _whole(self, request: Request, job: Job, listener: Listener) -> Response:
        opts = self.options.get(job.rid)  # (``_done`` forgets it)
        waiter = asyncio.ensure_future(listener.result())
        gone = asyncio.ensure_future(_disconnected(request))
        result: RequestResult | None = None
        try:
            await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
            if waiter.done():
                result = waiter.result()
        finally:
            waiter.cancel()
            gone.cancel()
            self._done(job, result)
        if result is None:
            return Response(status_code=499)
        if protocol.refused(result):
            message = self.refusal(job)
            body = {"error": {"message": message}} if job.kind == GENERATE else protocol.error_response(message)
            if job.kind in (MESSAGES, RESPONSES):
                body = self.agents.refusal_body(job, message)
            return _json(body, 400)
        text = tokenizer.decode(result.output_ids)
        f = protocol.finish_of(result)
        if job.kind in (MESSAGES, RESPONSES):
            return self.agents.whole(job, text, f)
        if job.kind == CHAT:
            answer = protocol.chat_response(job.rid, job.created, job.model, text, f, job.sglext)
            if opts is not None and opts.logprobs:
                answer["choices"][0]["logprobs"] = api_choices.token_logprobs(result.output_ids, opts.top_logprobs)
            return _json(answer)
        if job.kind == COMPLETION:
            return _json(protocol.completion_response(job.rid, job.created, job.model, text, f, job.sglext))
        return _json({"text": text, "output_ids": result.output_ids,
                      "meta_info": self._meta(job, f, result)})

    def refusal(self, job: Job) -> str:
        p = self.r.profile
        return (f"The simulated engine refused the request: {len(job.prompt_ids)} prompt tokens + "
                f"{job.max_new_tokens} max new tokens do not fit (context_length {p.context_length}, "
                f"KV pool {p.device_tokens} tokens).")

    def _meta(self, job: Job, f: protocol.Finish | None, r: RequestResult | None,
              completion_tokens: int = 0) -> dict[str, Any]:
        e2e = 0.0 if r is None else r.finish_s - r.arrival_s
        done = completion_tokens if r is None else r.completion_tokens
        return protocol.generate_meta(job.rid, f, len(job.prompt_ids), done, e2e,
                                      self.r.profile.spec_num_draft_tokens)

    async def _guard(self, job: Job, events: AsyncIterator[bytes],
                     box: list[RequestResult]) -> AsyncIterator[bytes]:
        """Release the request however the stream ends (done, error, client gone)."""
        try:
            async for event in events:
                yield event
        finally:
            self._done(job, box[0] if box else None)

    async def _events(self, job: Job, listener: Listener,
                      box: list[RequestResult]) -> AsyncIterator[bytes]:
        if job.kind in (MESSAGES, RESPONSES):
            async for event in self.agents.events(job, listener, box):
                yield event
            return
        rid, created, model = job.rid, job.created, job.model
        started = False
        text = ""
        ids: list[int] = []
        async for tokens, result in listener.updates():
            piece = tokenizer.decode(tokens) if tokens else ""
            if result is not None:
                box.append(result)
                if protocol.refused(result):
                    yield protocol.stream_error(self.refusal(job), "BadRequest", 400)
                    return
            f = protocol.finish_of(result) if result is not None else None
            if job.kind == CHAT:
                if not started and (tokens or f):
                    started = True
                    yield protocol.chat_first_chunk(rid, created, model)
                if piece:
                    lp = None
                    if (opts := self.options.get(rid)) is not None and opts.logprobs:
                        lp = api_choices.token_logprobs(tokens, opts.top_logprobs, len(ids))
                        ids.extend(tokens)
                    yield protocol.chat_content_chunk(rid, created, model, piece, lp)
                if f is not None:
                    for event in protocol.chat_tail(rid, created, model, f, job.sglext, job.include_usage):
                        yield event
            elif job.kind == COMPLETION:
                if piece or f is not None:
                    yield protocol.completion_chunk(rid, created, model, piece, f)
                if f is not None:
                    for event in protocol.completion_tail(rid, created, model, f, job.sglext,
                                                          job.include_usage):
                        yield event
            else:
                text += piece
                ids.extend(tokens)
                meta = self._meta(job, f, result, len(ids))
                yield protocol.sse({"text": text, "output_ids": list(ids), "meta_info": meta})
                if f is not None:
                    yield protocol.DONE

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            *self.agents.routes(),
        ]


def generation_routes(replica: GenerationReplica) -> list[Route]:
    return Generation(replica).routes()


class DieMidStream(Exception):
    """Raised inside a stream to drop the connection (fault injection)."""


async def _with_faults(events: AsyncIterator[bytes], plan: FaultPlan) -> AsyncIterator[bytes]:
    if plan.die_after_chunks is None:
        async for event in events:
            yield event
        return
    sent = 0
    async for event in events:
        if sent >= plan.die_after_chunks:
            if plan.die_exit:
                os._exit(17)
            raise DieMidStream(f"fault injection: connection dropped after {sent} events")
        yield event
        sent += 1


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")

