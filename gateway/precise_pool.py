"""The bounded worker pool that tokenizes and page-hashes precise mode's prompts off the event loop.

A 400 KB conversation new to the gateway costs 190-470 ms of tokenizer CPU. On the event
loop that would hold every other request of the process; the tokenizers (``tokenizers``'
``encode_batch``, ``tiktoken``) release the GIL, so the work goes to ``workers`` threads
and the loop only awaits the answer and matches it against the event index.

Two lanes, so a short job never waits behind a long one: a *heavy* job (a prompt the
gateway has not seen: no session chain for it, and more than ``index.precise_heavy_chars``
of text) goes to the ``workers`` threads of the heavy lane; every other job (a later turn:
its earlier turns are cached, only its new messages are encoded; a small prompt) to the
one thread of the light lane.

Bounds, so a burst of long first turns cannot pile up behind the pool:

- at most ``workers + queue_max`` jobs are accepted at once (running + queued); one more
  is refused at once (``PoolFull``): that request is routed approximately;
- a request waits at most ``deadline_s`` for its job (``PoolDeadline``): it is then routed
  approximately, and the job still finishes in the background, so its segments and its
  session's page-hash chain are cached for the conversation's next turn.

The workers' Python (the chat template, splitting, page hashing) holds the GIL; a loop
that wants it waits for the interpreter's switch interval (5 ms by default) each time. The
pool lowers that interval to ``SWITCH_INTERVAL_S`` (1 ms) for the process, so the loop
waits at most ~1 ms per hand-over (measured: the loop's p50 lag behind a worker rendering
a 400 KB chat went from 5.2 to 1.2 ms); with one thread running Python it changes nothing.

The whole prompt is tokenized by its first request (no per-request budget): within the
deadline it is routed precisely at once. Defaults (``index.precise_*`` settings):
1 heavy worker (a 2-core gateway pod keeps a core for its loop and the light lane), 16 queued, 2 s (a 400 KB first
turn takes 0.2-0.5 s; a prefill of 100k tokens takes seconds, so waiting for the exact
match is worth it, and a stuck job cannot hold a request longer than that).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
SWITCH_INTERVAL_S = 0.001


class PoolBusy(Exception):
    """The request is routed approximately: the pool could not answer in time."""

    outcome = "busy"


class PoolFull(PoolBusy):
    outcome = "queue_full"


class PoolDeadline(PoolBusy):
    outcome = "deadline"


class TokenizePool:
    """``workers`` threads, a queue bound and a per-request deadline (see the module docstring)."""

    def __init__(self, workers: int = 1, queue_max: int = 16, deadline_s: float = 2.0) -> None:
        if workers < 1 or queue_max < 0 or deadline_s <= 0:
            raise ValueError("workers >= 1, queue_max >= 0, deadline_s > 0")
        self.workers, self.queue_max, self.deadline_s = workers, queue_max, deadline_s
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._heavy = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvgate-precise")
        self._light = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-precise-light")
        self.pending = 0  # accepted jobs not finished (running + queued)

    async def run(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        """``fn()`` in a worker of its lane; ``PoolFull`` / ``PoolDeadline`` instead of waiting
        past the bounds."""
        if self.pending >= self.workers + 1 + self.queue_max:
            raise PoolFull(f"{self.pending} tokenization jobs already accepted")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._heavy if heavy else self._light, fn)
        self.pending += 1
        future.add_done_callback(self._finished)
        done, _ = await asyncio.wait({future}, timeout=self.deadline_s)
        if not done:
            raise PoolDeadline(f"not tokenized within {self.deadline_s:g} s")
        return future.result()

    def _finished(self, future: asyncio.Future[Any]) -> None:
        self.pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a job that outlived its request must not log "never retrieved"

    def close(self) -> None:
        """Stop accepting jobs; running ones finish in their threads (not waited for)."""
        self._heavy.shutdown(wait=False, cancel_futures=True)
        self._light.shutdown(wait=False, cancel_futures=True)
