"""Fixtures over real SGLang 0.5.23 servers on the CPU (issue 11).

The environment and the tiny model are built on first use (``tools/sglang_cpu/install.sh``,
cached per machine); when they cannot be built the tests FAIL, never skip: a quick local
run deselects them with ``-m "not sglang_real"``. Two real servers are started once for
this package (~30-50 s, ~2.1 GB RSS each; package scope, so they are stopped after its
last test, not at the end of the whole run); one simulated replica with the matching
``tiny-cpu`` profile serves the differential tests. A third real server, the spare of
``sigterm_spare``, starts with them when a collected test asks for it (it is warm by
the time that test runs: starting it later costs 60-90 s on a loaded 2-core machine).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.sglang_cpu.env import SGLangEnv, ensure_env
from loadtest.sglang_cpu.server import AUTO_PORT, ServerSpec, SGLangServer, start_all, stop_all
from loadtest.simulator.fleet import SimFleet

MAX_TOTAL_TOKENS = 16384
MODEL = "tiny-llama"


@pytest.fixture(scope="package")
def sglang_env() -> SGLangEnv:
    return ensure_env()  # raises (the test errors) when the environment cannot be built


@pytest.fixture(scope="package")
def early_spares(sglang_env: SGLangEnv, request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SGLangServer]]:
    """The spare a test may stop (fixture ``sigterm_spare``), started with the shared two
    so that it is warm when that test comes, and only when such a test was collected."""
    wanted = any("sigterm_spare" in getattr(item, "fixturenames", ()) for item in request.session.items)
    log_dir = tmp_path_factory.mktemp("sglang-spare")
    spares = [SGLangServer(sglang_env, ServerSpec(port=AUTO_PORT, max_total_tokens=MAX_TOTAL_TOKENS),
                           log_dir / "sglang-spare.log")] if wanted else []
    for server in spares:
        server.start()  # not waited for here
    yield spares
    stop_all(spares)


@pytest.fixture(scope="package")
def real_servers(sglang_env: SGLangEnv, early_spares: list[SGLangServer],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SGLangServer]]:
    log_dir = tmp_path_factory.mktemp("sglang-real")
    servers = [SGLangServer(sglang_env, ServerSpec(port=AUTO_PORT, max_total_tokens=MAX_TOTAL_TOKENS),
                            log_dir / f"sglang-{i}.log") for i in range(2)]
    start_all(servers)
    yield servers
    stop_all(servers)


@pytest.fixture
def sigterm_spare(early_spares: list[SGLangServer]) -> SGLangServer:
    """A real server (not one of the shared two) that the test may SIGTERM or kill."""
    (server,) = early_spares
    server.wait_healthy()
    return server


@pytest.fixture(scope="package")
def real_urls(real_servers: list[SGLangServer]) -> list[str]:
    return [s.url for s in real_servers]


@pytest.fixture(scope="package")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with SimFleet(1, profile="tiny-cpu", time_scale=50.0, seed=3,
                  log_dir=tmp_path_factory.mktemp("sim-tiny-cpu")) as fleet:
        yield fleet.urls[0]


def client(url: str) -> httpx.Client:
    """A client that ignores proxy variables (the servers run with closed-port proxies)."""
    return httpx.Client(base_url=url, timeout=60.0, trust_env=False)


def log_tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
