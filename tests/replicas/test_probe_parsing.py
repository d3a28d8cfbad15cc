"""Parsing SGLang's /server_info and /v1/loads bodies."""

from __future__ import annotations

from replicas.probe import Capacity, ReportedLoad, parse_loads, parse_server_info
from tests.replicas.fakes import loads_body, server_info_body


def test_capacity_with_hicache_ratio() -> None:
    cap = parse_server_info(
        server_info_body(max_total_num_tokens=600_000, page_size=64, hicache_ratio=2.0)
    )
    assert cap == Capacity(
        device_tokens=600_000,
        host_tokens=1_200_000,
        page_size=64,
        max_running_requests=128,
        served_model_name="kimi-k2",
        version="0.5.23",
        context_tokens=131072,
    )


def test_capacity_hicache_size_in_gb_overrides_ratio() -> None:
    # kvcache 40 GB holds 600k tokens -> 80 GB of host memory holds 1.2M tokens
    cap = parse_server_info(server_info_body(hicache_ratio=3.0, hicache_size=80))
    assert cap.host_tokens == 1_200_000


def test_capacity_default_ratio_and_no_hicache() -> None:
    assert parse_server_info(server_info_body(hicache_ratio=None)).host_tokens == 1_200_000
    assert parse_server_info(server_info_body(hicache=False)).host_tokens == 0


def test_capacity_sums_dp_ranks_and_falls_back_for_max_running() -> None:
    cap = parse_server_info(
        server_info_body(max_total_num_tokens=100_000, dp=4, max_running_requests=None)
    )
    assert cap.device_tokens == 400_000
    assert cap.host_tokens == 800_000
    assert cap.max_running_requests == 4 * 128


def test_capacity_prefers_kv_event_block_size() -> None:
    body = server_info_body(page_size=32)
    body["kv_events"] = {
        "publisher": "zmq",
        "endpoint_port_base": 5557,
        "block_size": 64,
        "dp_size": 1,
    }
    assert parse_server_info(body).page_size == 64


def test_capacity_tolerates_a_sparse_body() -> None:
    cap = parse_server_info({"internal_states": [{"memory_usage": {"token_capacity": 5000}}]})
    assert cap.device_tokens == 5000 and cap.host_tokens == 0 and cap.page_size == 1


def test_loads_summed_over_dp_ranks() -> None:
    got = parse_loads(loads_body((12, 3, 5000, 0.5), (8, 1, 1000, 0.25)))
    assert got == ReportedLoad(
        running=20,
        waiting=4,
        waiting_uncached_tokens=6000,
        token_usage=0.375,
        max_running_requests=256,
    )


def test_loads_without_a_list_is_unknown() -> None:
    assert parse_loads({"error": "nope"}) is None
    assert parse_loads({"loads": []}) == ReportedLoad()
