"""A real ``kvgate serve`` in front of one ``https://`` simulated replica (``kvgate sim
--ssl-certfile/--ssl-keyfile``, a certificate for 127.0.0.1 signed by a CA made for the test).

With ``upstream.tls_ca_file`` the replica's probes pass over TLS and chat completions,
streamed and not, come back whole; without it the system trust store refuses the
certificate: the replica never becomes routable and a request fails at once with a 503.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import GatewayFactory, wait_until
from tests.support.tls import Pki, make_pki

BODY = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello over tls"}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_replica(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=20.0, seed=5, log_dir=tmp_path_factory.mktemp("tls-sim"),
                  tls=(pki.cert_file, pki.key_file), ca_file=pki.ca_file) as fleet:
        yield fleet


def test_https_replica_serves_chat_through_the_gateway(tls_replica: SimFleet, pki: Pki,
                                                       make_gateway: GatewayFactory) -> None:
    url = tls_replica.urls[0]
    assert url.startswith("https://127.0.0.1:")
    gw = make_gateway([url], "--set", f"upstream.tls_ca_file={pki.ca_file}")  # returns once /ready
    assert gw.replicas()[url]["state"] == "active"

    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    answer = r.json()
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]

    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30.0,
                      trust_env=False) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        text = "".join(s.iter_text())
    events = [block for block in text.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events), text
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(event[len("data: "):]) for event in events[:-1]]
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    gw.assert_quiet()


def test_https_replica_with_an_unknown_ca_is_never_routable(tls_replica: SimFleet,
                                                            make_gateway: GatewayFactory) -> None:
    """No ``tls_ca_file``: the system store does not know the test CA."""
    url = tls_replica.urls[0]
    gw = make_gateway([], "--replica", url)  # not waiting for /ready: it never comes
    deadline = time.monotonic() + 3.0  # six probe intervals
    while time.monotonic() < deadline:
        assert gw.replicas()[url]["state"] != "active"
        assert httpx.get(gw.url + "/ready", timeout=5.0, trust_env=False).status_code == 503
        time.sleep(0.25)
    start = time.monotonic()
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=30.0, trust_env=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"
    assert time.monotonic() - start < 5.0
    wait_until(lambda: "certificate" in gw.proc.output().lower(), 10.0, "the probe's certificate error logged")


def test_sim_serves_https_only_to_clients_that_trust_its_ca(tls_replica: SimFleet, pki: Pki) -> None:
    url = tls_replica.urls[0]
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health", timeout=5.0, trust_env=False)
    assert httpx.get(url + "/health", timeout=5.0, trust_env=False, verify=tls_replica.verify).status_code == 200
