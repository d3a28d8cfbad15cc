"""Precise mode end to end over the simulated replica: `kvgate serve` in front of
`kvgate sim` processes that publish KV events (real ZMQ, real HTTP on loopback).

The simulator's token ids are its own (``gateway/word_tokens.py``), named in the
tokenizer_config.json of its model_path, so the gateway reproduces them: the prediction
it puts in ``x-kvgate-expected-cached-tokens`` equals the ``cached_tokens`` the replica
reports, turn after turn, and a flushed replica is predicted a miss at once.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway, wait_until

EVENTS = '{"publisher": "zmq", "endpoint": "tcp://*:0", "topic": "kv"}'
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta")


@pytest.fixture(scope="module")
def precise_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimFleet]]:
    logs = tmp_path_factory.mktemp("sim-precise")
    with SimFleet(2, profile="tiny", time_scale=8.0, seed=13, log_dir=logs,
                  extra_args=("--kv-events-config", EVENTS)) as fleet:
        gw = start_gateway(fleet.urls, logs / "gateway.log")
        try:
            def subscribed() -> bool:
                metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
                return 'kvgate_precise_replicas{state="precise"} 2.0' in metrics
            wait_until(subscribed, 30.0, "both replicas in precise mode")
            yield gw, fleet
        finally:
            gw.proc.stop()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _turn(gw: Gateway, session: str, messages: list[dict[str, str]]) -> tuple[str, int, int, str]:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60.0, headers={"x-kvgate-session": session},
                   json={"model": "tiny", "max_tokens": 8, "messages": messages})
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (r.headers["x-kvgate-replica"], int(r.headers["x-kvgate-expected-cached-tokens"]), cached,
            r.json()["choices"][0]["message"]["content"])


def test_prediction_equals_reported_cached_tokens(precise_gateway: tuple[Gateway, SimFleet]) -> None:
    gw, _ = precise_gateway
    rng = random.Random(5)
    pairs: list[tuple[int, int]] = []
    for s in range(3):
        messages = [{"role": "system", "content": _text(rng, 400)}]
        for _ in range(4):
            messages.append({"role": "user", "content": _text(rng, 150)})
            _, predicted, cached, answer = _turn(gw, f"precise-{s}", messages)
            pairs.append((predicted, cached))
            messages.append({"role": "assistant", "content": answer})
    assert all(p == c for p, c in pairs), pairs
    assert sum(c for _, c in pairs) > 0  # later turns were cache hits, predicted as such


def test_flush_is_predicted_a_miss(precise_gateway: tuple[Gateway, SimFleet]) -> None:
    gw, _ = precise_gateway
    rng = random.Random(9)
    messages = [{"role": "system", "content": _text(rng, 400)}, {"role": "user", "content": _text(rng, 100)}]
    replica, _, _, answer = _turn(gw, "precise-flush", messages)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": _text(rng, 50)}]

    def cleared() -> float:
        metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
        line = next(x for x in metrics.splitlines() if x.startswith('kvgate_kv_event_streams_total{outcome="cleared"}'))
        return float(line.split()[-1])

    before = cleared()
    assert httpx.post(replica + "/flush_cache", timeout=10.0).status_code == 200
    wait_until(lambda: cleared() > before, 10.0, "the AllBlocksCleared event applied")
    again, predicted, cached, _ = _turn(gw, "precise-flush", messages)
    if again == replica:
        assert predicted == 0 and cached == 0, (predicted, cached)
    else:  # moved: the other replica never held it either
        assert predicted == cached == 0
