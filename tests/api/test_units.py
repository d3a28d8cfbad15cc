"""Pure parts of the agent APIs: each API's error body and SSE error event, usage of every
shape (bodies and streams), the embedded Responses store (LRU, TTL)."""
from __future__ import annotations

from typing import cast

import httpx
import orjson
import pytest

from gateway.api_routes import ResponsesApi
from gateway.context import ContextConfig, build_context
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    NoReplicaAvailable,
    NotFound,
    UpstreamError,
    api_of,
)
from gateway.relay import (
    HeaderPolicy,
    UsageSniffer,
    error_response,
    sse_error,
    upstream_headers,
    usage_of,
    usage_of_body,
)
from gateway.responses_store import (
    ANONYMOUS,
    MemoryResponsesStore,
    ResponsesStoreConfig,
    Stored,
    Tenants,
    decode_entry,
    encode_entry,
    make_responses_store,
    owned_by,
)
from policies.base import RequestContext
from prefix_index.base import ReplicaId
from replicas.model import ReplicaState, ReplicaView
from replicas.registry import Registry

ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":1,'
    b'"output_tokens":0,"cache_read_input_tokens":42}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"a \\"usage\\": b"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
    b'"usage":{"output_tokens":3}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","usage":null},'
    b'"sequence_number":0}\n\n'
    b'event: response.output_text.delta\ndata: {"delta":"x","type":"response.output_text.delta"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","usage":'
    b'{"input_tokens":43,"input_tokens_details":{"cached_tokens":32,"cache_write_tokens":0},"output_tokens":2,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":45}},"sequence_number":2}\n\n')


def test_error_shapes_per_api() -> None:
    assert api_of("messages") == api_of("count_tokens") == "anthropic"
    assert api_of("responses") == api_of("chat") == "openai"
    assert InvalidRequest("bad").body("anthropic") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert NotFound("x").body("anthropic")["error"]["type"] == "not_found_error"
    assert NoReplicaAvailable("x").body("anthropic")["error"]["type"] == "overloaded_error"
    assert UpstreamError("x").body("anthropic")["error"]["type"] == "api_error"
    assert set(InvalidRequest("bad").body()["error"]) == {"message", "type", "code", "param"}
    r = error_response(InvalidRequest("bad"), api="messages")
    assert r.status_code == 400 and orjson.loads(bytes(r.body))["type"] == "error"


def test_sse_error_in_each_grammar() -> None:
    anthropic = sse_error("broke", api="messages")
    assert anthropic.startswith(b"event: error\ndata: ") and b"[DONE]" not in anthropic
    event = orjson.loads(anthropic.split(b"data: ", 1)[1])
    assert event == {"type": "error", "error": {"type": "api_error", "message": "broke"}}
    responses = orjson.loads(sse_error("broke", api="responses").split(b"data: ", 1)[1])
    assert responses["type"] == "error" and responses["message"] == "broke"
    assert sse_error("broke").endswith(b"data: [DONE]\n\n")


def test_usage_of_every_shape() -> None:
    assert usage_of({"usage": {"input_tokens": 1, "output_tokens": 5, "cache_read_input_tokens": 42}}) == (43, 42, 5)
    assert usage_of({"usage": {"input_tokens": 43, "output_tokens": 5}}) == (43, 0, 5)  # SGLang omits 0 reads
    assert usage_of({"usage": {"input_tokens": 2, "output_tokens": 1, "cache_read_input_tokens": 4,
                               "cache_creation_input_tokens": 8}}) == (14, 4, 1)
    responses = {"usage": {"input_tokens": 43, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 3}}
    assert usage_of(responses) == (43, 3, 3)
    assert usage_of({"type": "response.completed", "response": responses}) == (43, 3, 3)
    assert usage_of({"type": "message_delta", "usage": {"output_tokens": 3}}) == (None, None, 3)
    body = orjson.dumps({"id": "msg", "content": [{"type": "text", "text": "x" * 5000}],
                         "usage": {"input_tokens": 1, "output_tokens": 5, "cache_read_input_tokens": 9}})
    assert usage_of_body(body) == (10, 9, 5)


def test_sniffer_merges_message_start_and_delta_at_any_split() -> None:
    for stream, expected in ((ANTHROPIC_STREAM, (43, 42, 3)), (RESPONSES_STREAM, (43, 32, 2))):
        for cut in range(1, len(stream), 13):
            sniffer = UsageSniffer()
            sniffer.feed(stream[:cut])
            sniffer.feed(stream[cut:])
            assert sniffer.usage() == expected, cut


async def test_memory_store_is_a_bounded_lru_with_expiry() -> None:
    now = [0.0]
    store = MemoryResponsesStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    await store.put("resp_a", ReplicaId("r1"), "t")
    await store.put("resp_b", ReplicaId("r2"), "t")
    assert await store.get("resp_a") == Stored(ReplicaId("r1"), "t")  # a is now the most recent
    await store.put("resp_c", ReplicaId("r3"), "t")
    assert await store.get("resp_b") is None and len(store) == 2
    now[0] = 11.0
    assert await store.get("resp_a") is None and await store.get("resp_c") is None
    await store.put("resp_d", ReplicaId("r1"), "t")
    await store.delete("resp_d")
    assert await store.get("resp_d") is None


async def test_memory_store_keeps_the_first_owner_of_an_id() -> None:
    """A reused id (a replica echoing a client's choice) never moves another tenant's pin."""
    store = MemoryResponsesStore(10, 60.0)
    await store.put("resp_a", ReplicaId("r1"), "alice")
    await store.put("resp_a", ReplicaId("r2"), "bob")
    assert await store.get("resp_a") == Stored(ReplicaId("r1"), "alice")
    await store.put("resp_a", ReplicaId("r3"), "alice")  # the owner itself may move it
    assert await store.get("resp_a") == Stored(ReplicaId("r3"), "alice")


def test_entries_decode_old_values_as_owned_by_nobody() -> None:
    assert decode_entry(encode_entry(ReplicaId("http://a"), "k:1")) == Stored(ReplicaId("http://a"), "k:1")
    for old in (b"http://a", "http://a", b'{"replica": "http://a"}', b"[1]"):
        entry = decode_entry(old)
        assert entry.tenant is None and not owned_by(entry, ANONYMOUS)


async def test_redis_store_degrades_to_its_local_copy() -> None:
    store = make_responses_store(ResponsesStoreConfig(redis_timeout_s=0.05), "redis://127.0.0.1:9/0", "t")
    try:
        await store.put("resp_a", ReplicaId("r1"), "t")  # Redis refuses: kept locally, counted
        assert await store.get("resp_a") == Stored(ReplicaId("r1"), "t")
        assert await store.get("resp_other") is None
        key, final = await store.tenant_key()  # this process's own key, asked again later
        assert not final and len(key) == 32
        assert getattr(store, "degraded_total", 0) >= 3
    finally:
        await store.close()


async def test_tenants_hash_credentials_and_never_keep_them() -> None:
    store = MemoryResponsesStore(10, 60.0)
    tenants = Tenants(ResponsesStoreConfig(), store)
    a = await tenants.of({"authorization": "Bearer sk-a"})
    assert a.startswith("k:") and "sk-a" not in a and a == await tenants.of({"authorization": "Bearer sk-a"})
    assert a != await tenants.of({"authorization": "Bearer sk-b"})
    assert a != await tenants.of({"x-api-key": "Bearer sk-a"})  # which header carried it counts
    assert await tenants.of({}) == ANONYMOUS == await tenants.of({"authorization": ""})
    other = Tenants(ResponsesStoreConfig(), MemoryResponsesStore(10, 60.0))  # another process: another key
    assert a != await other.of({"authorization": "Bearer sk-a"})
    keyed = ResponsesStoreConfig(tenant_hash_key="s3cret", tenant_header="X-Tenant")
    one, two = Tenants(keyed, store), Tenants(keyed, MemoryResponsesStore(10, 60.0))
    assert await one.of({"authorization": "k"}) == await two.of({"authorization": "k"})  # a configured key
    assert (await one.of({"x-tenant": "acme", "authorization": "k"})
            == await one.of({"x-tenant": "acme"}) != await one.of({"authorization": "k"}))


class _Views:
    def __init__(self, *views: ReplicaView) -> None:
        self._views = views

    def views(self) -> tuple[ReplicaView, ...]:
        return self._views


def _ctx(previous: str | None) -> RequestContext:
    body = {"model": "m", "input": "x", **({"previous_response_id": previous} if previous else {})}
    return build_context("responses", orjson.dumps(body), {}, "application/json", ContextConfig())


async def test_pin_answers_for_every_state_of_the_creator() -> None:
    store = MemoryResponsesStore(10, 60.0)
    up, sick = ReplicaId("http://a"), ReplicaId("http://b")
    registry = _Views(ReplicaView(up, ReplicaState.ACTIVE), ReplicaView(sick, ReplicaState.UNHEALTHY))
    async with httpx.AsyncClient() as client:
        api = ResponsesApi(store, cast(Registry, registry), client, HeaderPolicy())
        await store.put("resp_up", up, "me")
        await store.put("resp_sick", sick, "me")
        await store.put("resp_gone", ReplicaId("http://c"), "me")
        assert await api.pin(_ctx(None), "me") is None
        assert await api.pin(_ctx("resp_up"), "me") == up
        with pytest.raises(GatewayError) as err:
            await api.pin(_ctx("resp_sick"), "me")
        assert (err.value.status, err.value.code) == (503, "previous_response_replica_unavailable")
        for rid, words in (("resp_gone", "left the fleet"), ("resp_never", "not found")):
            with pytest.raises(GatewayError) as err:
                await api.pin(_ctx(rid), "me")
            assert (err.value.status, err.value.code) == (404, "previous_response_not_found") and words in str(err.value)


async def test_another_tenant_gets_the_404_of_an_unknown_id() -> None:
    """Same status, code and message as an id never seen (the id's own name aside)."""
    store = MemoryResponsesStore(10, 60.0)
    up = ReplicaId("http://a")
    async with httpx.AsyncClient() as client:
        api = ResponsesApi(store, cast(Registry, _Views(ReplicaView(up, ReplicaState.ACTIVE))), client, HeaderPolicy())
        await store.put("resp_mine", up, "alice")
        await store.put("resp_nobody", up, "")
        store.put_local("resp_old", Stored(up, None))  # written before ownership: nobody's
        assert await api.pin(_ctx("resp_mine"), "alice") == up
        answers = []
        for rid, tenant in (("resp_mine", "bob"), ("resp_mine", ANONYMOUS), ("resp_nobody", ""),
                            ("resp_old", ANONYMOUS), ("resp_xxxx", "alice")):
            with pytest.raises(GatewayError) as err:
                await api.pin(_ctx(rid), tenant)
            answers.append((err.value.status, err.value.code, str(err.value).replace(rid, "ID")))
        assert len(set(answers)) == 1 and answers[0][:2] == (404, "previous_response_not_found")


def test_client_credentials_are_not_forwarded() -> None:
    raw = [(b"x-api-key", b"sk-ant"), (b"authorization", b"Bearer sk"), (b"anthropic-version", b"2023-06-01")]
    assert upstream_headers(raw) == [(b"anthropic-version", b"2023-06-01"), (b"x-forwarded-proto", b"http")]
    kept = upstream_headers(raw, HeaderPolicy(forward_authorization=True))
    assert (b"x-api-key", b"sk-ant") in kept and (b"authorization", b"Bearer sk") in kept


async def test_count_tokens_and_control_bodies_are_bounded() -> None:
    """The non-inference agent routes read their bodies within a bound too (413, in the
    API's shape), nothing reaches a replica."""
    from tests.gateway.test_app_unit import fake_fleet, gateway, ok_completion, settings_for

    fleet = fake_fleet({"R": ok_completion})
    s = settings_for(fleet.urls("R"), hashing={"max_body_bytes": 4096})
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 8000 + b'"}]}'
    async with gateway(fleet, s) as client:
        counted = await client.post("/v1/messages/count_tokens", content=big,
                                    headers={"content-type": "application/json"})
        cancel = await client.post("/v1/responses/resp_1/cancel", content=b"y" * (100 * 1024))
    assert counted.status_code == 413 and counted.json()["type"] == "error", counted.text
    assert cancel.status_code in (404, 413), cancel.text  # unknown id (404) or the body (413): never read whole
    assert not fleet.seen
