"""The agents' APIs on the REAL SGLang 0.5.23 CPU server, beside the simulated replica
(shapes compared as in test_contract.py), and through the gateway with the official SDKs.

What the real server does (checked here): it serves ``/v1/messages`` (Anthropic shape,
``usage.cache_read_input_tokens`` when > 0; ``input_tokens`` excludes it),
``/v1/messages/count_tokens`` and ``/v1/responses`` (stateless: it checks the model
name; ``previous_response_id`` and ``GET /v1/responses/{id}`` answer 400 "Response store
is disabled" unless the server runs with ``--enable-response-store``, which these
fixtures do not pass; ``DELETE /v1/responses/{id}`` is 405: no such route in 0.5.23).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.api.sse import agent_events as events
from tests.integration.conftest import Gateway, start_gateway
from tests.sglang_real.conftest import MODEL, client
from tests.sglang_real.shapes import differences

pytestmark = pytest.mark.sglang_real

SYSTEM = "You route requests to replicas that hold their prefix in cache. " * 8
MESSAGE = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "ignore_eos": True,
           "messages": [{"role": "user", "content": "Say something about paging."}]}
RESPONSE = {"model": MODEL, "max_output_tokens": 4, "instructions": SYSTEM, "input": "Say something about paging."}


@pytest.fixture(scope="module")
def urls(real_urls: list[str], sim_url: str) -> tuple[str, str]:
    return real_urls[0], sim_url


def post_both(urls: tuple[str, str], path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    with client(urls[0]) as real, client(urls[1]) as sim:
        for _ in range(2):  # the second time the prefix is cached on both
            r, s = real.post(path, json=body), sim.post(path, json=body)
        return r, s


@pytest.mark.parametrize("path, body", [("/v1/messages", MESSAGE), ("/v1/responses", RESPONSE),
                                        ("/v1/messages/count_tokens", {k: v for k, v in MESSAGE.items()
                                                                       if k != "max_tokens"})])
def test_same_shape_as_the_real_server(urls: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    real, sim = post_both(urls, path, body)
    assert real.status_code == sim.status_code == 200, (real.text, sim.text)
    assert not differences(real.json(), sim.json()), differences(real.json(), sim.json())
    if path == "/v1/messages":
        assert real.json()["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.parametrize("path, body", [("/v1/messages", MESSAGE), ("/v1/responses", RESPONSE)])
def test_same_stream_grammar(urls: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    real, sim = post_both(urls, path, {**body, "stream": True})
    real_events, sim_events = events(real.content), events(sim.content)
    real_fixed = [(n, e) for n, e in real_events if not n.endswith("delta")]  # text deltas: one per update
    sim_fixed = [(n, e) for n, e in sim_events if not n.endswith("delta")]
    assert [n for n, _ in real_fixed] == [n for n, _ in sim_fixed]
    assert b"[DONE]" not in real.content and b"[DONE]" not in sim.content
    for (name, r), (_, s) in [*zip(real_fixed, sim_fixed), (real_events[-2], sim_events[-2])]:
        assert not differences(r, s), (name, differences(r, s))
    real_delta = next(e for n, e in real_events if n.endswith("text.delta") or n == "content_block_delta")
    sim_delta = next(e for n, e in sim_events if n.endswith("text.delta") or n == "content_block_delta")
    assert not differences(real_delta, sim_delta)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": []}, 400),  # (with a system prompt: 200)
    ("/v1/responses", {**RESPONSE, "model": "no-such-model"}, 404),
])
def test_same_errors(urls: tuple[str, str], path: str, body: dict[str, Any], status: int) -> None:
    real, sim = post_both(urls, path, body)
    assert real.status_code == sim.status_code == status
    assert real.json() == sim.json()


@pytest.fixture(scope="module")
def gateway(real_urls: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(real_urls, Path(tmp_path_factory.mktemp("gw-agents")) / "gateway.log")
    yield gw
    gw.proc.stop()


def test_sdks_through_the_gateway(gateway: Gateway) -> None:
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60.0,
                                 default_headers={"x-claude-code-session-id": "real-agents"})
    first = claude.messages.create(model=MODEL, max_tokens=4, system=SYSTEM,
                                   messages=[{"role": "user", "content": "Say something."}])
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=SYSTEM,
                                                   messages=[{"role": "user", "content": "Say something."}])
    assert (raw.parse().usage.cache_read_input_tokens or 0) > 0 and first.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=4, system=SYSTEM,
                                messages=[{"role": "user", "content": "Say something."}]) as stream:
        assert (stream.get_final_message().usage.cache_read_input_tokens or 0) > 0
    assert claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    codex = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    created = codex.responses.create(model=MODEL, instructions=SYSTEM, input="Say something.", max_output_tokens=4)
    assert created.id.startswith("resp_") and created.usage is not None
    assert codex.models.retrieve(MODEL).id == MODEL
    # no --enable-response-store: the pinned replica's own 400 is relayed, never another replica's answer
    with pytest.raises(openai.BadRequestError, match="Response store is disabled"):
        codex.responses.create(model=MODEL, input="more", previous_response_id=created.id, max_output_tokens=4)
