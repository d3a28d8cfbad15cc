"""Several models behind one gateway (gateway/models.py, policies.routing.serving): the
404 of an unknown model in each API's shape, aliases, ``/v1/models``, the model label;
the app over fake replicas on loopback (as tests/gateway/test_app_unit.py)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.context import ContextConfig, build_context
from gateway.errors import ModelNotFound
from gateway.metrics import OTHER_MODEL, GatewayMetrics
from gateway.models import ModelsConfig, forwarded_body, model_list, require_served
from policies.routing import ANY_MODEL
from tests.gateway.test_app_unit import A, B, fake_fleet, gateway, ok_completion, settings_for
from tests.support.fake_replicas import hang, json_reply

JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "hello"}]
BODIES = {  # path -> a valid body for the model given
    "/v1/chat/completions": lambda m: {"model": m, "messages": MESSAGES, "max_tokens": 4},
    "/v1/completions": lambda m: {"model": m, "prompt": "hello", "max_tokens": 4},
    "/v1/responses": lambda m: {"model": m, "input": "hello"},
    "/v1/messages": lambda m: {"model": m, "max_tokens": 4, "messages": MESSAGES},
    "/v1/messages/count_tokens": lambda m: {"model": m, "messages": MESSAGES},
}
CARD = {"id": "m1", "object": "model", "created": 1, "owned_by": "sglang", "root": "m1", "parent": None}


# ------------------------------------------------------------------ pure parts
def test_require_served() -> None:
    require_served("anything", frozenset())  # no replica reports models: nothing refused
    require_served("m1", frozenset({"m1", "m2"}))
    require_served(ANY_MODEL, frozenset({"m1"}))  # a request naming no model
    with pytest.raises(ModelNotFound) as caught:
        require_served("m3", frozenset({"m1", "m2"}))
    assert caught.value.status == 404
    assert caught.value.body() == {"error": {"message": "The model 'm3' does not exist",
                                             "type": "invalid_request_error", "code": "model_not_found",
                                             "param": "model"}}
    assert caught.value.body("anthropic") == {
        "type": "error", "error": {"type": "not_found_error", "message": "The model 'm3' does not exist"}}


def test_model_list_union_dedup_and_aliases() -> None:
    m2 = {**CARD, "id": "m2", "root": "m2"}
    cards = model_list([CARD, m2, {**CARD, "created": 2}], {"public": "m1", "ghost": "m9", "m2": "m1"})
    assert [c["id"] for c in cards] == ["m1", "m2", "public"]  # an alias of nothing served is not listed
    assert cards[0]["created"] == 1  # the first card of an id wins
    assert cards[2] == {**CARD, "id": "public"}  # the target's card under the alias (root: the served name)


def test_alias_resolved_once_at_parse() -> None:
    cfg = ContextConfig(models=ModelsConfig(aliases={"public": "m1", "default": "m2"}))
    plain = ContextConfig()
    body = orjson.dumps({"model": "public", "messages": MESSAGES})
    ctx = build_context("chat", body, {}, None, cfg)
    served = build_context("chat", orjson.dumps({"model": "m1", "messages": MESSAGES}), {}, None, plain)
    assert ctx.model == "m1"
    assert ctx.block_hashes == served.block_hashes  # hashed as the served model: they share cached prefixes
    nameless = build_context("chat", orjson.dumps({"messages": MESSAGES}), {}, None, cfg)
    assert nameless.model == "m2"  # 'default' names the requests without a model
    assert build_context("chat", orjson.dumps({"messages": MESSAGES}), {}, None, plain).model == ANY_MODEL


def test_forwarded_body_names_the_served_model() -> None:
    aliases = {"public": "m1", "default": "m2"}
    cfg = ContextConfig(models=ModelsConfig(aliases=aliases))
    body = b'{"model": "public", "messages": [{"role": "user", "content": "hello"}], "x": 1.5}'
    out = forwarded_body(build_context("chat", body, {}, None, cfg), body, aliases)
    assert orjson.loads(out) == {**orjson.loads(body), "model": "m1"}
    assert list(orjson.loads(out)) == ["model", "messages", "x"]  # same fields, same order
    for same in (b'{"model": "m1", "messages": [{"role": "user", "content": "hello"}]}',
                 b'{"messages": [{"role": "user", "content": "hello"}]}'):  # nothing inserted into a body
        assert forwarded_body(build_context("chat", same, {}, None, cfg), same, aliases) is same


def test_aliases_validated() -> None:
    with pytest.raises(ValueError):
        ModelsConfig(aliases={"a": "a"})
    with pytest.raises(ValueError):
        ModelsConfig(aliases={"": "m"})


def test_model_label_is_bounded() -> None:
    metrics = GatewayMetrics()
    metrics.served_models = lambda: frozenset({"m1"})
    metrics.request_done("chat", 200, 0.1, "m1")
    metrics.request_done("chat", 200, 0.1, "client-chose-this")
    metrics.timing(0.05, None, "m1")
    text = metrics.exposition().decode()
    assert 'kvgate_requests_total{endpoint="chat",model="m1",status="200"} 1.0' in text
    assert f'kvgate_requests_total{{endpoint="chat",model="{OTHER_MODEL}",status="200"}} 1.0' in text
    assert "client-chose-this" not in text
    assert 'kvgate_request_ttft_seconds_count{model="m1"} 1.0' in text


# ------------------------------------------------------------------ the app
async def test_requests_reach_only_replicas_of_their_model() -> None:
    fleet = fake_fleet({A: ok_completion, B: ok_completion}, models={A: "m1", B: "m2"})
    a, b = fleet.urls(A, B)
    async with gateway(fleet, settings_for([a, b])) as client:
        for i in range(6):
            for model, home in (("m1", a), ("m2", b)):
                body = {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]}
                r = await client.post("/v1/chat/completions", json=body, headers={"x-kvgate-session": f"s{i}"})
                assert r.status_code == 200 and r.headers["x-kvgate-replica"] == home, (model, r.headers)
        nameless = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert nameless.status_code == 200  # no model named: any replica, as before
        metrics = (await client.get("/metrics")).text
    assert 'kvgate_requests_total{endpoint="chat",model="m1",status="200"} 6.0' in metrics
    assert 'kvgate_requests_total{endpoint="chat",model="m2",status="200"} 6.0' in metrics


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_unknown_model_is_404_in_each_shape(path: str) -> None:
    fleet = fake_fleet({A: ok_completion}, models={A: "m1"})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        r = await client.post(path, json=BODIES[path]("nope"), headers=JSON)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 404 and r.headers["x-kvgate-replica"] == "none"
    if path.startswith("/v1/messages"):
        assert r.json() == {"type": "error", "error": {"type": "not_found_error",
                                                       "message": "The model 'nope' does not exist"}}
    else:
        assert r.json()["error"] == {"message": "The model 'nope' does not exist", "type": "invalid_request_error",
                                     "code": "model_not_found", "param": "model"}
    assert fleet.seen == []  # never forwarded
    assert "nope" not in metrics


async def test_served_model_without_routable_replica_is_503() -> None:
    fleet = fake_fleet({A: ok_completion, B: hang}, models={A: "m1", B: "m2"})
    a, b = fleet.urls(A, B)
    async with gateway(fleet, settings_for([a, b])) as client:
        held = asyncio.create_task(client.post("/v1/chat/completions", json={"model": "m2", "messages": MESSAGES}))
        while not fleet.seen:  # B holds a request: draining keeps it registered (m2 still known)
            await asyncio.sleep(0.01)
        assert (await client.post("/admin/replicas/drain", json={"url": b})).status_code == 200
        r = await client.post("/v1/chat/completions", json={"model": "m2", "messages": MESSAGES})
        held.cancel()
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"


async def test_alias_routes_lists_and_forwards_the_served_name() -> None:
    echo = json_reply(200, {"id": "x", "object": "chat.completion", "model": "m2", "choices": []})
    fleet = fake_fleet({A: ok_completion, B: echo}, models={A: "m1", B: "m2"})
    a, b = fleet.urls(A, B)
    async with gateway(fleet, settings_for([a, b], models={"aliases": {"public": "m2"}})) as client:
        r = await client.post("/v1/chat/completions", json={"model": "public", "messages": MESSAGES})
        listed = (await client.get("/v1/models")).json()["data"]
        card = await client.get("/v1/models/public")
        missing = await client.get("/v1/models/nope")
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == b
    assert orjson.loads(fleet.seen[0].body)["model"] == "m2"  # SGLang gets a name it serves
    assert sorted(c["id"] for c in listed) == ["m1", "m2", "public"]
    assert card.status_code == 200 and card.json()["id"] == "public" and card.json()["root"] == "m2"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_count_tokens_goes_to_a_replica_of_its_model() -> None:
    counted = json_reply(200, {"input_tokens": 3})
    fleet = fake_fleet({A: counted, B: counted}, models={A: "m1", B: "m2"})
    a, b = fleet.urls(A, B)
    async with gateway(fleet, settings_for([a, b])) as client:
        for _ in range(4):
            r = await client.post("/v1/messages/count_tokens", json=BODIES["/v1/messages/count_tokens"]("m2"))
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == b


def test_session_keys_per_model() -> None:
    headers = {"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A"}
    main = build_context("chat", orjson.dumps({"model": "m1", "messages": MESSAGES}), headers, None, ContextConfig())
    small = build_context("chat", orjson.dumps({"model": "m2", "messages": MESSAGES}), headers, None, ContextConfig())
    assert (main.session.session, main.session.parent) == ("A@m1", "S@m1")
    assert (small.session.session, small.session.parent) == ("A@m2", "S@m2")  # two entries, one per model
    nameless = build_context("chat", orjson.dumps({"messages": MESSAGES}), headers, None, ContextConfig())
    assert (nameless.session.session, nameless.session.parent) == ("A", "S")
    assert build_context("chat", orjson.dumps({"model": "m1", "messages": MESSAGES}), {}, None,
                         ContextConfig()).session.session is None
