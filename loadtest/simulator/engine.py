"""The simulated SGLang replica: a discrete-event model of one scheduler.

The engine never sleeps and never reads the wall clock: every call carries ``now_s``
(simulated seconds) and callbacks fire with the simulated time of the step that caused
them. ``clock.py`` drives it in real time (asyncio) or in virtual time (a fleet).

Scheduling (SGLang's unified scheduler, no mixed chunk):
* FCFS waiting queue; at every step boundary the head is admitted while the running
  count (prefilling + decoding) is below ``max_running_requests`` and its KV fits
  (``PagedPrefixCache.try_admit``: device pool minus pinned/private). The reservation is
  the uncached prompt plus the request's whole output (the model knows the output
  length, so SGLang's retraction never has to happen). A request that could never fit
  (or whose prompt reaches ``context_length``) is aborted at submit.
* Prefill is chunked (``chunked_prefill_size`` tokens per step, possibly spanning several
  requests); a chunk takes ``uncached/prefill_tokens_per_s + host_hit/host_load_tokens_per_s``
  (load-back charged with the request's first chunk). A prompt's full pages join the
  cache at the end of each chunk; the first output token is emitted at the end of the
  last chunk. While requests are decoding, prefill chunks and decode steps alternate.
* A decode step takes ``decode_step_base_s + decode_step_per_ctx_s * sum(ctx)/100_000``
  and yields the profile's accept length *for that request* on average
  (``Profile.accept_length``: ``spec_accept_length``, or ``spec_accept_length_prose`` for a
  ``SimRequest.prose`` request): each request keeps an integer accumulator in thousandths
  of a token (``acc += round(1000*accept)``; emit ``acc // 1000``), seeded by its key, so
  the draw is exact and deterministic.
* Runs of decode steps with no prefill work are planned at once with numpy
  (``_plan_decode``: tokens per request per step from the accumulators, step durations,
  cumulative end times): the run ends at the first step where a request finishes;
  ``advance`` consumes the steps ending by ``now_s``. A ``submit`` or ``abort`` cuts the
  plan after the step in progress, so results do not depend on how often ``advance`` is
  called (listeners may call ``submit`` from their callbacks).
* On finish, prompt + output (minus the last token) full pages are cached, as SGLang does.
* ``SimRequest.stream``: ``True`` calls ``on_tokens`` for every emission; ``"first"`` only
  for the first token (the end of prefill: virtual-time load tests need the time to first
  token, not the ids); ``False`` never (results only). Counters, the recent window and
  ``snapshot`` live in ``stats.py``.
* KV events (``attach_events``, off by default): the engine names the pages it commits
  from their token ids (``EventRecorder.name``: SGLang's page hash, ``kv_publisher.py``),
  the cache reports every page move to the same recorder, and the engine closes one batch
  per scheduler step (the end of ``_schedule``) and on ``flush_cache``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from loadtest.simulator import stats, tokenizer
from loadtest.simulator.kvcache import CacheObserver, PagedPrefixCache
from loadtest.simulator.profile import Profile
from loadtest.simulator.requests import RequestListener, RequestResult, SimRequest
from loadtest.simulator.stats import EngineStats

__all__ = ["EngineStats", "ReplicaEngine", "RequestListener", "RequestResult", "SimRequest"]

MILLI = 1000
MAX_PLAN_STEPS = 4096  # bound on one planned decode run (memory n x steps)


class EventRecorder(CacheObserver, Protocol):
    """The cache's observer that also names pages and batches events per step."""

    def name(self, parent: int | None, pages: Sequence[int], tokens: npt.NDArray[Any]) -> None: ...

    def end_step(self, ts: float) -> None: ...


@dataclass
class _Live:
    """Engine-side state of one request."""

    req: SimRequest
    listener: RequestListener
    arrival_s: float
    hashes: list[int]
    key: int
    out_len: int
    finish_reason: str
    acc: int  # speculative accumulator, thousandths of a token
    accept: int  # its accept length, thousandths of a token per decode step
    path: list[int] = field(default_factory=list)  # pinned pages
    private: int = 0  # reserved private KV tokens
    cached_device: int = 0
    cached_host: int = 0
    load_pending: int = 0
    prefill_left: int = 0
    computed: int = 0
    generated: int = 0
    verify_ct: int = 0
    admit_s: float | None = None
    first_token_s: float | None = None
    aborted: bool = False
    submit_match: int = 0  # cached tokens when submitted (waiting-queue estimates)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def ctx(self) -> int:
        return self.prompt_len + self.generated


@dataclass
class _Prefill:
    start_s: float
    end_s: float
    parts: list[tuple[_Live, int]]


@dataclass
class _DecodeRun:
    """A planned run of decode steps over a fixed batch (see module docstring)."""

    lives: list[_Live]
    start_s: float
    t_end: npt.NDArray[np.float64]  # (K,) end time of each step
    cum: npt.NDArray[np.int64]  # (n, K+1) tokens emitted by request i after k steps
    gen0: list[int]
    acc0: list[int]
    done: int = 0  # steps consumed
    limit: int = 0  # steps in the run (cut by submit/abort)

    @property
    def next_end_s(self) -> float:
        return float(self.t_end[self.done])


class ReplicaEngine:
    """One simulated replica (see module docstring).

    ``seed`` is kept for callers that want per-replica variation; outputs depend only on
    the request (prompt and ``SimRequest.seed``), so equal requests get equal outputs on
    every replica.
    """

    def __init__(self, profile: Profile, seed: int = 0) -> None:
        self.profile = profile
        self.seed = seed
        self.cache = PagedPrefixCache(profile.page_size, profile.device_tokens, profile.host_tokens)
        self._waiting: deque[_Live] = deque()
        self._prefilling: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._lives: dict[str, _Live] = {}
        self._step: _Prefill | _DecodeRun | None = None
        self._last_was_prefill = False
        self._now = 0.0
        self.window = stats.RecentWindow(profile.recent_window_s)
        self.totals = stats.EngineTotals()
        self.events: EventRecorder | None = None

    def attach_events(self, recorder: EventRecorder) -> None:
        """Publish KV events from now on (attach before the first request)."""
        self.events = recorder
        self.cache.observer = recorder

    # -- public API --------------------------------------------------------------------
    @property
    def now_s(self) -> float:
        return self._now

    def submit(self, req: SimRequest, listener: RequestListener, now_s: float) -> None:
        self.advance(now_s)
        live = self._make_live(req, listener, now_s)
        if live is None:
            return
        self._lives[req.rid] = live
        self._waiting.append(live)
        self._cut_run()
        if self._step is None:
            self._schedule(now_s)

    def cached_tokens(self, rid: str) -> int:
        """Cached prompt tokens (device + host) of a request still in the engine, else 0."""
        live = self._lives.get(rid)
        return 0 if live is None else int(live.cached_device + live.cached_host)

    def abort(self, rid: str, now_s: float) -> None:
        self.advance(now_s)
        live = self._lives.get(rid)
        if live is None or live.aborted:
            return
        live.aborted = True
        if live in self._waiting:
            self._waiting.remove(live)
            self._finish(live, now_s)
            return
        self._cut_run()

    def next_event_s(self) -> float | None:
        """End of the step in progress (None when idle)."""
        step = self._step
        if step is None:
            return None
        return step.end_s if isinstance(step, _Prefill) else step.next_end_s

    def next_milestone_s(self) -> float | None:
        """Next time a request can get its first token or finish (None when idle)."""
        step = self._step
        if step is None:
            return None
        return step.end_s if isinstance(step, _Prefill) else float(step.t_end[step.limit - 1])

    def advance(self, now_s: float) -> None:
        """Run every step that ends by ``now_s``, firing callbacks at their times."""
        while self._step is not None:
            step = self._step
            if isinstance(step, _Prefill):
                if step.end_s > now_s:
                    break
                self._complete_prefill(step)
                self._schedule(step.end_s)
                continue
            end = self._consume_run(step, now_s)
            if end is None:
                break
            self._schedule(end)
        self._now = max(self._now, now_s)

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        flushed = self.cache.flush()
        if self.events is not None:
            self.events.end_step(self._now)
        return flushed

    def is_idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._running)

    def snapshot(self) -> EngineStats:
        """Loads, cache and counters at the engine's current simulated time."""
        waiting = self._waiting
        queues = stats.QueueLoads(
            prefilling=len(self._prefilling),
            decoding=len(self._running),
            waiting=len(waiting),
            waiting_prompt_tokens=sum(x.prompt_len for x in waiting),
            waiting_uncached_tokens=sum(x.prefill_left for x in self._prefilling)
            + sum(x.prompt_len - x.submit_match for x in waiting),
            decode_sum_seq_lens=sum(x.ctx for x in self._running),
            max_running=self.profile.max_running_requests,
        )
        return stats.build_stats(self._now, queues, self.cache, self.totals, self.window)

    # -- request set-up ----------------------------------------------------------------
    def _make_live(self, req: SimRequest, listener: RequestListener, now_s: float) -> _Live | None:
        prompt_len = len(req.prompt_ids)
        key = tokenizer.request_key(req.prompt_ids, req.seed)
        room = max(0, self.profile.context_length - prompt_len)
        if req.ignore_eos:
            out_len, reason = req.max_new_tokens, "length"
        else:
            natural = tokenizer.natural_output_length(key, self.profile.default_output_tokens)
            out_len = min(natural, req.max_new_tokens)
            reason = "stop" if natural < req.max_new_tokens else "length"
        if out_len > room:
            out_len, reason = room, "length"
        live = _Live(
            req,
            listener,
            now_s,
            self.cache.hashes(req.prompt_ids) if req.page_hashes is None else req.page_hashes,
            key,
            max(out_len, 1),
            reason,
            key % MILLI,
            round(self.profile.accept_length(req.prose) * MILLI),
        )
        live.submit_match = self.cache.match(live.hashes).tokens
        too_big = prompt_len + live.out_len > self.cache.device_total_tokens
        if prompt_len == 0 or room == 0 or too_big:
            live.aborted = True
            self._finish(live, now_s)
            return None
        return live

    def _admit(self, now_s: float) -> None:
        limit = self.profile.max_running_requests
        cache = self.cache
        while self._waiting and len(self._prefilling) + len(self._running) < limit:
            live = self._waiting[0]
            max_pages = (live.prompt_len - 1) // self.profile.page_size
            match = cache.match(live.hashes, max_pages)
            private = live.prompt_len - match.tokens + live.out_len
            path = cache.try_admit(live.hashes, match, private)
            if path is None:
                break
            self._waiting.popleft()
            live.path = path
            live.private = private
            live.cached_device, live.cached_host = match.device_tokens, match.host_tokens
            live.load_pending = match.host_tokens
            live.computed = match.tokens
            live.prefill_left = live.prompt_len - match.tokens
            live.admit_s = now_s
            self.window.add_admission(now_s, match.tokens, live.prompt_len)
            self._prefilling.append(live)

    # -- scheduling ----------------------------------------------------------------------
    def _schedule(self, now_s: float) -> None:
        """At a step boundary: admit, then start the next step (or go idle)."""
        self._sweep_aborted(now_s)
        self._admit(now_s)
        self._plan_next(now_s)
        if self.events is not None:
            self.events.end_step(now_s)

    def _plan_next(self, now_s: float) -> None:
        if self._prefilling and (not self._running or not self._last_was_prefill):
            self._step = self._plan_prefill(now_s)
            self._last_was_prefill = True
        elif self._running:
            self._step = self._plan_decode(now_s, single=bool(self._prefilling))
            self._last_was_prefill = False
        else:
            self._step = None
            if self._waiting:  # nothing running and the head still does not fit: abort it
                live = self._waiting.popleft()
                live.aborted = True
                self._finish(live, now_s)
                self._schedule(now_s)

    def _sweep_aborted(self, now_s: float) -> None:
        for queue in (self._prefilling, self._running):
            for live in [x for x in queue if x.aborted]:
                queue.remove(live)
                self._finish(live, now_s)

    def _cut_run(self) -> None:
        step = self._step
        if isinstance(step, _DecodeRun):
            step.limit = min(step.limit, step.done + 1)

    def _plan_prefill(self, now_s: float) -> _Prefill:
        budget = self.profile.chunked_prefill_size
        parts: list[tuple[_Live, int]] = []
        duration = 0.0
        for live in self._prefilling:
            take = min(live.prefill_left, budget)
            duration += take / self.profile.prefill_tokens_per_s
            duration += live.load_pending / self.profile.host_load_tokens_per_s
            live.load_pending = 0
            parts.append((live, take))
            budget -= take
            if budget <= 0:
                break
        return _Prefill(now_s, now_s + duration, parts)

    def _complete_prefill(self, step: _Prefill) -> None:
        t = step.end_s
        page = self.profile.page_size
        self.totals.prefill_busy_s += step.end_s - step.start_s
        first_tokens = 0
        for live, take in step.parts:
            live.prefill_left -= take
            live.computed += take
            self.totals.prefill_uncached_tokens += take
            full = min(live.computed // page, len(live.hashes))
            start = len(live.path)
            self._commit(live, live.hashes[start:full], live.req.prompt_ids[start * page : full * page])
            if not live.aborted and live.prefill_left == 0:
                self._prefilling.remove(live)
                live.generated = 1
                live.first_token_s = t
                first_tokens += 1
                if live.req.stream:
                    live.listener.on_tokens(live.req.rid, self._ids(live, 0, 1), t)
                if live.generated >= live.out_len:
                    self._finish(live, t)
                else:
                    self._running.append(live)
        self.window.add_tokens(t, first_tokens, 0)

    def _commit(self, live: _Live, hashes: list[int], tokens: npt.NDArray[Any]) -> None:
        """``hashes`` (pages of ``tokens``) extend the request's path and join the cache."""
        if hashes:
            if self.events is not None:
                self.events.name(live.path[-1] if live.path else None, hashes, tokens)
            self.cache.commit(live.path, hashes)
            live.private -= len(hashes) * self.profile.page_size

    # -- decode runs ---------------------------------------------------------------------
    def _plan_decode(self, now_s: float, single: bool) -> _DecodeRun:
        lives = list(self._running)
        a = np.array([x.accept for x in lives], dtype=np.int64)
        acc0 = np.array([x.acc for x in lives], dtype=np.int64)
        rem = np.array([x.out_len - x.generated for x in lives], dtype=np.int64)
        ctx0 = float(sum(x.ctx for x in lives))
        k_fin = int(np.min(-(-(rem * MILLI - acc0) // a)))
        steps = 1 if single else max(1, min(k_fin, MAX_PLAN_STEPS))
        ks = np.arange(steps + 1, dtype=np.int64)
        cum = (acc0[:, None] + ks[None, :] * a[:, None]) // MILLI - (acc0 // MILLI)[:, None]
        np.minimum(cum, rem[:, None], out=cum)
        ctx_sum = ctx0 + cum[:, :steps].sum(axis=0)
        dt = self.profile.decode_step_base_s + self.profile.decode_step_per_ctx_s * (
            ctx_sum / 100_000.0
        )
        t_end = np.cumsum(np.concatenate(([now_s], dt)))[1:]
        return _DecodeRun(
            lives,
            now_s,
            t_end,
            cum,
            [x.generated for x in lives],
            [x.acc for x in lives],
            limit=steps,
        )

    def _consume_run(self, run: _DecodeRun, now_s: float) -> float | None:
        """Consume the run's steps ending by now_s; return the run's end if it is over."""
        stop = int(np.searchsorted(run.t_end[: run.limit], now_s, side="right"))
        if stop <= run.done:
            return None
        self._emit(run, run.done, stop)
        run.done = stop
        if stop < run.limit:
            return None
        end = float(run.t_end[stop - 1])
        for live in run.lives:
            if not live.aborted and live.generated >= live.out_len:
                self._running.remove(live)
                self._finish(live, end)
        return end

    def _emit(self, run: _DecodeRun, first: int, stop: int) -> None:
        for i, live in enumerate(run.lives):
            if live.aborted:
                continue
            row = run.cum[i]
            if live.req.stream is True:  # "first": the first token came with the prefill
                base = run.gen0[i]
                for k in range(first, stop):
                    lo, hi = int(row[k]), int(row[k + 1])
                    if hi > lo:
                        ids = self._ids(live, base + lo, base + hi)
                        live.listener.on_tokens(live.req.rid, ids, float(run.t_end[k]))
            live.generated = run.gen0[i] + int(row[stop])
            live.acc = (run.acc0[i] + stop * live.accept) % MILLI
            live.verify_ct += stop - first
        tokens = run.cum[:, first + 1 : stop + 1].sum(axis=0) - run.cum[:, first:stop].sum(axis=0)
        n_live = sum(1 for x in run.lives if not x.aborted)
        self.window.add_steps(run.t_end[first:stop], tokens, n_live)
        self.totals.decode_tokens += int(tokens.sum())
        self.totals.verify_calls += n_live * (stop - first)

    # -- finishing -----------------------------------------------------------------------
    def _ids(self, live: _Live, start: int, stop: int) -> list[int]:
        ids: list[int] = tokenizer.output_token_ids(live.key, start, stop).tolist()
        return ids

    def _finish(self, live: _Live, t: float) -> None:
        self._lives.pop(live.req.rid, None)
        reason = "abort" if live.aborted else live.finish_reason
        if live.admit_s is not None:
            if not live.aborted:
                self._cache_output(live)
            self.cache.release(live.path, live.private)
        result = RequestResult(
            live.req.rid,
            live.prompt_len,
            live.generated,
            live.cached_device + live.cached_host,
            live.cached_device,
            live.cached_host,
            reason,
            self._ids(live, 0, live.generated),
            live.verify_ct,
            live.arrival_s,
            live.first_token_s,
            t,
            live.admit_s,
        )
        self.totals.record_finish(result)
        live.listener.on_finish(result, t)

    def _cache_output(self, live: _Live) -> None:
        """Cache prompt + output[:-1] full pages (SGLang's cache_finished_req)."""
        page = self.profile.page_size
        n_prompt_pages = len(live.hashes)
        total = live.prompt_len + live.generated - 1
        if total // page <= n_prompt_pages:
            return
        tail = live.req.prompt_ids[n_prompt_pages * page :]
        out = tokenizer.output_token_ids(live.key, 0, live.generated - 1)
        parent = live.hashes[-1] if live.hashes else 0
        seq = np.concatenate((tail, out))
        extra = self.cache.hashes(seq, parent)
        self._commit(live, extra, seq)
