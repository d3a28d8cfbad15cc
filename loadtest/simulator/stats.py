"""What a simulated replica reports: counters, the recent window, and the stats snapshot.

``ReplicaEngine`` (engine.py) owns one :class:`EngineTotals` (cumulative counters, the
replica's Prometheus counters) and one :class:`RecentWindow` (decode steps and
admissions of the last ``recent_window_s`` simulated seconds, for gauges such as
``gen_throughput`` and ``cache_hit_rate``). ``ReplicaEngine.snapshot`` sums its queues
into a :class:`QueueLoads` and :func:`build_stats` turns all of it into one frozen
:class:`EngineStats`, which /metrics, /v1/loads, /get_server_info and the virtual-time
harness (loadtest/fleetsim) read. ``EngineStats`` is re-exported by engine.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadtest.simulator.kvcache import PagedPrefixCache
from loadtest.simulator.requests import RequestResult


@dataclass
class EngineTotals:
    """Cumulative counters (Prometheus counters of the replica)."""

    num_requests: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    prefill_uncached_tokens: int = 0
    prefill_busy_s: float = 0.0
    decode_tokens: int = 0
    verify_calls: int = 0

    def record_finish(self, result: RequestResult) -> None:
        self.num_requests += 1
        self.num_aborted += result.finish_reason == "abort"
        self.prompt_tokens += result.prompt_tokens
        self.generation_tokens += result.completion_tokens
        self.cached_device += result.cached_device
        self.cached_host += result.cached_host


@dataclass(frozen=True)
class EngineStats:
    """Everything /metrics and /v1/loads report, at one simulated instant."""

    now_s: float
    num_running_reqs: int  # prefilling + decoding (they hold KV)
    num_decoding_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int  # KV locked by running requests
    num_total_tokens: int  # num_used_tokens + prompt tokens of queued requests
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    device_cached_tokens: int  # evictable cached pages on the device
    gen_throughput: float  # tokens/s over the recent window
    cache_hit_rate: float  # cached/prompt tokens of admissions in the recent window
    spec_accept_length: float  # tokens per verify step in the recent window
    spec_accept_length_avg: float  # since start (server_info avg_spec_accept_length)
    spec_verify_calls_total: int
    decode_sum_seq_lens: int
    hicache_host_used_tokens: int
    hicache_host_total_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens_total_device: int
    cached_tokens_total_host: int
    evicted_tokens_total: int
    host_dropped_tokens_total: int
    load_back_tokens_total: int
    total_prefill_uncached_tokens: int
    total_prefill_busy_s: float
    num_requests_total: int
    num_aborted_requests_total: int
    is_idle: bool


@dataclass(frozen=True)
class QueueLoads:
    """The engine's queues summed at one instant (the inputs of :func:`build_stats`)."""

    prefilling: int  # admitted, still prefilling
    decoding: int
    waiting: int
    waiting_prompt_tokens: int  # prompt tokens of the waiting queue
    waiting_uncached_tokens: int  # prefill left + waiting prompts minus their cached part
    decode_sum_seq_lens: int  # context of the decoding requests
    max_running: int  # the profile's max_running_requests


class RecentWindow:
    """Sums over the last ``window_s`` simulated seconds (decode steps, admissions)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (step end times, tokens per step, verify calls per step)
        self._steps: deque[tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], int]] = deque()
        self._admissions: deque[tuple[float, int, int]] = deque()

    def add_steps(
        self, t_end: npt.NDArray[np.float64], tokens: npt.NDArray[np.int64], verify_per_step: int
    ) -> None:
        if len(t_end):
            self._steps.append((t_end, tokens, verify_per_step))
            self._prune(float(t_end[-1]) - self.window_s)

    def add_tokens(self, t: float, tokens: int, verify: int) -> None:
        if tokens:
            self._steps.append((np.array([t]), np.array([tokens]), verify))
            self._prune(t - self.window_s)

    def add_admission(self, t: float, cached: int, prompt: int) -> None:
        self._admissions.append((t, cached, prompt))
        self._prune(t - self.window_s)

    def _prune(self, lo: float) -> None:
        while self._steps and self._steps[0][0][-1] <= lo:
            self._steps.popleft()
        while self._admissions and self._admissions[0][0] <= lo:
            self._admissions.popleft()

    def sums(self, now_s: float) -> tuple[int, int, int, int]:
        """(tokens, verify calls, cached tokens, prompt tokens) in (now - window, now]."""
        lo = now_s - self.window_s
        self._prune(lo)
        tokens = verify = 0
        for t_end, toks, per_step in self._steps:
            a = int(np.searchsorted(t_end, lo, side="right"))
            b = int(np.searchsorted(t_end, now_s, side="right"))
            tokens += int(toks[a:b].sum())
            verify += per_step * (b - a)
        cached = sum(c for t, c, _ in self._admissions if t <= now_s)
        prompt = sum(p for t, _, p in self._admissions if t <= now_s)
        return tokens, verify, cached, prompt


def build_stats(
    now_s: float,
    queues: QueueLoads,
    cache: PagedPrefixCache,
    totals: EngineTotals,
    window: RecentWindow,
) -> EngineStats:
    """Loads, cache and counters at ``now_s`` (``ReplicaEngine.snapshot``)."""
    used = cache.locked_tokens
    tokens, verify, cached, prompt = window.sums(now_s)
    elapsed = min(window.window_s, now_s) or window.window_s
    avg_accept = totals.decode_tokens / totals.verify_calls if totals.verify_calls else 0.0
    return EngineStats(
        now_s=now_s,
        num_running_reqs=queues.decoding + queues.prefilling,
        num_decoding_reqs=queues.decoding,
        num_waiting_reqs=queues.waiting,
        num_waiting_uncached_tokens=queues.waiting_uncached_tokens,
        num_used_tokens=used,
        num_total_tokens=used + queues.waiting_prompt_tokens,
        max_total_num_tokens=cache.device_total_tokens,
        max_running_requests=queues.max_running,
        token_usage=used / cache.device_total_tokens,
        device_cached_tokens=cache.device_used_tokens - used,
        gen_throughput=tokens / elapsed,
        cache_hit_rate=cached / prompt if prompt else 0.0,
        spec_accept_length=tokens / verify if verify else avg_accept,
        spec_accept_length_avg=avg_accept,
        spec_verify_calls_total=totals.verify_calls,
        decode_sum_seq_lens=queues.decode_sum_seq_lens,
        hicache_host_used_tokens=cache.host_used_tokens,
        hicache_host_total_tokens=cache.host_total_tokens,
        prompt_tokens_total=totals.prompt_tokens,
        generation_tokens_total=totals.generation_tokens,
        cached_tokens_total_device=totals.cached_device,
        cached_tokens_total_host=totals.cached_host,
        evicted_tokens_total=cache.evicted_tokens_total,
        host_dropped_tokens_total=cache.host_dropped_tokens_total,
        load_back_tokens_total=cache.load_back_tokens_total,
        total_prefill_uncached_tokens=totals.prefill_uncached_tokens,
        total_prefill_busy_s=totals.prefill_busy_s,
        num_requests_total=totals.num_requests,
        num_aborted_requests_total=totals.num_aborted,
        is_idle=queues.prefilling + queues.decoding + queues.waiting == 0,
    )
