"""Prometheus metrics of a simulated replica, with SGLang 0.5.23's names, labels, buckets.

One :class:`SimMetrics` per app, on its own ``CollectorRegistry`` (never the global one),
so several apps can live in one process (tests) without clashing.

- Scheduler gauges carry ``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank``
  (contract §1.6) and are refreshed from the engine's snapshot at scrape time
  (:meth:`SimMetrics.set_scheduler`), the way SGLang refreshes them every batch.
- Tokenizer counters and histograms carry ``model_name, engine_type`` plus
  ``is_streaming`` / ``cache_source`` and are updated when a request finishes
  (:meth:`SimMetrics.observe_request`).
- Latencies are in *simulated* seconds (what the modelled replica would measure).
- Histogram buckets are SGLang's defaults (``metrics_collector.py``).
- As on the real server (checked by tests/sglang_real), the ``hicache_host_*`` gauges
  exist only with HiCache on and ``spec_verify_calls_total`` only with speculative decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)

SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")

# name -> help text of SGLang's scheduler gauges that the simulator reports
SCHEDULER_GAUGES: dict[str, str] = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
    "token_usage": "The token usage.",
    "num_used_tokens": "The number of used tokens.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "page_size": "The page size of the KV cache.",
    "context_len": "The context length of the model.",
    "spec_accept_length": "Mean acceptance length of speculative decoding "
                          "(accepted drafts + bonus token per forward).",
    "spec_accept_rate": "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
    "hicache_host_used_tokens": "Number of tokens currently used in the host KV cache.",
    "hicache_host_total_tokens": "Total capacity of the host KV cache in tokens.",
}


@dataclass(frozen=True, slots=True)
class SchedulerSample:
    """Scheduler gauge values at one instant (from the engine snapshot)."""

    num_running_reqs: int
    num_queue_reqs: int
    gen_throughput: float
    cache_hit_rate: float
    token_usage: float
    num_used_tokens: int
    max_total_num_tokens: int
    page_size: int
    context_len: int
    spec_accept_length: float
    spec_accept_rate: float
    hicache_host_used_tokens: int
    hicache_host_total_tokens: int
    num_grammar_queue_reqs: int = 0


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One finished request, for the tokenizer counters and histograms (simulated s)."""

    streaming: bool
    prompt_tokens: int
    completion_tokens: int
    cached_device: int
    cached_host: int
    ttft_s: float | None
    e2e_s: float
    aborted: bool
    spec_verify_ct: int


class SimMetrics:
    """The SGLang metric families of one simulated replica."""

    def __init__(self, model_name: str, hicache: bool = True, spec: bool = True) -> None:
        # SGLang runs prometheus_client in multiprocess mode, which emits no `_created`
        # samples; this process-wide switch gives the same exposition.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0",
                       "pp_rank": "0", "moe_ep_rank": "0"}
        self._tok = {"model_name": model_name, "engine_type": "unified"}
        reg = self.registry
        self._gauges = {  # SGLang registers the hicache_host_* gauges only with HiCache on
            name: Gauge(f"sglang:{name}", doc, SCHEDULER_LABELS, registry=reg)
            for name, doc in SCHEDULER_GAUGES.items() if hicache or not name.startswith("hicache_")
        }
        streaming = (*TOKENIZER_LABELS, "is_streaming")
        self.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                     streaming, registry=reg)
        self.generation_tokens = Counter("sglang:generation_tokens_total",
                                         "Number of generation tokens processed.", streaming, registry=reg)
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total", "Number of cached prompt tokens by source (device/host/storage).",
            (*TOKENIZER_LABELS, "cache_source"), registry=reg)
        self.num_requests = Counter("sglang:num_requests_total", "Number of requests processed.",
                                    streaming, registry=reg)
        self.num_aborted = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                                   TOKENIZER_LABELS, registry=reg)
        self.spec_verify = Counter("sglang:spec_verify_calls_total",  # only with speculative decoding
                                   "Number of speculative decoding verification calls.",
                                   TOKENIZER_LABELS, registry=reg if spec else None)
        self._spec = spec
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", streaming,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOKENIZER_LABELS,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", streaming,
                             buckets=E2E_BUCKETS, registry=reg)
        for source in ("device", "host"):  # present from the start, like SGLang after a hit
            self.cached_tokens.labels(**self._tok, cache_source=source)

    def set_scheduler(self, s: SchedulerSample) -> None:
        for name, gauge in self._gauges.items():
            gauge.labels(**self._sched).set(float(getattr(s, name)))

    def observe_request(self, r: RequestSample) -> None:
        flag = "true" if r.streaming else "false"
        self.num_requests.labels(**self._tok, is_streaming=flag).inc()
        self.prompt_tokens.labels(**self._tok, is_streaming=flag).inc(r.prompt_tokens)
        self.generation_tokens.labels(**self._tok, is_streaming=flag).inc(r.completion_tokens)
        if r.cached_device:
            self.cached_tokens.labels(**self._tok, cache_source="device").inc(r.cached_device)
        if r.cached_host:
            self.cached_tokens.labels(**self._tok, cache_source="host").inc(r.cached_host)
        if r.spec_verify_ct and self._spec:
            self.spec_verify.labels(**self._tok).inc(r.spec_verify_ct)
        if r.aborted:
            self.num_aborted.labels(**self._tok).inc()
        if r.ttft_s is not None:
            self.ttft.labels(**self._tok, is_streaming=flag).observe(r.ttft_s)
            if r.completion_tokens > 1:
                itl = (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
                self.itl.labels(**self._tok).observe(itl)
        self.e2e.labels(**self._tok, is_streaming=flag).observe(r.e2e_s)

    def count_abort(self) -> None:
        """A request the client left before it finished."""
        self.num_aborted.labels(**self._tok).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
