"""Two models behind one gateway, over real processes: two simulated replicas serving
``model-a`` and one serving ``model-b`` (``kvgate sim --model NAME``) behind one
``kvgate serve``. Every request reaches a replica serving its model, ``/v1/models`` lists
both, an unknown model is a 404 in each API's shape, and a session id reused across the
two models never takes model A's turns to model B's replica."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway

SYSTEM = " ".join(f"Rule {i}: answer briefly and cite section {i * 7 % 13}." for i in range(40))


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, SimFleet]]:
    with SimFleet(2, profile="tiny", time_scale=2.0, seed=31, extra_args=["--model", "model-a"],
                  log_dir=tmp_path_factory.mktemp("model-a")) as a, \
            SimFleet(1, profile="tiny", time_scale=2.0, seed=41, extra_args=["--model", "model-b"],
                     log_dir=tmp_path_factory.mktemp("model-b")) as b:
        yield a, b


@pytest.fixture(scope="module")
def gw(fleets: tuple[SimFleet, SimFleet], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    a, b = fleets
    gateway = start_gateway([*a.urls, *b.urls], tmp_path_factory.mktemp("gw") / "gateway.log",
                            "--set", 'models.aliases={"public-b": "model-b"}')
    yield gateway
    gateway.proc.stop()


def chat(gw: Gateway, model: str, text: str, session: str | None = None) -> httpx.Response:
    headers = {"x-kvgate-session": session} if session else {}
    body = {"model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60.0)


def test_the_simulated_replica_serves_the_chosen_name(fleets: tuple[SimFleet, SimFleet]) -> None:
    url = fleets[1].urls[0]
    assert [c["id"] for c in httpx.get(url + "/v1/models", timeout=10.0).json()["data"]] == ["model-b"]
    assert httpx.get(url + "/model_info", timeout=10.0).json()["served_model_name"] == "model-b"
    assert httpx.get(url + "/server_info", timeout=10.0).json()["served_model_name"] == "model-b"


def test_models_lists_both_and_the_alias(gw: Gateway) -> None:
    listed = httpx.get(gw.url + "/v1/models", timeout=10.0).json()["data"]
    assert sorted(c["id"] for c in listed) == ["model-a", "model-b", "public-b"]


def test_every_request_reaches_a_replica_of_its_model(gw: Gateway, fleets: tuple[SimFleet, SimFleet]) -> None:
    a, b = fleets
    for i in range(8):
        for model, pool in (("model-a", a.urls), ("model-b", b.urls), ("public-b", b.urls)):
            r = chat(gw, model, f"question {i} for {model}", session=f"one-{model}-{i}")
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] in pool, (model, r.headers)
    completion = httpx.post(gw.url + "/v1/completions", json={"model": "model-b", "prompt": "hi", "max_tokens": 2},
                            timeout=60.0)
    assert completion.status_code == 200 and completion.headers["x-kvgate-replica"] in b.urls
    messages = httpx.post(gw.url + "/v1/messages", timeout=60.0, json={
        "model": "model-a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 200 and messages.headers["x-kvgate-replica"] in a.urls
    metrics = gw.metrics()
    assert 'model="model-a"' in metrics and 'model="model-b"' in metrics and "public-b" not in metrics


def test_a_session_reused_across_models_stays_in_each_models_pool(
        gw: Gateway, fleets: tuple[SimFleet, SimFleet]) -> None:
    a, b = fleets
    homes_a = set()
    for turn in range(6):  # one session id, both models interleaved (as an agent's main and small models)
        ra = chat(gw, "model-a", f"main turn {turn}", session="shared-session")
        rb = chat(gw, "model-b", f"small turn {turn}", session="shared-session")
        assert ra.status_code == 200 and rb.status_code == 200
        homes_a.add(ra.headers["x-kvgate-replica"])
        assert rb.headers["x-kvgate-replica"] in b.urls
    assert homes_a <= set(a.urls)


@pytest.mark.parametrize("path, body, anthropic", [
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, False),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, False),
    ("/v1/responses", {"model": "nope", "input": "hi"}, False),
    ("/v1/messages", {"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, True),
])
def test_unknown_model_is_404_in_each_shape(gw: Gateway, path: str, body: dict[str, object],
                                            anthropic: bool) -> None:
    r = httpx.post(gw.url + path, json=body, timeout=30.0)
    assert r.status_code == 404 and r.headers["x-kvgate-replica"] == "none"
    message = "The model 'nope' does not exist"
    if anthropic:
        assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": message}}
    else:
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                      "code": "model_not_found", "param": "model"}}
