"""The simulated replica honours SGLang 0.5.23's HTTP contract (reference doc §1).

One real replica process (tiny profile); every endpoint's shape and key order is checked
against the reference document's examples.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello " * 20}]}
Sse = Callable[[bytes], list[bytes]]
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "reasoning_tokens", "completion_tokens_details"]


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(path, content=orjson.dumps(body), headers={"content-type": "application/json"})


def test_chat_non_stream_shape(client: httpx.Client) -> None:
    r = _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert len(body["id"]) == 32 and int(body["id"], 16) >= 0  # bare uuid4().hex
    choice = body["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason", "matched_stop"]
    assert list(choice["message"]) == ["role", "content", "reasoning_content"]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["message"]["content"]
    assert list(body["usage"]) == USAGE_KEYS
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    assert list(body["usage"]["prompt_tokens_details"]) == ["cached_tokens"]


def test_rid_sets_id_and_natural_stop_matches_eos(client: httpx.Client) -> None:
    body = _post(client, "/v1/chat/completions", {**CHAT, "rid": "my-rid-1"}).json()
    assert body["id"] == "my-rid-1"
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(choice["matched_stop"], int)


def test_repeated_prompt_reports_cached_tokens(client: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "cache me " * 200}],
            "max_tokens": 2}
    _post(client, "/v1/chat/completions", body)
    second = _post(client, "/v1/chat/completions", body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_stream_chunks(client: httpx.Client, sse: Sse) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 6, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    r = _post(client, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.content)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    first, *content, finish, usage = chunks
    assert list(first) == ["id", "object", "created", "model", "choices"]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0] == {"index": 0, "delta": {"reasoning_content": None, "role": "assistant",
                                                         "content": ""},
                                   "logprobs": None, "finish_reason": None, "matched_stop": None}
    assert content, "no content chunk"
    for c in content:
        assert list(c) == ["id", "object", "created", "model", "choices"]  # no usage key
        assert list(c["choices"][0]["delta"]) == ["reasoning_content", "content"]
        assert c["choices"][0]["finish_reason"] is None
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and list(usage["usage"]) == USAGE_KEYS
    assert usage["usage"]["completion_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_without_usage_and_with_sglext(client: httpx.Client, sse: Sse) -> None:
    plain = sse(_post(client, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 3}).content)
    assert all(b'"usage"' not in e for e in plain)
    body = {**CHAT, "stream": True, "max_tokens": 3, "return_cached_tokens_details": True,
            "stream_options": {"include_usage": True}}
    events = sse(_post(client, "/v1/chat/completions", body).content)
    sglext, usage = orjson.loads(events[-3]), orjson.loads(events[-2])
    assert sglext["choices"] == [] and sglext["usage"] is None
    assert list(sglext["sglext"]["cached_tokens_details"]) == ["device", "host"]
    assert "usage" in usage and "sglext" not in usage


def test_completions_shapes(client: httpx.Client, sse: Sse) -> None:
    body = {"model": "tiny", "prompt": "once upon a time " * 10, "max_tokens": 5, "ignore_eos": True}
    whole = _post(client, "/v1/completions", body).json()
    assert list(whole) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert whole["object"] == "text_completion"
    assert list(whole["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "matched_stop"]
    events = sse(_post(client, "/v1/completions",
                       {**body, "stream": True, "stream_options": {"include_usage": True}}).content)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    *text_chunks, usage = chunks
    for c in text_chunks:
        assert list(c) == ["id", "object", "created", "model", "choices", "usage"]
        assert c["usage"] is None
        assert list(c["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "matched_stop"]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage["choices"] == [] and "completion_tokens_details" not in usage["usage"]


def test_generate_shapes(client: httpx.Client, sse: Sse) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    whole = _post(client, "/generate", body).json()
    assert list(whole) == ["text", "output_ids", "meta_info"]
    meta = whole["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    for key in ("id", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency"):
        assert key in meta
    assert len(whole["output_ids"]) == 4
    events = sse(_post(client, "/generate", {**body, "stream": True}).content)
    assert events[-1] == b"[DONE]"
    updates = [orjson.loads(e) for e in events[:-1]]
    texts = [u["text"] for u in updates]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    assert updates[-1]["text"] == whole["text"] and updates[-1]["output_ids"] == whole["output_ids"]
    assert updates[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(u["meta_info"]["finish_reason"] is None for u in updates[:-1])
    ids = _post(client, "/generate", {"input_ids": [1, 2, 3, 4] * 40,
                                      "sampling_params": {"max_new_tokens": 2}}).json()
    assert ids["meta_info"]["prompt_tokens"] == 160


def test_generate_reports_cache_tiers(client: httpx.Client) -> None:
    body = {"text": "tiered " * 300, "sampling_params": {"max_new_tokens": 1}}
    _post(client, "/generate", body)
    meta = _post(client, "/generate", body).json()["meta_info"]
    assert meta["cached_tokens"] > 0
    details = meta["cached_tokens_details"]
    assert list(details) == ["device", "host"] and details["device"] + details["host"] == meta["cached_tokens"]


def test_errors(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert list(r.json()) == ["object", "message", "type", "param", "code"]
    assert r.json()["code"] == 400 and "application/json" in r.json()["message"]
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON decode error" in r.json()["message"]
    r = _post(client, "/v1/chat/completions", {"model": "tiny"})
    assert r.status_code == 400 and "messages" in r.json()["message"]
    r = _post(client, "/v1/completions", {"model": "tiny"})
    assert r.status_code == 400 and "prompt" in r.json()["message"]
    r = _post(client, "/generate", {"sampling_params": {}})
    assert r.status_code == 400 and "error" in r.json()
    assert client.get("/no/such/route").json() == {"detail": "Not Found"}
    assert client.get("/v1/chat/completions").status_code == 405


def test_request_too_big_for_the_pool(client: httpx.Client, sse: Sse) -> None:
    body = {**CHAT, "max_tokens": 8000, "ignore_eos": True}  # > the 4096-token KV pool
    r = _post(client, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["object"] == "error"
    events = sse(_post(client, "/v1/chat/completions", {**body, "stream": True}).content)
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert list(error) == ["object", "message", "type", "param", "code"] and error["code"] == 400


def test_models(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    card = body["data"][0]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len"]
    assert card["id"] == "tiny" and card["owned_by"] == "sglang" and card["max_model_len"] == 8192
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model 'nope' does not exist", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}


def test_server_and_model_info(client: httpx.Client) -> None:
    info = client.get("/server_info").json()
    for key in ("model_path", "served_model_name", "tp_size", "dp_size", "dcp_size", "page_size",
                "max_total_num_tokens", "enable_hierarchical_cache", "hicache_ratio", "hicache_size",
                "speculative_algorithm", "kv_events", "internal_states", "version", "launch_command",
                "chunked_prefill_size", "max_running_requests", "status"):
        assert key in info, key
    assert info["version"] == "0.5.23" and info["kv_events"] is None
    assert info["page_size"] == 16 and info["max_total_num_tokens"] == 4096
    assert info["enable_hierarchical_cache"] is True and info["hicache_ratio"] == 2.0
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 4096
    assert Path(info["model_path"]).is_dir() and (Path(info["model_path"]) / "config.json").is_file()
    assert client.get("/get_server_info").json()["served_model_name"] == "tiny"
    model = client.get("/model_info").json()
    assert model["served_model_name"] == "tiny" and model["is_generation"] is True
    assert client.get("/get_model_info").json() == model


def test_loads_shape(client: httpx.Client) -> None:
    body = client.get("/v1/loads").json()
    assert list(body) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    entry = body["loads"][0]
    for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
                "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests",
                "token_usage", "gen_throughput", "cache_hit_rate", "memory", "queues", "disaggregation"):
        assert key in entry, key
    assert entry["max_total_num_tokens"] == 4096 and entry["memory"]["token_capacity"] == 4096
    core = client.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
    assert "memory" not in core and "queues" not in core
    prom = client.get("/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_num_running_reqs{dp_rank="0"}' in prom


def test_metrics_names_and_labels(client: httpx.Client) -> None:
    _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "stream": True})
    text = client.get("/metrics").text
    sched = 'engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput",
                 "max_total_num_tokens", "spec_accept_length", "hicache_host_used_tokens",
                 "hicache_host_total_tokens"):
        assert f"sglang:{name}{{{sched}}} " in text, name
    assert 'sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="tiny"}' in text
    assert 'sglang:generation_tokens_total{engine_type="unified",is_streaming="true"' in text
    assert 'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="tiny"}' in text
    assert ('sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",'
            'le="0.4",model_name="tiny"}') in text
    assert 'sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.002"' in text
    assert 'sglang:e2e_request_latency_seconds_bucket{engine_type="unified",is_streaming="true",le="2400.0"' in text
    assert "_created" not in text


def test_flush_cache(client: httpx.Client) -> None:
    r = client.get("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.\n")
    assert client.post("/flush_cache").status_code == 200
    body = {**CHAT, "stream": True, "max_tokens": 3900, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                       headers={"content-type": "application/json"}) as stream:
        chunks = stream.iter_bytes()  # keep a reference: a collected iterator closes the stream
        next(chunks)  # the request is running
        busy = client.post("/flush_cache")
    assert busy.status_code == 400
