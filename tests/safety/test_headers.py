"""Header hygiene end to end: what a replica receives (the raw replica echoes its headers)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import start_gateway
from tests.safety.raw_replica import raw_fleet
from tests.support.procs import Proc, free_port, wait_http

pytestmark = pytest.mark.safety
CLIENT_HEADERS = {
    "content-type": "application/json", "connection": "keep-alive, x-hop-secret", "x-hop-secret": "1",
    "proxy-authorization": "Basic eDp5", "x-kvgate-replica": "http://rogue", "x-kvgate-session": "s1",
    "authorization": "Bearer client-secret", "x-forwarded-for": "10.1.2.3", "x-request-token": "h1",
    "x-custom": "kept", "te": "trailers",
}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _received(gw_url: str) -> dict[str, list[str]]:
    r = httpx.post(gw_url + "/v1/chat/completions", content=BODY, headers=CLIENT_HEADERS, timeout=10.0)
    assert r.status_code == 200, r.text
    received: dict[str, list[str]] = {}
    for name, value in r.json()["headers"]:
        received.setdefault(name, []).append(value)
    return received


# `kvgate serve` hands its settings to the app as JSON, where a SecretStr is masked (only
# admin.token is restored, gateway/serve_cmd.py): the keyed gateway runs create_app itself
KEYED = """
import sys, uvicorn
from gateway.app import create_app
from gateway.settings import load_settings
s = load_settings(None, {"registry": {"replicas": [sys.argv[2]], "probe_interval_s": 0.5},
                         "upstream": {"replica_api_key": "replica-key"}})
uvicorn.run(create_app(s), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_replica_gets_clean_headers(tmp_path: Path) -> None:
    with raw_fleet(1, tmp_path) as fleet:
        plain = start_gateway(fleet.urls, tmp_path / "plain.log")
        port = free_port()
        keyed = Proc([sys.executable, "-c", KEYED, str(port), fleet.urls[0]], tmp_path / "keyed.log")
        try:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=30.0, proc=keyed.popen)
            got, with_key = _received(plain.url), _received(f"http://127.0.0.1:{port}")
        finally:
            plain.proc.stop()
            keyed.stop()
    for name in ("x-hop-secret", "proxy-authorization", "x-kvgate-replica", "x-kvgate-session", "te", "expect",
                 "authorization", "user-agent-of-the-gateway"):
        assert name not in got, (name, got)
    assert got["connection"] != ["keep-alive, x-hop-secret"] if "connection" in got else True
    assert got["x-custom"] == ["kept"]
    assert got["x-forwarded-for"] == ["10.1.2.3, 127.0.0.1"]
    assert got["x-forwarded-proto"] == ["http"] and got["x-forwarded-host"][0].startswith("127.0.0.1:")
    assert with_key["authorization"] == ["Bearer replica-key"]
