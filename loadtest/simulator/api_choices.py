"""Chat's ``n > 1`` and ``logprobs`` on the simulated replica, in SGLang 0.5.23's shapes.

Checked against the real CPU server:

- ``n``: the request runs as ``n`` engine requests (seeds ``seed + i``, so the texts
  differ; the second and later hit the prefix the first cached). The body has one choice
  per index; ``usage.prompt_tokens`` counts the prompt once, ``completion_tokens`` sums
  the choices, ``cached_tokens`` is the first prompt's. Streaming interleaves the
  choices' chunks (each with its ``index`` and its own request id), each choice its role
  chunk first and its finish chunk last, then the usage chunk and ``[DONE]``.
- ``logprobs``/``top_logprobs``: ``{"content": [{"token", "bytes", "logprob",
  "top_logprobs": [{"token", "bytes", "logprob"}, ...]}]}`` per choice (streams: per
  content chunk, for that chunk's tokens). The values are deterministic stand-ins (a hash
  of the token and its position), not a model's.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from loadtest.simulator import protocol, tokenizer
from loadtest.simulator.intake import Job
from loadtest.simulator.requests import Listener, RequestResult

MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class ChoiceOptions:
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0


def options(raw: bytes) -> ChoiceOptions | None:
    """The body's ``n`` / ``logprobs`` when it asks for either (None: a plain request).

    A byte search first: a body that names neither is not parsed a second time."""
    if b'"n"' not in raw and b'"logprobs"' not in raw:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    n, top = body.get("n"), body.get("top_logprobs")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1
    top = top if isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_TOP_LOGPROBS else 0
    opts = ChoiceOptions(n, body.get("logprobs") is True, top)
    return None if opts == ChoiceOptions() else opts


def _logprob(token_id: int, position: int) -> float:
    h = xxhash.xxh3_64_intdigest(token_id.to_bytes(4, "little"), seed=position)
    return -(4.0 + (h % 6000) / 1000.0)


def _entry(token_id: int, position: int) -> dict[str, Any]:
    token = tokenizer.decode([token_id])
    return {"token": token, "bytes": list(token.encode()), "logprob": _logprob(token_id, position)}


def token_logprobs(ids: list[int], top: int, start: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` for output tokens ``ids`` (at positions ``start``, ...)."""
    content = []
    for k, token_id in enumerate(ids, start):
        alts = [(token_id * 2654435761 + j + 1) % tokenizer.VOCAB_SIZE for j in range(top)]
        entry = _entry(token_id, k)
        entry["top_logprobs"] = sorted((_entry(a, k) for a in alts), key=lambda e: -float(e["logprob"]))
        content.append(entry)
    return {"content": content}


def choice_jobs(job: Job, n: int) -> list[Job]:
    """The engine requests of an ``n``-choice request (distinct rids and seeds)."""
    return [job] + [dataclasses.replace(job, rid=f"{job.rid}-{i}", seed=job.seed + i) for i in range(1, n)]


def merged_usage(results: list[RequestResult]) -> dict[str, Any]:
    first = results[0]
    completion = sum(r.completion_tokens for r in results)
    f = dataclasses.replace(protocol.finish_of(first), completion_tokens=completion)
    return protocol.usage(f)


def many_body(jobs: list[Job], results: list[RequestResult], opts: ChoiceOptions) -> dict[str, Any]:
    """The non-streaming body of an ``n``-choice chat request."""
    job = jobs[0]
    finishes = [protocol.finish_of(r) for r in results]
    body = protocol.chat_response(job.rid, job.created, job.model, tokenizer.decode(results[0].output_ids),
                                  finishes[0], job.sglext)
    template = body["choices"][0]
    body["choices"] = [{**template, "index": i, "message": {**template["message"],
                                                            "content": tokenizer.decode(r.output_ids)},
                        "finish_reason": f.reason, "matched_stop": f.matched_stop,
                        "logprobs": token_logprobs(r.output_ids, opts.top_logprobs) if opts.logprobs else None}
                       for i, (r, f) in enumerate(zip(results, finishes, strict=True))]
    body["usage"] = merged_usage(results)
    return body


def _chunk(rid: str, job: Job, index: int, delta: dict[str, Any], finish: protocol.Finish | None = None,
           logprobs: dict[str, Any] | None = None) -> bytes:
    return protocol.sse({"id": rid, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                         "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish.reason if finish else None,
                                      "matched_stop": finish.matched_stop if finish else None}]})


async def many_events(jobs: list[Job], listeners: list[Listener], opts: ChoiceOptions,
                      results: list[RequestResult | None],
                      error: Callable[[Job], bytes]) -> AsyncIterator[bytes]:
    """The interleaved stream of an ``n``-choice request; ``results`` fills as choices end."""
    queue: asyncio.Queue[tuple[int, list[int], RequestResult | None]] = asyncio.Queue()

    async def pump(i: int, listener: Listener) -> None:
        async for tokens, result in listener.updates():
            queue.put_nowait((i, tokens, result))

    tasks = [asyncio.ensure_future(pump(i, lst)) for i, lst in enumerate(listeners)]
    started, done, emitted = [False] * len(jobs), 0, [0] * len(jobs)
    try:
        while done < len(jobs):
            i, tokens, result = await queue.get()
            job = jobs[i]
            if result is not None and protocol.refused(result):
                results[i] = result
                yield error(job)
                return
            if not started[i]:
                started[i] = True
                yield _chunk(job.rid, job, i, {"reasoning_content": None, "role": "assistant", "content": ""})
            if tokens:
                lp = token_logprobs(tokens, opts.top_logprobs, emitted[i]) if opts.logprobs else None
                emitted[i] += len(tokens)
                yield _chunk(job.rid, job, i, {"reasoning_content": None, "content": tokenizer.decode(tokens)},
                             logprobs=lp)
            if result is not None:
                results[i] = result
                done += 1
                yield _chunk(job.rid, job, i, {"reasoning_content": None}, protocol.finish_of(result))
        final = [r for r in results if r is not None]
        if jobs[0].include_usage:
            yield protocol.sse({"id": jobs[0].rid, "object": "chat.completion.chunk", "created": jobs[0].created,
                                "model": jobs[0].model, "choices": [], "usage": merged_usage(final)})
        yield protocol.DONE
    finally:
        for task in tasks:
            task.cancel()


async def first_of(waiter: Awaitable[list[RequestResult]], gone: Awaitable[None]) -> list[RequestResult] | None:
    """Every choice's result, or None when the client left first."""
    wait = asyncio.ensure_future(waiter)
    leave = asyncio.ensure_future(gone)
    try:
        await asyncio.wait((wait, leave), return_when=asyncio.FIRST_COMPLETED)
        return wait.result() if wait.done() else None
    finally:
        wait.cancel()
        leave.cancel()
