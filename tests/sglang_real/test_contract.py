"""Differential contract tests: the same requests to a REAL SGLang 0.5.23 CPU server and to
a simulated replica (profile ``tiny-cpu``), comparing status codes, JSON key sets and
value types (never generated text). Differences judged harmless are listed in
``HARMLESS`` with their reason (also in loadtest/simulator/README.md, "Verified against
the real SGLang 0.5.23 server"); any other difference fails the test.
"""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sglang_real.conftest import MAX_TOTAL_TOKENS, MODEL, client
from tests.sglang_real.shapes import differences, sse_events

pytestmark = pytest.mark.sglang_real

MESSAGES = [{"role": "user", "content": "Say something about prefix caches and paging."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "Prefix caches keep", "max_tokens": 6, "ignore_eos": True}
HARMLESS: dict[str, str] = {
    # /server_info: the raw CLI value (null when not given); the simulator reports the
    # value it uses. Routers read max_total_num_tokens / max_model_len instead.
    "context_length": "raw CLI value", "max_running_requests": "raw CLI value",
    "internal_states[].context_length": "raw CLI value",
    "internal_states[].max_running_requests": "raw CLI value",
    "kvgate_sim": "the simulator's own key (profile, time scale, seed)",
    "internal_states[].kvgate_sim": "the simulator's own key",
    # the simulator imitates a Kimi K2 deployment (parsers kimi_k2); the tiny model has none
    "reasoning_parser": "model-specific", "tool_call_parser": "model-specific",
    "internal_states[].reasoning_parser": "model-specific",
    "internal_states[].tool_call_parser": "model-specific",
    # /v1/loads
    "accelerator": "null on a CPU server; the simulator names its simulated GPU",
    "loads[].decode_moments": "step-time moment sums; null until a decode ran (sim: always null)",
}


def both(method: str, path: str, real_url: str, sim_url: str, **kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
    with client(real_url) as r, client(sim_url) as s:
        return r.request(method, path, **kwargs), s.request(method, path, **kwargs)


@pytest.fixture(scope="module")
def urls(real_urls: list[str], sim_url: str) -> tuple[str, str]:
    return real_urls[0], sim_url


def assert_same_shape(real: httpx.Response, sim: httpx.Response, *, allowed: tuple[str, ...] = ()) -> None:
    assert (real.status_code, sim.status_code) == (real.status_code, real.status_code)
    diffs = differences(real.json(), sim.json(), allowed=(*HARMLESS, *allowed))
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_non_streaming(urls: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    real, sim = both("POST", path, *urls, json=body)
    assert real.status_code == 200, real.text
    assert_same_shape(real, sim)
    for r in (real, sim):
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 6 and usage["prompt_tokens_details"]["cached_tokens"] >= 0


def chunk_kind(event: Any) -> str:
    """role, content, finish, usage or done (one SSE event of a chat stream)."""
    if event == "[DONE]":
        return "done"
    if not event["choices"]:
        return "usage" if event.get("usage") else "other"
    if event["choices"][0]["finish_reason"] is not None:
        return "finish"
    return "role" if "role" in event["choices"][0]["delta"] else "content"


def chat_kinds(events: list[Any]) -> list[str]:
    """The chunk kinds in order, consecutive content chunks collapsed into one."""
    kinds: list[str] = []
    for kind in map(chunk_kind, events):
        if not kinds or kind != "content" or kinds[-1] != "content":
            kinds.append(kind)
    return kinds


def first_of(events: list[Any], kind: str) -> Any:
    return next(e for e in events if chunk_kind(e) == kind)


def test_chat_stream_chunk_sequence(urls: tuple[str, str]) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    real, sim = both("POST", "/v1/chat/completions", *urls, json=body)
    assert real.status_code == sim.status_code == 200
    assert real.headers["content-type"].split(";")[0] == sim.headers["content-type"].split(";")[0]
    ev_real, ev_sim = sse_events(real.content), sse_events(sim.content)
    assert chat_kinds(ev_real) == chat_kinds(ev_sim) == ["role", "content", "finish", "usage", "done"]
    for kind in ("role", "content", "finish", "usage"):
        diffs = differences(first_of(ev_real, kind), first_of(ev_sim, kind))
        assert not diffs, f"{kind} chunk:\n" + "\n".join(diffs)


def test_completion_stream_chunk_sequence(urls: tuple[str, str]) -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    real, sim = both("POST", "/v1/completions", *urls, json=body)
    assert real.status_code == sim.status_code == 200
    ev_real, ev_sim = sse_events(real.content), sse_events(sim.content)
    for events in (ev_real, ev_sim):
        assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]
        text = events[:-2]
        assert all(e["usage"] is None for e in text)
        assert text[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in text[:-1])
    # the last content chunk and the usage chunk always; the first content chunk when both
    # streamed more than one (a busy machine may merge a short simulated stream into one)
    chunks = [-3, -2] + ([0] if len(ev_real) > 3 and len(ev_sim) > 3 else [])
    for i in chunks:
        diffs = differences(ev_real[i], ev_sim[i])
        assert not diffs, f"chunk {i}:\n" + "\n".join(diffs)


@pytest.mark.parametrize("path, kwargs", [
    ("/v1/chat/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("/v1/chat/completions", {"json": {"model": MODEL}}),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": "hi"}}),
    ("/v1/chat/completions", {"json": {**CHAT, "max_tokens": "many"}}),
    ("/v1/completions", {"json": {"model": MODEL}}),
], ids=["malformed-json", "missing-messages", "messages-not-a-list", "max-tokens-not-int",
        "missing-prompt"])
def test_error_shapes(urls: tuple[str, str], path: str, kwargs: dict[str, Any]) -> None:
    real, sim = both("POST", path, *urls, **kwargs)
    assert real.status_code == sim.status_code == 400, (real.text, sim.text)
    assert_same_shape(real, sim)
    assert real.json()["code"] == sim.json()["code"] == 400


ROUTER_KEYS = ("max_total_num_tokens", "page_size", "tp_size", "dp_size", "speculative_algorithm",
               "kv_events", "internal_states", "version", "model_path", "served_model_name")


def test_server_info(urls: tuple[str, str]) -> None:
    real, sim = (r.json() for r in both("GET", "/server_info", *urls))
    for key in ROUTER_KEYS:
        assert key in real and key in sim, key
    calibrated = ("max_total_num_tokens", "page_size", "tp_size", "dp_size", "speculative_algorithm",
                  "kv_events", "version", "served_model_name")
    assert {k: sim[k] for k in calibrated} == {k: real[k] for k in calibrated}
    assert real["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    # every key the simulator reports exists in the real server with the same type
    # (the real one has ~546 resolved arguments; the simulator reports the subset routers read)
    sim_only = {k: v for k, v in sim.items() if k in real or k not in HARMLESS}
    diffs = differences({k: real.get(k) for k in sim_only}, sim_only, allowed=(*HARMLESS, "internal_states"))
    assert not diffs, "\n".join(diffs)
    state_real, state_sim = real["internal_states"][0], sim["internal_states"][0]
    diffs = differences({k: state_real.get(k) for k in state_sim}, state_sim,
                        allowed=tuple(k.removeprefix("internal_states[].") for k in HARMLESS))
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("path", ["/model_info", "/v1/models", "/v1/loads", "/v1/models/nope",
                                  "/get_model_info"])
def test_introspection_shapes(urls: tuple[str, str], path: str) -> None:
    real, sim = both("GET", path, *urls)
    assert_same_shape(real, sim)


@pytest.mark.parametrize("path", ["/get_load", "/no-such-route"])
def test_not_found(urls: tuple[str, str], path: str) -> None:
    real, sim = both("GET", path, *urls)
    assert real.status_code == sim.status_code == 404
    assert real.json() == sim.json() == {"detail": "Not Found"}


def test_generate_meta_info(urls: tuple[str, str]) -> None:
    body = {"text": "Prefix caches keep", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    real, sim = (r.json() for r in both("POST", "/generate", *urls, json=body))
    assert set(real) == set(sim) == {"text", "output_ids", "meta_info"}
    # the real server adds timing fields with --enable-metrics; the simulator reports a subset
    meta_sim = sim["meta_info"]
    diffs = differences({k: real["meta_info"].get(k) for k in meta_sim}, meta_sim)
    assert not diffs, "\n".join(diffs)


def metric_labels(text: str) -> dict[str, set[frozenset[str]]]:
    out: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).add(frozenset(sample.labels) - {"le"})
    return out


def test_metrics_names_and_labels(urls: tuple[str, str]) -> None:
    with client(urls[0]) as c:  # make sure the counters have samples on both sides
        c.post("/v1/chat/completions", json=CHAT)
    with client(urls[1]) as c:
        c.post("/v1/chat/completions", json=CHAT)
    real, sim = both("GET", "/metrics", *urls)
    assert real.status_code == sim.status_code == 200
    labels_real, labels_sim = metric_labels(real.text), metric_labels(sim.text)
    missing = sorted(n for n in labels_sim if n.startswith("sglang:") and n not in labels_real)
    assert not missing, f"exported by the simulator only: {missing}"
    wrong = {n: (labels_sim[n], labels_real[n]) for n in labels_sim
             if n.startswith("sglang:") and not labels_sim[n] <= labels_real[n]}
    assert not wrong, wrong


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_flush_cache(urls: tuple[str, str], method: str) -> None:
    real, sim = both(method, "/flush_cache", *urls)
    assert real.status_code == sim.status_code == 200
    assert real.text == sim.text
    assert real.headers.get("content-type") == sim.headers.get("content-type")


@pytest.mark.parametrize("path", ["/health", "/ready", "/health_generate"])
def test_health_and_ready(urls: tuple[str, str], path: str) -> None:
    real, sim = both("GET", path, *urls)
    assert real.status_code == sim.status_code == 200
    assert real.content == sim.content == b""


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_with_tool_choice_auto(urls: tuple[str, str]) -> None:
    real, sim = both("POST", "/v1/chat/completions", *urls,
                     json={**CHAT, "tools": TOOLS, "tool_choice": "auto"})
    assert real.status_code == 200, real.text
    assert_same_shape(real, sim)


def test_n_choices(urls: tuple[str, str]) -> None:
    real, sim = both("POST", "/v1/chat/completions", *urls, json={**CHAT, "n": 2})
    assert len(real.json()["choices"]) == 2
    assert len(sim.json()["choices"]) == 2


def test_logprobs(urls: tuple[str, str]) -> None:
    real, sim = both("POST", "/v1/chat/completions", *urls,
                     json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert real.json()["choices"][0]["logprobs"] is not None
    assert_same_shape(real, sim)
