"""The admin API is locked by default and validates what it is given (real ``kvgate serve``).

Finding 4 of issue 10: with no token the admin API was open (4 calls sent every prompt to
a rogue replica). Finding 10: ``http://[::1`` was accepted, a NUL gave a 500 and a probe
traceback every 2 s. Now: no token configured -> one is generated into a 0600 file (path
logged, never the token); bad URLs -> 400 with ``param: url``; a separate admin port
serves only ``/admin`` and the main port none of it.
"""
from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import AUTH, Gateway, start_gateway
from tests.support.procs import Proc, free_port, kvgate_cmd, wait_http

pytestmark = pytest.mark.safety

BAD_URLS = [
    "http://[::1", "http://a\x00b:1", "http://h\r\nx:1", "http://h :1", "ftp://h:1", "h:1", "//h:1", "http://",
    "http://:80", "http://u:p@h:1", "http://u@h:1", "http://h:99999", "http://h:0", "http://h:x", "http://h:1/?q=1",
    "http://h:1/#f", "http://-bad-:1", "http://999.1.1.1:1", "http://[::g]:1", "http://" + "a" * 3000, "",
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=5.0, seed=3, log_dir=tmp_path_factory.mktemp("sim")) as f:
        yield f


def _serve(replica: str, log: Path, *extra: str) -> tuple[Proc, str]:
    """A gateway started without --admin-token (``start_gateway`` always passes one)."""
    port = free_port()
    proc = Proc(kvgate_cmd("serve", "--port", str(port), "--replica", replica, "--log-level", "info", *extra), log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", timeout_s=30.0, proc=proc.popen)
    return proc, url


def test_no_token_configured_generates_one(fleet: SimFleet, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    proc, url = _serve(fleet.urls[0], tmp_path / "gw.log", "--set", f'admin.generated_token_dir="{tokens}"')
    try:
        port = url.rsplit(":", 1)[1]
        token_file = tokens / f"admin-token-{port}"
        token = token_file.read_text().strip()
        mode = stat.S_IMODE(token_file.stat().st_mode)
        none = httpx.get(url + "/admin/replicas", timeout=5.0)
        wrong = httpx.get(url + "/admin/replicas", headers={"authorization": "Bearer nope"}, timeout=5.0)
        right = httpx.get(url + "/admin/replicas", headers={"authorization": f"Bearer {token}"}, timeout=5.0)
        rogue = httpx.post(url + "/admin/replicas", json={"url": "http://127.0.0.1:9"}, timeout=5.0)
    finally:
        proc.stop()
    assert mode == 0o600 and len(token) >= 32
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
    assert right.status_code == 200 and right.json()["data"][0]["url"] == fleet.urls[0]
    assert rogue.status_code == 401
    log = proc.output()
    assert str(token_file) in log and token not in log
    assert not token_file.exists()  # removed at exit


def test_token_file(fleet: SimFleet, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    proc, url = _serve(fleet.urls[0], tmp_path / "gw.log", "--admin-token-file", str(secret))
    try:
        ok = httpx.get(url + "/admin/config", headers={"authorization": "Bearer from-a-file"}, timeout=5.0)
    finally:
        proc.stop()
    assert ok.status_code == 200 and ok.json()["admin"]["token"] == "***"
    assert "from-a-file" not in proc.output()


@pytest.fixture(scope="module")
def gw(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(fleet.urls, tmp_path_factory.mktemp("gw") / "gw.log")
    yield g
    g.proc.stop()


def test_bad_replica_urls_are_400_never_500(gw: Gateway, fleet: SimFleet) -> None:
    answers = {url: gw.admin("POST", "/replicas", json={"url": url}) for url in BAD_URLS}
    for url, r in answers.items():
        assert r.status_code == 400, (url, r.status_code, r.text)
        assert r.json()["error"]["param"] == "url", (url, r.text)
    not_json = gw.admin("POST", "/replicas", content=b"\x00{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    assert list(gw.replicas()) == fleet.urls  # nothing was added
    metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
    assert 'kvgate_admin_requests_total{route="/admin/replicas",status="400"}' in metrics
    assert "Traceback" not in gw.proc.output()


def test_valid_urls_are_accepted(gw: Gateway) -> None:
    for url in ("http://127.0.0.1:9", "https://[::1]:9", "http://replica-0.sglang.svc:30000"):
        added = gw.admin("POST", "/replicas", json={"url": url})
        assert added.status_code == 201, (url, added.text)
        assert gw.admin("DELETE", "/replicas", params={"url": url}).status_code == 200


def test_drain_remaining_is_on_the_registrys_clock(gw: Gateway) -> None:
    url = "http://127.0.0.1:9"  # joining forever: nothing listens there
    assert gw.admin("POST", "/replicas", json={"url": url}).status_code == 201
    try:
        drained = gw.admin("POST", "/replicas/drain", json={"url": url, "deadline_s": 120})
        huge = gw.admin("POST", "/replicas/drain", content=b'{"url": "%s", "deadline_s": 1e400}' % url.encode(),
                        headers={"content-type": "application/json"})
    finally:
        gw.admin("DELETE", "/replicas", params={"url": url})
    assert drained.status_code == 200, drained.text
    assert 0 < drained.json()["drain_remaining_s"] <= 120  # was ~1.8e9 with mixed clocks
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "deadline_s"


def test_separate_admin_port(fleet: SimFleet, tmp_path: Path) -> None:
    admin_port = free_port()
    gw = start_gateway(fleet.urls, tmp_path / "gw.log", "--set", f"admin.port={admin_port}")
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        on_main = httpx.get(gw.url + "/admin/replicas", headers=AUTH, timeout=5.0)
        on_admin = httpx.get(admin_url + "/admin/replicas", headers=AUTH, timeout=5.0)
        health_on_admin = httpx.get(admin_url + "/health", timeout=5.0)
        ready_on_main = httpx.get(gw.url + "/ready", timeout=5.0)
    finally:
        gw.proc.stop()
    assert on_main.status_code == 404 and on_main.json()["error"]["code"] == "not_found"
    assert on_admin.status_code == 200 and on_admin.json()["data"][0]["url"] == fleet.urls[0]
    assert health_on_admin.status_code == 200  # the probes are on the admin listener too (issue 41)
    assert ready_on_main.status_code == 200
