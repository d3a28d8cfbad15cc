"""Fixtures for integration tests over real processes: simulated replicas (``kvgate sim``
through ``SimFleet``, profile ``tiny``) and a real uvicorn gateway (``kvgate serve``).

Every process is stopped at teardown; every wait has a timeout. Helpers here are plain
functions so tests can start extra gateways with other flags.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.support.procs import Proc, free_port, kvgate_cmd, wait_http

ADMIN_TOKEN = "integration-token"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


class Gateway:
    """A ``kvgate serve`` process and its base URL."""

    def __init__(self, proc: Proc, url: str) -> None:
        self.proc = proc
        self.url = url

    def admin(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.url + "/admin" + path, headers=AUTH | (headers or {}), timeout=60.0,
                             **kwargs)

    def assert_quiet(self) -> None:
        """Nothing logged as an error, no traceback."""
        log = self.proc.output()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]

    def metrics(self) -> str:
        """The gateway's ``/metrics`` text (loopback: no proxy)."""
        r = httpx.get(self.url + "/metrics", timeout=10.0, trust_env=False)
        r.raise_for_status()
        return r.text

    def metric(self, series: str) -> float:
        """`metric_value` of ``series`` on the gateway's ``/metrics`` now."""
        return metric_value(self.metrics(), series)

    def replicas(self) -> dict[str, dict[str, Any]]:
        r = self.admin("GET", "/replicas")
        r.raise_for_status()
        return {v["url"]: v for v in r.json()["data"]}


def metric_value(text: str, series: str) -> float:
    """The sum of the samples of ``series`` in a Prometheus exposition: a metric name (all
    its label sets) or one labelled series, spelled as exposed (``name{reason="idle"}``)."""
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if not line.startswith("#") and (key == series or ("{" not in series and key.startswith(series + "{"))):
            total += float(value)
    return total


def start_gateway(replicas: list[str], log_path: Path, *extra: str) -> Gateway:
    """A `kvgate serve` process; relaunched on a new port if its free port was taken
    between choosing and binding (another test's process got it first)."""
    for attempt in range(3):
        port = free_port()
        args = ["serve", "--port", str(port), "--admin-token", ADMIN_TOKEN, "--log-level", "warning",
                "--set", "registry.probe_interval_s=0.5", "--set", "registry.loads_poll_interval_s=0.5",
                "--set", "policy.seed=7"]
        for url in replicas:
            args += ["--replica", url]
        proc = Proc(kvgate_cmd(*args, *extra), log_path)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", timeout_s=30.0, proc=proc.popen)
            if proc.popen.poll() is not None:  # another process answered on that port
                raise TimeoutError("gateway exited")
            if replicas:
                wait_http(url + "/ready", timeout_s=30.0, proc=proc.popen)
        except TimeoutError:
            proc.stop()
            output = proc.output()
            if "address already in use" in output and attempt < 2:
                continue
            raise RuntimeError(f"gateway did not start:\n{output[-3000:]}") from None
        return Gateway(proc, url)
    raise AssertionError("unreachable")


GatewayFactory = Callable[..., Gateway]


@pytest.fixture
def make_gateway(tmp_path: Path) -> Iterator[GatewayFactory]:
    started: list[Gateway] = []

    def factory(replicas: list[str], *extra: str) -> Gateway:
        gw = start_gateway(replicas, tmp_path / f"gateway-{len(started)}.log", *extra)
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        gw.proc.stop()


@pytest.fixture
def fleet3(tmp_path: Path) -> Iterator[SimFleet]:
    with SimFleet(3, profile="tiny", time_scale=2.0, seed=11, log_dir=tmp_path) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(4, profile="tiny", time_scale=2.0, seed=21,
                  log_dir=tmp_path_factory.mktemp("fleet4")) as fleet:
        yield fleet


def set_faults(replica_url: str, **faults: Any) -> None:
    httpx.post(replica_url + "/_sim/faults", json=faults, timeout=5.0).raise_for_status()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
