"""The official ``anthropic`` and ``openai`` SDKs against ``kvgate serve`` in front of
simulated replicas (real processes): Messages (create, stream, count_tokens), Responses
(create with and without ``previous_response_id``, stream, retrieve, delete),
``models.retrieve``; each API's error shape; a session's affinity across turns and APIs."""
from __future__ import annotations

import itertools
import random

import anthropic
import httpx
import openai
import pytest

from tests.api.conftest import MODEL, raw_client
from tests.integration.conftest import Gateway, set_faults

WORDS = ["alpha", "beta", "gamma", "delta", "cache", "route", "token", "block", "prefix", "replica"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


def claude(gw: Gateway, session: str | None = None) -> anthropic.Anthropic:
    headers = {"x-claude-code-session-id": session} if session else None
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", default_headers=headers, max_retries=0,
                               timeout=60.0)


def codex(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def test_anthropic_messages_stream_and_count_tokens(gateway: Gateway) -> None:
    client = claude(gateway, "sdk-messages")
    rng = random.Random(1)
    system, question = text(rng, 200), text(rng, 50)
    message = client.messages.create(model=MODEL, max_tokens=6, system=system,
                                     messages=[{"role": "user", "content": question}])
    assert message.type == "message" and message.content[0].type == "text"
    assert message.usage.output_tokens == 6 and message.stop_reason == "max_tokens"
    with client.messages.stream(model=MODEL, max_tokens=5, system=system,
                                messages=[{"role": "user", "content": question}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    assert (final.usage.cache_read_input_tokens or 0) > 0  # message_start reports the cache read
    beta = client.beta.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": question}])
    assert beta.usage.output_tokens == 2  # Claude Code's POST /v1/messages?beta=true
    counted = client.messages.count_tokens(model=MODEL, system=system,
                                           messages=[{"role": "user", "content": question}])
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_anthropic_errors_have_anthropic_shape(gateway: Gateway) -> None:
    client = claude(gateway)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "Messages cannot be empty."}}
    with raw_client(gateway) as raw:
        for path, body in [("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "x"}]}),
                           ("/v1/messages/count_tokens", {"model": MODEL}),
                           ("/v1/messages", b"{not json")]:
            r = raw.post(path, content=body) if isinstance(body, bytes) else raw.post(path, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert r.headers["x-kvgate-route-reason"] == "rejected"  # never reached a replica
        for method, path, status in [("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)]:
            r = raw.request(method, path)
            assert r.status_code == status and r.json()["type"] == "error", r.text


def test_openai_responses_chain_stream_retrieve_delete(gateway: Gateway) -> None:
    client = codex(gateway)
    rng = random.Random(2)
    instructions = text(rng, 100)  # not carried over by previous_response_id: sent on every turn
    first = client.responses.with_raw_response.create(model=MODEL, instructions=instructions,
                                                      input=text(rng, 100), max_output_tokens=4)
    created = first.parse()
    replica = first.headers["x-kvgate-replica"]
    assert created.id.startswith("resp_") and created.usage is not None
    second = client.responses.with_raw_response.create(model=MODEL, input=text(rng, 10), max_output_tokens=4,
                                                       instructions=instructions, previous_response_id=created.id)
    assert second.headers["x-kvgate-replica"] == replica
    assert second.headers["x-kvgate-route-reason"] == "previous-response"
    usage = second.parse().usage
    assert usage is not None and usage.input_tokens_details.cached_tokens >= created.usage.input_tokens * 0.9
    events = list(client.responses.create(model=MODEL, input=text(rng, 10), max_output_tokens=3, stream=True,
                                          previous_response_id=second.parse().id))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[0].response.id
    third = client.responses.with_raw_response.create(model=MODEL, input="and?", max_output_tokens=2,
                                                      previous_response_id=streamed)
    assert third.headers["x-kvgate-replica"] == replica  # the stream's id was recorded too
    assert client.responses.retrieve(created.id).id == created.id
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_openai_errors_have_openai_shape(gateway: Gateway) -> None:
    client = codex(gateway)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "previous_response_not_found"
    with raw_client(gateway) as raw:
        for body in [{"model": MODEL}, {"model": MODEL, "input": 5},
                     {"model": MODEL, "input": "x", "previous_response_id": "nope"}, {"input": "x"}]:
            r = raw.post("/v1/responses", json=body)
            assert r.status_code == 400, r.text
            assert set(r.json()["error"]) == {"message", "type", "code", "param"}
            assert r.headers["x-kvgate-route-reason"] == "rejected"


def chat_turn(raw: httpx.Client, session: str, system: str, history: list[dict[str, str]]) -> tuple[str, int, int, str]:
    r = raw.post("/v1/chat/completions", headers={"x-claude-code-session-id": session},
                 json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "system", "content": system}, *history]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return (r.headers["x-kvgate-replica"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
            r.json()["choices"][0]["message"]["content"])


def message_turn(client: anthropic.Anthropic, system: str,
                 history: list[dict[str, str]]) -> tuple[str, int, int, str]:
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=8, system=system,
                                                   messages=history)  # type: ignore[arg-type]
    m = raw.parse()
    cached = m.usage.cache_read_input_tokens or 0
    return raw.headers["x-kvgate-replica"], m.usage.input_tokens + cached, cached, m.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("alternate", [False, True], ids=["messages", "messages+chat"])
def test_ten_turn_session_keeps_replica_and_cache(gateway: Gateway, alternate: bool) -> None:
    """10 turns: one replica; each turn's cached tokens >= 95% of the previous prompt."""
    session = f"ten-turns-{alternate}"
    client = claude(gateway, session)
    rng = random.Random(3 + alternate)
    system = text(rng, 300)
    history: list[dict[str, str]] = []
    turns = []
    with raw_client(gateway) as raw:
        for i in range(10):
            history.append({"role": "user", "content": text(rng, 30)})
            use_chat = alternate and i % 2 == 1
            turn = chat_turn(raw, session, system, history) if use_chat else message_turn(client, system, history)
            history.append({"role": "assistant", "content": turn[3]})
            turns.append(turn)
    assert len({t[0] for t in turns}) == 1, [t[0] for t in turns]
    for prev, cur in itertools.pairwise(turns):
        assert cur[2] >= 0.95 * prev[1], (prev, cur)


def test_stream_error_after_first_byte_in_each_grammar(gateway: Gateway, fleet2: object) -> None:
    urls = fleet2.urls  # type: ignore[attr-defined]
    for url in urls:
        set_faults(url, die_after_chunks=3)
    try:
        with raw_client(gateway) as raw:
            r = raw.post("/v1/messages", json={"model": MODEL, "max_tokens": 30, "stream": True, "ignore_eos": True,
                                                "messages": [{"role": "user", "content": "tell me"}]})
            assert r.status_code == 200
            assert "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\"" in r.text
            assert "[DONE]" not in r.text
            r = raw.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 30, "stream": True,
                                                 "ignore_eos": True, "input": "tell me"})
            assert r.status_code == 200
            assert "event: error\ndata: {\"type\":\"error\"" in r.text and "[DONE]" not in r.text
    finally:
        for url in urls:
            set_faults(url)
