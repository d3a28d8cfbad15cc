"""The simulated replica's agent APIs (one real replica process, tiny profile): Anthropic
Messages (+ stream, count_tokens), OpenAI Responses (+ stream, store, previous_response_id,
GET/DELETE/cancel), their errors, and chat's ``n`` / ``logprobs``; shapes as the real
SGLang 0.5.23 server answers them (tests/sglang_real/test_agent_apis.py compares both)."""
from __future__ import annotations

import httpx
import orjson

from tests.api.sse import agent_events as events

SYSTEM = "You are a careful coding agent. " * 20
MESSAGE = {"model": "tiny", "max_tokens": 5, "ignore_eos": True, "system": SYSTEM,
           "messages": [{"role": "user", "content": "Explain the prefix cache."}]}
RESPONSE = {"model": "tiny", "max_output_tokens": 5, "ignore_eos": True, "instructions": SYSTEM,
            "input": "Explain the prefix cache."}


def test_messages_shape_and_cache_read(client: httpx.Client) -> None:
    first = client.post("/v1/messages", json=MESSAGE).json()
    assert list(first) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert first["id"].startswith("msg_") and first["stop_reason"] == "max_tokens"
    assert first["content"][0]["type"] == "text"
    second = client.post("/v1/messages", json=MESSAGE).json()
    usage = second["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["output_tokens"] == 5
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == first["usage"]["input_tokens"] + first[
        "usage"].get("cache_read_input_tokens", 0)
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"})
    assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}


def test_messages_stream_grammar(client: httpx.Client) -> None:
    client.post("/v1/messages", json=MESSAGE)
    evs = events(client.post("/v1/messages", json={**MESSAGE, "stream": True}).content)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert evs[0][1]["message"]["usage"]["cache_read_input_tokens"] > 0
    assert evs[-2][1]["usage"] == {"output_tokens": 5}


def test_messages_errors(client: httpx.Client) -> None:
    for body, message in [({"model": "tiny", "messages": []}, "max_tokens: Field required"),
                          ({"model": "tiny", "max_tokens": 1, "messages": []}, "Messages cannot be empty."),
                          ({"model": "tiny", "max_tokens": 1, "messages": [{"role": "x"}]}, "messages.0.role")]:
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error" and message in r.json()["error"]["message"]


def test_responses_store_chain_and_control(client: httpx.Client) -> None:
    first = client.post("/v1/responses", json=RESPONSE).json()
    assert first["id"].startswith("resp_") and first["status"] == "incomplete"
    assert first["incomplete_details"] == {"reason": "max_output_tokens"}
    second = client.post("/v1/responses", json={**RESPONSE, "input": "More.", "previous_response_id": first["id"]})
    usage = second.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 16  # one page
    assert usage["input_tokens"] > first["usage"]["input_tokens"]  # the stored conversation came first
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    assert client.post(f"/v1/responses/{first['id']}/cancel").json()["status"] == "incomplete"  # already ended
    assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response",
                                                                    "deleted": True}
    gone = client.get(f"/v1/responses/{first['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    assert client.get("/v1/responses/bogus").status_code == 400


def test_responses_stream_and_errors(client: httpx.Client) -> None:
    evs = events(client.post("/v1/responses", json={**RESPONSE, "stream": True}).content)
    names = [n for n, _ in evs]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for _, e in evs] == list(range(len(evs)))
    rid = evs[0][1]["response"]["id"]
    assert client.get(f"/v1/responses/{rid}").json()["id"] == rid  # stored at the end of the stream
    for body, status, param in [({**RESPONSE, "model": "other"}, 404, "model"),
                                ({**RESPONSE, "previous_response_id": "resp_none"}, 404, "response_id"),
                                ({"model": "tiny"}, 400, "input")]:
        r = client.post("/v1/responses", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param and r.json()["error"]["code"] == status


def test_chat_n_choices_and_logprobs(client: httpx.Client) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello " * 20}], "max_tokens": 3,
            "ignore_eos": True}
    body = client.post("/v1/chat/completions", json={**chat, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["total_tokens"] == body["usage"][
        "prompt_tokens"] + 6
    lp = client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}).json()
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and set(content[0]) == {"token", "bytes", "logprob", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 2 and content[0]["bytes"] == list(content[0]["token"].encode())
    raw = client.post("/v1/chat/completions", json={**chat, "n": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}}).content
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert raw.endswith(b"data: [DONE]\n\n")
