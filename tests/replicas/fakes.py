"""Fake SGLang replicas behind an ``httpx.MockTransport``, and a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from prefix_index.base import ReplicaId
from replicas.model import ReplicaState, ReplicaView


def server_info_body(
    *,
    max_total_num_tokens: int = 600_000,
    page_size: int = 64,
    dp: int = 1,
    hicache: bool = True,
    hicache_ratio: float | None = 2.0,
    hicache_size: float = 0,
    max_running_requests: int | None = 128,
) -> dict[str, Any]:
    """Shaped like SGLang 0.5.23's /server_info (contract §1.2), trimmed to what matters."""
    state = {
        "world_size": 8,
        "effective_max_running_requests_per_dp": 128,
        "last_gen_throughput": 0.0,
        "memory_usage": {
            "weight": 71.2,
            "kvcache": 40.0,
            "startup_available": 10.0,
            "token_capacity": max_total_num_tokens,
            "token_capacity_swa": None,
            "graph": {},
        },
    }
    return {
        "model_path": "/models/kimi-k2",
        "served_model_name": "kimi-k2",
        "tp_size": 8,
        "dp_size": dp,
        "attn_dp_size": dp,
        "pp_size": 1,
        "ep_size": 1,
        "dcp_size": 1,
        "page_size": page_size,
        "context_length": 131072,
        "mem_fraction_static": 0.85,
        "chunked_prefill_size": 8192,
        "max_running_requests": max_running_requests,
        "enable_hierarchical_cache": hicache,
        "hicache_ratio": hicache_ratio,
        "hicache_size": hicache_size,
        "hicache_host_memory_mode": "cache",
        "hicache_write_policy": "write_through",
        "speculative_algorithm": "EAGLE3",
        "kv_events_config": None,
        "enable_cache_report": True,
        "enable_metrics": True,
        "launch_command": "sglang serve ...",
        "status": "ready",
        "max_total_num_tokens": max_total_num_tokens,
        "max_req_input_len": 131000,
        "hicache_object_layout": "page_first",
        "startup_time": {},
        "kv_events": None,
        "internal_states": [dict(state) for _ in range(dp)],
        "version": "0.5.23",
        "frontend": "python",
    }


def loads_body(*ranks: tuple[int, int, int, float]) -> dict[str, Any]:
    """(running, waiting, waiting_uncached_tokens, token_usage) per DP rank (contract §1.5)."""
    return {
        "timestamp": "2026-01-01T00:00:00+00:00",
        "version": "0.5.23",
        "accelerator": "NVIDIA H200",
        "num_accelerators": 8,
        "loads": [
            {
                "timestamp": 1700000000.5,
                "dp_rank": i,
                "num_running_reqs": run,
                "num_waiting_reqs": wait,
                "num_waiting_uncached_tokens": unc,
                "num_used_tokens": 1000,
                "num_total_tokens": 2000,
                "max_total_num_tokens": 600000,
                "max_running_requests": 128,
                "token_usage": use,
                "gen_throughput": 1520.5,
                "cache_hit_rate": 0.71,
                "utilization": 0.5,
                "queues": {
                    "waiting": wait,
                    "grammar": 0,
                    "paused": 0,
                    "retracted": 0,
                    "prealloc_ready": 0,
                },
            }
            for i, (run, wait, unc, use) in enumerate(ranks)
        ],
    }


@dataclass
class FakeReplica:
    ready: int | None = 200  # None: connection refused; 404: old SGLang without /ready
    health: int = 200
    server_info: dict[str, Any] | None = field(default_factory=server_info_body)
    loads: dict[str, Any] | None = field(default_factory=lambda: loads_body((3, 1, 500, 0.25)))
    model: str = "kimi-k2"
    hung: bool = False  # accepts connections, never answers: requests time out
    calls: list[str] = field(default_factory=list)


class FakeFleet:
    """Replicas by base URL; unknown hosts refuse connections."""

    def __init__(self) -> None:
        self.replicas: dict[str, FakeReplica] = {}

    def add(self, url: str, **kw: Any) -> FakeReplica:
        rep = FakeReplica(**kw)
        self.replicas[url] = rep
        return rep

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        rep = self.replicas.get(base)
        if rep is None or rep.ready is None:
            raise httpx.ConnectError("connection refused", request=request)
        if rep.hung:
            raise httpx.ReadTimeout("timed out", request=request)
        path = request.url.path
        rep.calls.append(path)
        if path == "/ready":
            return httpx.Response(rep.ready)
        if path == "/health":
            return httpx.Response(rep.health)
        if path == "/server_info":
            return (
                httpx.Response(200, json=rep.server_info)
                if rep.server_info
                else httpx.Response(404)
            )
        if path == "/v1/loads":
            return httpx.Response(200, json=rep.loads) if rep.loads else httpx.Response(404)
        if path == "/v1/models":
            card = {
                "id": rep.model,
                "object": "model",
                "created": 1700000000,
                "owned_by": "sglang",
                "root": rep.model,
                "parent": None,
                "max_model_len": 131072,
            }
            return httpx.Response(200, json={"object": "list", "data": [card]})
        return httpx.Response(404)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def on_added(self, view: ReplicaView) -> None:
        self.events.append(("added", view.id, view.state.value))

    def on_removed(self, replica_id: ReplicaId) -> None:
        self.events.append(("removed", replica_id, ""))

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None:
        self.events.append(("state", view.id, f"{old_state.value}->{view.state.value}"))
