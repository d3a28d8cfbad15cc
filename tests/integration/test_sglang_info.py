"""SGLang's ``/model_info``, ``/server_info`` and ``/flush_cache`` through a real gateway
in front of simulated replicas (``kvgate sim``, which answers all three as SGLang does).

Benchmark tools (aiperf, guidellm, inference-perf, ``bench_serving``) find the tokenizer
through the first two and ``bench_serving --flush-cache`` calls the third against the URL
it benchmarks: the gateway must answer them like a replica would, the flush as an admin
action reaching every replica.
"""
from __future__ import annotations

from pathlib import Path

import httpx

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import AUTH, GatewayFactory, start_gateway
from tests.support.procs import free_port

MODEL_KEYS = ("model_path", "tokenizer_path", "served_model_name", "is_generation")
SERVER_KEYS = ("model_path", "served_model_name", "page_size", "max_total_num_tokens", "tp_size", "version")


def _same_keys(path: str, keys: tuple[str, ...], gateway_url: str) -> None:
    via = httpx.get(gateway_url + path, headers={"authorization": "Bearer sk-client"}, timeout=10.0)
    assert via.status_code == 200, via.text
    replica = via.headers["x-kvgate-replica"]
    own = httpx.get(replica + path, timeout=10.0).json()
    body = via.json()
    assert all(k in own for k in keys), sorted(own)
    assert {k: body[k] for k in keys} == {k: own[k] for k in keys}


def test_info_is_a_replicas_own_answer(fleet4: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet4.urls)
    _same_keys("/model_info", MODEL_KEYS, gw.url)
    _same_keys("/server_info", SERVER_KEYS, gw.url)
    _same_keys("/get_model_info", MODEL_KEYS, gw.url)
    gw.assert_quiet()


def test_flush_cache_is_an_admin_action_reaching_every_replica(fleet4: SimFleet,
                                                               make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet4.urls)
    none = httpx.post(gw.url + "/flush_cache", timeout=30.0)
    wrong = httpx.post(gw.url + "/flush_cache", headers={"authorization": "Bearer nope"}, timeout=30.0)
    chat = httpx.post(gw.url + "/v1/chat/completions", timeout=60.0,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
                            "max_tokens": 4})
    post = httpx.post(gw.url + "/flush_cache", headers=AUTH, timeout=30.0)
    get = httpx.get(gw.url + "/flush_cache", headers=AUTH, timeout=30.0)
    assert none.status_code == 401 and wrong.status_code == 403
    assert chat.status_code == 200, chat.text
    for r in (post, get):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["flushed"] == 4 and body["failed"] == 0
        assert sorted(x["url"] for x in body["replicas"]) == sorted(fleet4.urls)
        assert all(x["status"] == 200 and x["message"].startswith("Cache flushed.") for x in body["replicas"])
        assert all(x["index_cleared"] for x in body["replicas"])
    gw.assert_quiet()


def test_flush_cache_stays_on_the_main_port_with_an_admin_port(fleet4: SimFleet, tmp_path: Path) -> None:
    admin_port = free_port()
    gw = start_gateway(fleet4.urls[:1], tmp_path / "gw.log", "--set", f"admin.port={admin_port}")
    try:
        main = httpx.post(gw.url + "/flush_cache", headers=AUTH, timeout=30.0)
        admin = httpx.post(f"http://127.0.0.1:{admin_port}/flush_cache", headers=AUTH, timeout=30.0)
    finally:
        gw.proc.stop()
    assert main.status_code == 200 and main.json()["flushed"] == 1, main.text
    assert admin.status_code == 404


def test_no_replica_is_503_with_retry_after(make_gateway: GatewayFactory) -> None:
    gw = make_gateway([])
    for r in (httpx.get(gw.url + "/model_info", timeout=10.0), httpx.get(gw.url + "/server_info", timeout=10.0),
              httpx.post(gw.url + "/flush_cache", headers=AUTH, timeout=10.0)):
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "no_replica_available"
