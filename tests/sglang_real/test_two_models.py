"""Two models behind one gateway over REAL SGLang CPU servers (issue 44).

One ``kvgate serve`` in front of the package's servers: model A is ``tiny-llama`` on
shared server 0 (``real_servers``: no KV events, routed approximately; server 1 is stopped
by test_routing.py before this module runs), model B is
``tiny-kimi`` on the TikToken-form server (``tiktoken_server``: another tiny model with
another tokenizer, publishing KV events, so routing on it is precise), with the alias
``kimi -> tiny-kimi`` (``models.aliases``). No server is started for this module. Asserted:

- every request of the agents' three APIs (chat completions, Anthropic messages,
  Responses; streamed and not) naming A, B or the alias is answered 200 by a replica of
  that model (``x-kvgate-replica``), and the answer names the served model (the alias is
  forwarded as ``tiny-kimi``: SGLang answers 404 to a Responses request for a name it
  does not serve);
- ``GET /v1/models`` lists both models and the alias; the admin API shows each replica's model;
- a model no replica serves is a 404 ``model_not_found`` in each API's shape, routed nowhere;
- a session of one model never affects the other's index: after several turns of a
  session of one model on a long prefix, the same conversation sent to the other model
  is predicted uncached there (``x-kvgate-expected-cached-tokens``) and its engine
  reports it uncached; sent once more it is predicted cached (the first zero was a
  prediction, not a blind spot). The same session id serves both models, each on a
  replica of its own, A's turns on one replica throughout.

Output text is random (random weights): only statuses, routing, model names and cached
token counts are asserted.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.sglang_cpu.cli import TIKTOKEN_MODEL_NAME
from loadtest.sglang_cpu.server import SGLangServer
from tests.api.sse import agent_events
from tests.integration.conftest import Gateway, metric_value, start_gateway, wait_until
from tests.sglang_real.conftest import MODEL, TIKTOKEN_PAGE
from tests.sglang_real.shapes import sse_events

pytestmark = pytest.mark.sglang_real

A, B, ALIAS = MODEL, TIKTOKEN_MODEL_NAME, "kimi"
SERVED = {A: A, B: B, ALIAS: B}
LABELS = {A: "Alpaca", B: "Kestrel"}
SYSTEM = "You route requests to the replicas that hold their prefix. " * 4
TURNS = 4
UNCACHED = 4 * TIKTOKEN_PAGE  # at most the chat template's head (a few tokens) is shared with other prompts
WARM = 100  # cached tokens of a conversation of ~1000 tokens that a replica holds
Pools = dict[str, list[str]]


@pytest.fixture(scope="module")
def pools(real_urls: list[str], tiktoken_server: SGLangServer) -> Pools:
    # shared server 0 only: test_routing.py's SIGTERM test stops server 1, and runs before this module
    return {A: real_urls[:1], B: [tiktoken_server.url]}


@pytest.fixture(scope="module")
def gw(pools: Pools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway([*pools[A], *pools[B]], Path(tmp_path_factory.mktemp("gw-two-models")) / "gateway.log",
                            "--set", f'models.aliases={{"{ALIAS}": "{B}"}}')
    try:
        wait_until(lambda: all(r["models"] for r in gateway.replicas().values()), 60.0, "every replica's models")
        wait_until(lambda: 'kvgate_precise_replicas{state="precise"} 1.0' in gateway.metrics(), 60.0, "B precise")
        yield gateway
    finally:
        gateway.proc.stop()


def request(api: str, model: str, text: str, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(path, body) of a short request of ``api`` for ``model``."""
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "max_tokens": 4, "stream": stream, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}
    if api == "messages":
        return "/v1/messages", {"model": model, "max_tokens": 4, "stream": stream, "system": SYSTEM,
                                "messages": [{"role": "user", "content": text}]}
    return "/v1/responses", {"model": model, "max_output_tokens": 4, "stream": stream, "instructions": SYSTEM,
                             "input": text}


def post(gw: Gateway, path: str, body: dict[str, Any], session: str | None = None) -> httpx.Response:
    headers = {"x-kvgate-session": session} if session else {}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=120.0, trust_env=False)


def answered_model(api: str, r: httpx.Response, stream: bool) -> str:
    """The model the engine's answer names (every chunk's, for a streamed chat completion)."""
    if not stream:
        return str(r.json()["model"])
    if api == "chat":
        chunks = sse_events(r.content)
        assert chunks[-1] == "[DONE]", chunks[-3:]
        (model,) = {c["model"] for c in chunks[:-1]}
        return str(model)
    events = agent_events(r.content)
    if api == "messages":
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop", [n for n, _ in events]
        return str(events[0][1]["message"]["model"])
    assert events[-1][0] in ("response.completed", "response.incomplete"), [n for n, _ in events]
    return str(events[-1][1]["response"]["model"])


def test_models_lists_both_and_the_alias(gw: Gateway, pools: Pools) -> None:
    listed = httpx.get(gw.url + "/v1/models", timeout=10.0, trust_env=False).json()["data"]
    assert sorted(c["id"] for c in listed) == sorted([A, B, ALIAS])
    card = httpx.get(f"{gw.url}/v1/models/{ALIAS}", timeout=10.0, trust_env=False)
    assert card.status_code == 200 and card.json()["id"] == ALIAS
    assert {url: r["models"] for url, r in gw.replicas().items()} == {
        url: [model] for model, urls in pools.items() for url in urls}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_every_request_reaches_a_replica_of_its_model(gw: Gateway, pools: Pools, api: str, stream: bool) -> None:
    for model, served in SERVED.items():
        r = post(gw, *request(api, model, f"One {api} question for {model}.", stream))
        assert r.status_code == 200, (model, r.text)
        assert r.headers["x-kvgate-replica"] in pools[served], (model, r.headers)
        assert answered_model(api, r, stream) == served
    metrics = gw.metrics()
    assert all(f'model="{m}"' in metrics for m in (A, B)) and f'model="{ALIAS}"' not in metrics


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_unknown_model_is_404_in_each_shape(gw: Gateway, api: str, stream: bool) -> None:
    r = post(gw, *request(api, "no-such-model", "hi", stream))
    assert r.status_code == 404 and r.headers["x-kvgate-replica"] == "none", r.text
    message = "The model 'no-such-model' does not exist"
    if api == "messages":
        assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": message}}
    else:
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                      "code": "model_not_found", "param": "model"}}
    card = httpx.get(gw.url + "/v1/models/no-such-model", timeout=10.0, trust_env=False)
    assert card.status_code == 404 and card.json()["error"]["code"] == "model_not_found"


def chat_turn(gw: Gateway, model: str, messages: list[dict[str, Any]], session: str) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, the engine's cached tokens) of one chat completion."""
    r = post(gw, "/v1/chat/completions", {"model": model, "max_tokens": 4, "messages": messages}, session)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.headers["x-kvgate-replica"], int(r.headers["x-kvgate-expected-cached-tokens"]), cached


@pytest.mark.parametrize("first, second", [(A, B), (B, A)])
def test_a_session_of_one_model_never_affects_the_others_index(gw: Gateway, pools: Pools, first: str,
                                                               second: str) -> None:
    session = f"two-models-{first}"  # one session id for both models, as an agent's main and small model
    messages: list[dict[str, Any]] = [{"role": "system", "content": " ".join(  # first words differ by model
        f"{LABELS[first]} rule {i}: keep page {i * 7 % 13} of the shared prefix warm." for i in range(60))}]
    homes = set()
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn}: go on."})
        home, expected, cached = chat_turn(gw, first, messages, session)
        homes.add(home)
        if turn:
            assert expected >= WARM and cached >= WARM, (turn, expected, cached)  # the session's replica warms
        messages.append({"role": "assistant", "content": f"Done {turn}."})
    assert len(homes) == 1 and homes <= set(pools[first]), homes
    messages.append({"role": "user", "content": f"Turn {TURNS}: go on."})
    other, expected, cached = chat_turn(gw, second, messages, session)  # the same text, the other model
    assert other in pools[second] and expected <= UNCACHED and cached <= UNCACHED, (other, expected, cached)
    again, expected, cached = chat_turn(gw, second, messages, session)
    assert again == other and expected >= WARM and cached >= WARM, (again, expected, cached)
    home, expected, cached = chat_turn(gw, first, messages, session)  # the first model's session is intact
    assert {home} == homes and expected >= WARM and cached >= WARM, (home, expected, cached)


def test_a_request_of_the_approximate_model_is_never_tokenized_for_the_other(gw: Gateway) -> None:
    before = metric_value(gw.metrics(), "kvgate_precise_tokenize_total")
    for i in range(3):
        path, body = request("chat", A, f"Question {i} for the approximate model only.")
        assert post(gw, path, body).status_code == 200
    assert metric_value(gw.metrics(), "kvgate_precise_tokenize_total") == before
