"""The gateway's Prometheus metrics, all in one place, on the gateway's own registry.

Names are layered (``kvgate_<thing>_<unit>``) and labels bounded: ``endpoint`` (chat,
completions, generate, models, ...), ``status`` (HTTP code), ``policy``, ``reason`` (the
policy's small vocabulary), ``replica`` (fleet size), ``state``, ``tier``, ``plugin``,
``model`` (a model some replica serves, after aliases: ``served_models``; any other name,
and a request refused before its model was read, counts as ``other``: never a
client-chosen string; on ``kvgate_desired_replicas`` the scale group, a replica's served
names joined by ``,``, ``""`` while unknown: gateway/scaling.py).

Request-path metrics are updated as requests go; fleet gauges (replica state, load,
index sizes) are refreshed from the registry and the index when ``/metrics`` is scraped
(``refresh_fleet``), so they cost nothing between scrapes.

The process's own, read at scrape as well: ``python_gc_*`` (the garbage collector's
collections and the objects they found, per generation: cyclic garbage a request leaves
behind shows here, and a collection of it is a pause on some request's path) and
``process_*`` (CPU seconds, resident memory, open files).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefix_index.base import IndexStats, ReplicaId
from replicas.admission import RELEASES
from replicas.model import ReplicaState, ReplicaView
from replicas.outlier import REASONS as EJECTION_REASONS
from replicas.scale import ScaleAdvice

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds; spans fast cache hits to long prefills of huge prompts
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
# predicted minus reported cached tokens (precise mode aims at |error| < one page)
PREDICTION_ERROR_BUCKETS = (-65536, -16384, -4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096,
                            16384, 65536)
KV_EVENT_OUTCOMES = ("gap", "healed", "lost", "restart", "cleared", "decode_error")
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
HIT_RATIO_WINDOW = 256  # requests in the "recent" cache hit ratio
# causes of kvgate_upstream_retries_total (gateway/proxy.py's table); children made up front
# every child of a labelled counter with a fixed vocabulary exists from start-up, at 0, so a
# dashboard panel or an alert's rate() shows 0 rather than "No data" until the first event
REJECT_REASONS = ("concurrency_cap", "body_timeout", "shutting_down")  # kvgate_requests_rejected_total
SCALE_STAGES = ("index", "annotate", "tick")  # kvgate_scale_errors_total
OTHER_MODEL = "other"  # the model label of a request for a model no replica serves
RETRY_REASONS = ("connect", "disconnect", "head_timeout", "first_byte_timeout", "status_429", "status_503",
                 "status_5xx")


class GatewayMetrics:
    """Owns a ``CollectorRegistry`` (so tests and several apps in one process never clash)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        GCCollector(registry=r)
        ProcessCollector(registry=r)
        # the model ids replicas serve (the gateway sets the registry's served_models): the model label's values
        self.served_models: Callable[[], frozenset[str]] = frozenset
        self.requests = Counter("kvgate_requests", "Requests answered, by endpoint, HTTP status and model",
                                ["endpoint", "status", "model"], registry=r)
        self.route_decisions = Counter("kvgate_route_decisions", "Routing decisions by policy and reason",
                                       ["policy", "reason"], registry=r)
        self.predicted_cached_tokens = Counter(
            "kvgate_predicted_cached_tokens", "Prompt tokens the policy predicted cached", registry=r)
        self.reported_cached_tokens = Counter(
            "kvgate_reported_cached_tokens", "Prompt tokens replicas reported cached (usage)", registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens replicas reported (usage)",
                                     registry=r)
        self.cache_hit_ratio = Gauge(
            "kvgate_cache_hit_ratio",
            f"Reported cached / prompt tokens over the last {HIT_RATIO_WINDOW} requests with usage",
            registry=r)
        self.ttft = Histogram("kvgate_request_ttft_seconds", "Time to the first body byte from the replica",
                              ["model"], buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvgate_inter_token_latency_seconds",
                             "Mean gap between output tokens of a streamed request",
                             ["model"], buckets=ITL_BUCKETS_S, registry=r)
        self.duration = Histogram("kvgate_request_duration_seconds", "Whole request, arrival to last byte",
                                  ["endpoint", "model"], buckets=DURATION_BUCKETS_S, registry=r)
        self.replica_state = Gauge("kvgate_replica_state", "1 for the replica's current state",
                                   ["replica", "state"], registry=r)
        self.replica_in_flight = Gauge("kvgate_replica_in_flight", "Requests routed and not finished",
                                       ["replica"], registry=r)
        self.replica_pending_prefill = Gauge(
            "kvgate_replica_pending_prefill_tokens", "Predicted uncached tokens not yet at first byte",
            ["replica"], registry=r)
        self.index_blocks = Gauge("kvgate_index_blocks", "Blocks the index believes a replica holds",
                                  ["replica", "tier"], registry=r)
        self.index_degraded = Counter("kvgate_index_degraded",
                                      "Index calls that failed or timed out (routing lost affinity)",
                                      registry=r)
        self.upstream_retries = Counter("kvgate_upstream_retries",
                                        "Attempts retried on another replica, by cause", ["reason"], registry=r)
        self.retry_budget_exhausted = Counter(
            "kvgate_retry_budget_exhausted", "Retries not made because the fleet-wide retry budget was spent",
            registry=r)
        self.replica_ejections = Counter(
            "kvgate_replica_ejections", "Outlier ejections, by replica and reason (consecutive, failure_rate, "
            "probe_timeout)", ["replica", "reason"], registry=r)
        self.replica_ejected = Gauge("kvgate_replica_ejected", "1 while the replica is ejected as an outlier",
                                     ["replica"], registry=r)
        self.replica_prefill_rate = Gauge(
            "kvgate_replica_prefill_tokens_per_second",
            "The replica's learned uncached prefill rate, as the cost model prices it", ["replica"], registry=r)
        self.replica_decode_step = Gauge(
            "kvgate_replica_decode_step_seconds",
            "The replica's learned decode step, as the cost model prices it", ["replica"], registry=r)
        self.replica_accept_length = Gauge(
            "kvgate_replica_spec_accept_length",
            "The replica's speculative accept length from /v1/loads, smoothed", ["replica"], registry=r)
        self.plugin_seconds = Counter("kvgate_policy_plugin_seconds",
                                      "Time spent in each policy plugin", ["plugin"], registry=r)
        self.desired_replicas = Gauge("kvgate_desired_replicas",
                                      "Replicas a model's pool needs (cache working set, queueing); KEDA's signal",
                                      ["model"], registry=r)
        self.replica_cache_value = Gauge(
            "kvgate_replica_cache_value_tokens",
            "What removing the replica would lose: resident session tokens + recent hits + in flight",
            ["replica"], registry=r)
        self.replica_deletion_cost = Gauge("kvgate_replica_deletion_cost",
                                           "pod-deletion-cost the gateway asks for (lowest goes first)",
                                           ["replica"], registry=r)
        self.policy_errors = Counter("kvgate_policy_errors", "Policy hooks that raised (a bug: logged, the "
                                     "request unaffected), by hook", ["hook"], registry=r)
        for hook in ("on_routed", "on_completed"):
            self.policy_errors.labels(hook)
        self.scale_errors = Counter("kvgate_scale_errors", "Scale loop failures, by stage (index, annotate, tick)",
                                    ["stage"], registry=r)
        for stage in SCALE_STAGES:
            self.scale_errors.labels(stage)
        # client edge (gateway/server.py): requests refused by a bound
        self.requests_rejected = Counter(
            "kvgate_requests_rejected", "Requests refused before routing, by cause (concurrency_cap, "
            "body_timeout, shutting_down)", ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(reason)
        self.streams_cut_at_shutdown = Counter(
            "kvgate_streams_cut_at_shutdown", "Streams still open at the end of the shutdown grace (ended "
            "with an SSE error event)", registry=r)
        self.admin_requests = Counter("kvgate_admin_requests", "Admin API calls, by route and HTTP status",
                                      ["route", "status"], registry=r)
        # session table (prefix_index): size and LRU evictions, refreshed on scrape
        self.session_table_sessions = Gauge("kvgate_session_table_sessions", "Sessions in the session table",
                                            registry=r)
        self.session_table_evictions = Counter(
            "kvgate_session_table_evictions", "Sessions evicted from the session table by its size bound",
            registry=r)
        # precise mode (issue 13): KV events and how well the index predicts cached tokens
        self.prediction_error = Histogram(
            "kvgate_prediction_error_tokens", "Predicted minus reported cached tokens of the chosen replica, per "
            "request, by index mode (precise: from the replica's KV events)", ["mode"],
            buckets=PREDICTION_ERROR_BUCKETS, registry=r)
        self.kv_events_applied = Counter("kvgate_kv_events_applied", "KV events applied to the precise index",
                                         ["replica"], registry=r)
        self.kv_event_streams = Counter(
            "kvgate_kv_event_streams", "KV event stream incidents by outcome (gap: batches missed; healed: "
            "replayed; lost: not replayable, replica uncertain; restart; cleared: AllBlocksCleared; "
            "decode_error)", ["outcome"], registry=r)
        for outcome in KV_EVENT_OUTCOMES:
            self.kv_event_streams.labels(outcome)
        self.kv_subscriber_restarts = Counter(
            "kvgate_kv_subscriber_restarts", "KV-event subscribers restarted after they stopped (an exception, "
            "a socket failure); the replica is routed approximately until its stream is live again",
            ["replica"], registry=r)
        self.precise_replicas = Gauge("kvgate_precise_replicas",
                                      "Replicas with KV events, by state (precise; uncertain: a batch lost; joining: streams not live yet)",
                                      ["state"], registry=r)
        # precise mode's tokenizer (issue 42): model dirs it cannot reproduce, and the worker pool
        self.precise_unreproducible = Gauge(
            "kvgate_precise_unreproducible_replicas",
            "Replicas with KV events routed approximately because precise mode cannot reproduce their "
            "tokenization exactly, by reason (gateway/precise_formats.py REASONS)", ["reason"], registry=r)
        self.precise_tokenize = Counter(
            "kvgate_precise_tokenize", "Precise-mode prompt tokenizations by outcome (ok; deadline, queue_full: "
            "the pool's bounds, routed approximately; not_reproducible: this prompt cannot be reproduced exactly)",
            ["outcome"], registry=r)
        self.precise_tokenize_seconds = Histogram(
            "kvgate_precise_tokenize_seconds", "Wait for a precise-mode prompt's page hashes (queue + work in "
            "the tokenizer pool), per request", registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        self.admission_held = Gauge("kvgate_admission_held",
                                    "Streaming requests admission holds for the replica (gateway/admission.py)",
                                    ["replica"], registry=r)
        self.admission_wait = Histogram(
            "kvgate_admission_wait_seconds", "How long held requests waited, by how they were released "
            "(budget: a prefill ahead ended, smallest first; fairness: the bypass bound, oldest first; "
            "age: max_wait_s; flush: the replica left routing)",
            ["released_by"], buckets=TTFT_BUCKETS_S, registry=r)
        for released_by in RELEASES:
            self.admission_wait.labels(released_by)
        self._prediction_errors = {mode: self.prediction_error.labels(mode) for mode in ("precise", "approximate")}
        self._hits: deque[tuple[int, int]] = deque(maxlen=HIT_RATIO_WINDOW)
        self._hit_sums = [0, 0]  # cached, prompt over the window
        self._seen: dict[str, float] = {}
        # label children cached on the request path (label lookups are not free)
        self._done: dict[tuple[str, int, str], tuple[Any, Any]] = {}
        self._timings: dict[str, tuple[Any, Any]] = {}
        self._decisions: dict[tuple[str, str], Any] = {}
        self._retries = {reason: self.upstream_retries.labels(reason) for reason in RETRY_REASONS}

    # -- request path -------------------------------------------------------------
    def model_label(self, model: str) -> str:
        """``model`` when a replica serves it, else ``OTHER_MODEL`` (bounded cardinality)."""
        return model if model in self.served_models() else OTHER_MODEL

    def request_done(self, endpoint: str, status: int, duration_s: float, model: str = OTHER_MODEL) -> None:
        """One answered request; ``model``: the request's (served) model, when it was read."""
        key = (endpoint, status, self.model_label(model))
        children = self._done.get(key)
        if children is None:
            children = self._done[key] = (self.requests.labels(endpoint, str(status), key[2]),
                                          self.duration.labels(endpoint, key[2]))
        children[0].inc()
        children[1].observe(duration_s)

    def prediction(self, mode: str, predicted_cached_tokens: int, reported_cached_tokens: int) -> None:
        """One request's prediction error (``mode``: "precise" or "approximate")."""
        self._prediction_errors[mode].observe(predicted_cached_tokens - reported_cached_tokens)

    def kv_stream(self, outcome: str, n: int = 1) -> None:
        self.kv_event_streams.labels(outcome).inc(n)

    def routed(self, policy: str, reason: str, predicted_cached_tokens: int) -> None:
        child = self._decisions.get((policy, reason))
        if child is None:
            child = self._decisions[(policy, reason)] = self.route_decisions.labels(policy, reason)
        child.inc()
        if predicted_cached_tokens > 0:
            self.predicted_cached_tokens.inc(predicted_cached_tokens)

    def usage(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """Feedback from a response's ``usage``; updates the recent hit ratio."""
        if prompt_tokens is None:
            return
        cached = cached_tokens or 0
        self.prompt_tokens.inc(prompt_tokens)
        self.reported_cached_tokens.inc(cached)
        if len(self._hits) == self._hits.maxlen:
            old_cached, old_prompt = self._hits[0]
            self._hit_sums[0] -= old_cached
            self._hit_sums[1] -= old_prompt
        self._hits.append((cached, prompt_tokens))
        self._hit_sums[0] += cached
        self._hit_sums[1] += prompt_tokens
        if self._hit_sums[1] > 0:
            self.cache_hit_ratio.set(self._hit_sums[0] / self._hit_sums[1])

    def timing(self, ttft_s: float | None, itl_s: float | None, model: str) -> None:
        label = self.model_label(model)
        children = self._timings.get(label)
        if children is None:
            children = self._timings[label] = (self.ttft.labels(label), self.itl.labels(label))
        if ttft_s is not None:
            children[0].observe(ttft_s)
        if itl_s is not None:
            children[1].observe(itl_s)

    def admission_waited(self, released_by: str, seconds: float) -> None:
        self.admission_wait.labels(released_by).observe(seconds)

    def retry(self, reason: str) -> None:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self.upstream_retries.labels(reason)
        child.inc()

    def retry_budget_spent(self) -> None:
        self.retry_budget_exhausted.inc()

    # -- scale loop ------------------------------------------------------------------
    def scale_advice(self, advice: Mapping[str, ScaleAdvice]) -> None:
        """Set from every evaluation of the scale loop (gateway/scaling.py): the advice per
        model group (a group gone loses its series)."""
        self.desired_replicas.clear()
        self.replica_cache_value.clear()
        self.replica_deletion_cost.clear()
        for model, group in advice.items():
            self.desired_replicas.labels(model).set(group.desired_replicas)
            for heat in group.ranking:
                self.replica_cache_value.labels(heat.url).set(heat.value)
                self.replica_deletion_cost.labels(heat.url).set(group.deletion_costs.get(heat.url, 0))

    def policy_error(self, hook: str) -> None:
        self.policy_errors.labels(hook).inc()

    def scale_error(self, stage: str) -> None:
        self.scale_errors.labels(stage).inc()

    # -- cumulative totals kept elsewhere, folded in on scrape ---------------------
    def _advance(self, key: str, total: float) -> float:
        """The increase of a cumulative ``total`` since the last scrape (never negative)."""
        delta = total - self._seen.get(key, 0.0)
        self._seen[key] = max(total, self._seen.get(key, 0.0))
        return max(delta, 0.0)

    def plugin_time(self, total_seconds_by_plugin: Mapping[str, float]) -> None:
        """Fold in the policy framework's cumulative per-plugin seconds."""
        for plugin, total in total_seconds_by_plugin.items():
            delta = self._advance("plugin:" + plugin, total)
            if delta:
                self.plugin_seconds.labels(plugin).inc(delta)
            else:
                self.plugin_seconds.labels(plugin)  # show the plugin even before it costs anything

    def index_degraded_backend(self, total: int) -> None:
        """Fold in the index backend's own count of degraded calls (Redis down or slow)."""
        delta = self._advance("index_degraded", float(total))
        if delta:
            self.index_degraded.inc(delta)

    def ejections(self, totals: Mapping[tuple[ReplicaId, str], int], replicas: Iterable[str]) -> None:
        """Fold in the registry's cumulative ejection counts; every (replica, reason) child
        exists from the replica's first scrape on, at 0 until it is ejected."""
        for replica in replicas:
            for reason in EJECTION_REASONS:
                self.replica_ejections.labels(replica, reason)
        for (replica, reason), total in totals.items():
            delta = self._advance(f"eject:{replica}:{reason}", float(total))
            if delta:
                self.replica_ejections.labels(replica, reason).inc(delta)

    # -- fleet gauges, refreshed on scrape ----------------------------------------
    def refresh_fleet(self, views: Iterable[ReplicaView], stats: IndexStats | None) -> None:
        for gauge in (self.replica_state, self.replica_in_flight, self.replica_pending_prefill,
                      self.index_blocks, self.replica_ejected, self.admission_held,
                      self.replica_prefill_rate, self.replica_decode_step, self.replica_accept_length):
            gauge.clear()  # replicas that left disappear from the exposition
        for view in views:
            for state in ReplicaState:
                self.replica_state.labels(view.id, state.value).set(1.0 if view.state is state else 0.0)
            self.replica_in_flight.labels(view.id).set(view.in_flight)
            self.replica_pending_prefill.labels(view.id).set(view.pending_prefill_tokens)
            self.replica_ejected.labels(view.id).set(1.0 if view.ejected else 0.0)
            self.admission_held.labels(view.id).set(len(view.held_prefill))
            if view.prefill_tokens_per_s is not None:
                self.replica_prefill_rate.labels(view.id).set(view.prefill_tokens_per_s)
            if view.decode_step_s is not None:
                self.replica_decode_step.labels(view.id).set(view.decode_step_s)
            if view.spec_accept_length is not None:
                self.replica_accept_length.labels(view.id).set(view.spec_accept_length)
        if stats is not None:
            self.session_table_sessions.set(getattr(stats, "sessions", 0))
            delta = self._advance("session_evictions", float(getattr(stats, "session_evictions", 0)))
            if delta:
                self.session_table_evictions.inc(delta)
            for replica, blocks in stats.device_blocks.items():
                self.index_blocks.labels(replica, "device").set(blocks)
            for replica, blocks in stats.host_blocks.items():
                self.index_blocks.labels(replica, "host").set(blocks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
