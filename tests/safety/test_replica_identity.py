"""Canonical replica identity over a real ``kvgate serve`` (issue 41, item 7).

Found: with the admin token, ``169.254.169.254``, ``metadata.google.internal`` and
``[fd00:ec2::254]`` were accepted as replicas (a replica gets every prompt; the metadata
service hands out cloud credentials), and three spellings of one replica
(``HTTP://...``, ``0.0.0.0``, ``0x7f000001``) became three active replicas. Now a
replica URL is canonicalized (replicas/urls.py) wherever an id is made from it: the
three spellings are one replica, found by any spelling for remove / drain / undrain, and
link-local / metadata addresses are a 400 with the reason.
"""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import AUTH, Gateway, start_gateway, wait_until
from tests.support.procs import kvgate_cmd

pytestmark = pytest.mark.safety

TIMEOUT_S = 10.0
METADATA_URLS = ["http://169.254.169.254", "http://169.254.169.254/latest/meta-data",
                 "http://metadata.google.internal", "http://[fd00:ec2::254]", "http://[fe80::1]:30000",
                 "http://0xa9fea9fe", "http://[::ffff:169.254.169.254]", "http://metadata.google.internal.:80"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=5.0, seed=3, log_dir=tmp_path_factory.mktemp("sim")) as f:
        yield f


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway with no replica: the test adds them through the admin API."""
    g = start_gateway([], tmp_path_factory.mktemp("gw") / "gw.log")
    yield g
    g.proc.stop()


def _admin(gw: Gateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One admin call, bounded by ``TIMEOUT_S``."""
    return httpx.request(method, gw.url + "/admin" + path, headers=AUTH, timeout=TIMEOUT_S, **kwargs)


def _spellings(url: str) -> list[str]:
    """``http://127.0.0.1:P`` as the finding spelled it, and a few more aliases."""
    port = url.rsplit(":", 1)[1]
    return [f"HTTP://127.0.0.1:{port}", f"http://0.0.0.0:{port}", f"http://0x7f000001:{port}",
            f"http://2130706433:{port}/", f"http://127.1:{port}", f"http://[::ffff:127.0.0.1]:{port}"]


def _urls(gw: Gateway) -> list[str]:
    got = _admin(gw, "GET", "/replicas")
    got.raise_for_status()
    return [v["url"] for v in got.json()["data"]]


def test_spellings_of_one_replica_are_one_entry(gw: Gateway, fleet: SimFleet) -> None:
    canonical = fleet.urls[0]
    try:
        added = [_admin(gw, "POST", "/replicas", json={"url": url}) for url in _spellings(canonical)]
        assert [r.status_code for r in added] == [201] * len(added), [r.text for r in added]
        assert {r.json()["url"] for r in added} == {canonical}
        assert _urls(gw) == [canonical]
        wait_until(lambda: _admin(gw, "GET", "/replicas").json()["data"][0]["state"] == "active", 30.0,
                   "the replica to become active")
        assert _urls(gw) == [canonical]  # still one once its probes passed
    finally:
        _admin(gw, "DELETE", "/replicas", params={"url": canonical})
    assert _urls(gw) == []


def test_any_spelling_finds_the_replica(gw: Gateway, fleet: SimFleet) -> None:
    """Undrain, drain and remove by spellings other than the one added (an idle replica
    is removed as soon as it is drained: nothing is in flight)."""
    idle = "http://127.0.0.1:9"  # nothing listens: stays joining
    for remove_by in ("http://2130706433:9", "http://[::ffff:7f00:1]:9/"):
        assert _admin(gw, "POST", "/replicas", json={"url": "HTTP://0x7f000001:9"}).json()["url"] == idle
        undrained = _admin(gw, "POST", "/replicas/undrain", json={"url": "http://0.0.0.0:9/"})
        assert undrained.status_code == 200 and undrained.json()["url"] == idle, undrained.text
        removed = _admin(gw, "DELETE", "/replicas", params={"url": remove_by})
        assert removed.status_code == 200 and removed.json() == {"removed": idle}, removed.text
        assert _urls(gw) == []
    spelled = _spellings(fleet.urls[0])
    assert _admin(gw, "POST", "/replicas", json={"url": spelled[0]}).status_code == 201
    try:
        drained = _admin(gw, "POST", "/replicas/drain", json={"url": spelled[4], "deadline_s": 120})
        assert drained.status_code == 200 and drained.json()["url"] == fleet.urls[0], drained.text
        wait_until(lambda: _urls(gw) == [], 10.0, "the drained replica to be removed")
    finally:
        _admin(gw, "DELETE", "/replicas", params={"url": fleet.urls[0]})


def test_link_local_and_metadata_are_400_with_a_reason(gw: Gateway) -> None:
    answers = {url: _admin(gw, "POST", "/replicas", json={"url": url}) for url in METADATA_URLS}
    for url, r in answers.items():
        assert r.status_code == 400, (url, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == "url", (url, r.text)
        assert "allow_link_local_replicas" in error["message"], (url, r.text)
        assert "metadata" in error["message"] or "link-local" in error["message"], (url, r.text)
    assert _urls(gw) == []
    assert "Traceback" not in gw.proc.output()


def test_static_replicas_are_canonical_too(fleet: SimFleet, tmp_path: Path) -> None:
    """The same spellings on the command line start one replica (the config validator
    uses the same normalizer)."""
    g = start_gateway(_spellings(fleet.urls[0])[:3], tmp_path / "gw.log")
    try:
        assert _urls(g) == [fleet.urls[0]]
    finally:
        g.proc.stop()


def test_metadata_static_replica_is_a_start_up_error(tmp_path: Path) -> None:
    done = subprocess.run(kvgate_cmd("serve", "--replica", "http://169.254.169.254", "--port", "0"),
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "registry.replicas" in lines[0] and "metadata" in lines[0], done.stderr
