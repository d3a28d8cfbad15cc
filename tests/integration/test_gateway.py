"""The gateway over real processes: sessions, spreading, shared prefixes, headers, models.

A real ``kvgate serve`` in front of four simulated ``tiny`` replicas, driven with the
official ``openai`` client.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway, wait_until

SYSTEM = " ".join(f"Rule {i}: answer briefly and cite section {i * 7 % 13}." for i in range(60))


@pytest.fixture(scope="module")
def gw(fleet4: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway(fleet4.urls, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gateway
    gateway.proc.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def test_ten_turn_session_stays_and_hits_cache(gw: Gateway, fleet4: SimFleet) -> None:
    oa = client(gw)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    replicas = set()
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: what does rule {turn} say?"})
        raw = oa.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=8, extra_headers={"x-kvgate-session": "sess-10"})
        reply = raw.parse()
        replicas.add(raw.headers["x-kvgate-replica"])
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if turn >= 1:
            cached = usage.prompt_tokens_details.cached_tokens or 0
            assert cached >= 0.9 * usage.prompt_tokens, (turn, cached, usage.prompt_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert len(replicas) == 1 and replicas <= set(fleet4.urls)


async def _first_turns(gw: Gateway, prompts: list[str], system: str) -> list[str]:
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)

    async def one(i: int, text: str) -> str:
        raw = await oa.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=24,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": text}],
            extra_headers={"x-kvgate-session": f"new-{i}-{abs(hash(system)) % 10_000}"})
        return raw.headers["x-kvgate-replica"]

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await oa.close()


def test_concurrent_new_sessions_spread_over_all_replicas(gw: Gateway, fleet4: SimFleet) -> None:
    prompts = [f"Session {i} opens with its own topic number {i * 31}. " * 20 for i in range(16)]
    used = asyncio.run(_first_turns(gw, prompts, system=f"You are assistant {len(prompts)}."))
    assert set(used) == set(fleet4.urls), Counter(used)


def test_shared_system_prompt_does_not_pile_onto_one_replica(gw: Gateway, fleet4: SimFleet) -> None:
    long_system = SYSTEM + " Shared preamble for every agent. " * 40
    prompts = [f"Task {i}: summarise file_{i}.py" for i in range(16)]
    used = Counter(asyncio.run(_first_turns(gw, prompts, system=long_system)))
    assert len(used) >= 3, used
    assert max(used.values()) <= 8, used


def test_headers_models_metrics_ready(gw: Gateway, fleet4: SimFleet) -> None:
    r = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hello world", "max_tokens": 2},
                   timeout=30.0)
    assert r.status_code == 200
    assert r.headers["x-kvgate-replica"] in fleet4.urls and r.headers["x-kvgate-route-reason"]
    models = client(gw).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(gw.url + "/ready", timeout=5.0).status_code == 200
    metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
    for name in ("kvgate_requests_total", "kvgate_route_decisions_total", "kvgate_request_ttft_seconds",
                 "kvgate_replica_in_flight", "kvgate_index_blocks", "kvgate_cache_hit_ratio"):
        assert name in metrics


def test_streaming_relays_usage_and_generate_passthrough(gw: Gateway) -> None:
    stream = client(gw).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream please"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    r = httpx.post(gw.url + "/generate", json={"text": "native endpoint", "sampling_params": {"max_new_tokens": 3}},
                   timeout=30.0)
    assert r.status_code == 200 and "meta_info" in r.json()


def test_ready_503_without_replicas(make_gateway: object) -> None:
    gw = make_gateway([])  # type: ignore[operator]
    assert httpx.get(gw.url + "/ready", timeout=5.0).status_code == 503
    assert httpx.get(gw.url + "/health", timeout=5.0).status_code == 200
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=5.0,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"
    assert "x-kvgate-replica" in r.headers
    assert r.headers["retry-after"] == "1"  # the SDKs' retry waits for it
    m = httpx.post(gw.url + "/v1/messages", timeout=5.0,
                   json={"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert m.status_code == 503 and m.json()["type"] == "error" and m.headers["retry-after"] == "1"


@pytest.mark.redis
def test_two_gateways_share_sessions_and_drains_through_redis(fleet4: SimFleet, make_gateway: object) -> None:
    from tests.support.redis_server import redis_server

    with redis_server() as redis_url:
        gw1 = make_gateway(fleet4.urls, "--redis-url", redis_url)  # type: ignore[operator]
        gw2 = make_gateway(fleet4.urls, "--redis-url", redis_url)  # type: ignore[operator]
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
        first = client(gw1).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4, extra_headers={"x-kvgate-session": "shared-1"})
        replica = first.headers["x-kvgate-replica"]
        messages += [{"role": "assistant", "content": first.parse().choices[0].message.content or ""},
                     {"role": "user", "content": "second"}]
        second = client(gw2).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4, extra_headers={"x-kvgate-session": "shared-1"})
        reasons = (first.headers["x-kvgate-route-reason"], second.headers["x-kvgate-route-reason"])
        assert second.headers["x-kvgate-replica"] == replica, (reasons, gw2.replicas())
        usage = second.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens or 0) >= 0.8 * usage.prompt_tokens
        drained = gw1.admin("POST", "/replicas/drain", json={"url": replica, "wait": True})
        assert drained.status_code == 200
        wait_until(lambda: replica not in gw2.replicas(), 10.0, "the drain to reach the other gateway")


def test_access_log_line_per_request_only_when_on(fleet4: SimFleet, make_gateway: object) -> None:
    """``server.access_log``: one ``kvgate.access`` line per routed request with its decision;
    off (the default), none."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "log me"}], "max_tokens": 4}
    on = make_gateway(fleet4.urls, "--set", "server.access_log=true")  # type: ignore[operator]
    off = make_gateway(fleet4.urls)  # type: ignore[operator]
    for gw in (on, off):
        for stream in (False, True):
            r = httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30.0)
            assert r.status_code == 200
    wait_until(lambda: on.proc.output().count("kvgate.access") >= 2, 10.0, "two access log lines")
    lines = [line for line in on.proc.output().splitlines() if "kvgate.access" in line]
    assert len(lines) == 2
    fields = dict(part.split("=", 1) for part in lines[0].split(": ", 1)[1].split())
    assert fields["endpoint"] == "chat" and fields["status"] == "200"
    assert fields["replica"] in fleet4.urls and fields["reason"]
    assert int(fields["predicted_cached"]) >= 0 and int(fields["prompt"]) > 0 and float(fields["ttft_ms"]) > 0
    assert "kvgate.access" not in off.proc.output()
