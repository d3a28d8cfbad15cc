"""Fixtures over real SGLang 0.5.23 servers on the CPU (issue 11).

The environment and the tiny model are built on first use (``tools/sglang_cpu/install.sh``,
cached per machine); when they cannot be built the tests FAIL, never skip: a quick local
run deselects them with ``-m "not sglang_real"``. Two real servers are started once for
this package (~30-50 s, ~2.1 GB RSS each; package scope, so they are stopped after its
last test, not at the end of the whole run); one simulated replica with the matching
``tiny-cpu`` profile serves the differential tests. A third real server, the spare of
``sigterm_spare``, starts with them when a collected test asks for it (it is warm by
the time that test runs: starting it later costs 60-90 s on a loaded 2-core machine).
The server of the tiny TikToken-form model (``tiktoken_server``: served as ``tiny-kimi``,
page 4, KV events) is package-scoped too, started on first use, so that the precise-mode
test and the two-models test share it.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.sglang_cpu.cli import TIKTOKEN_MODEL_NAME
from loadtest.sglang_cpu.env import SGLangEnv, ensure_env, ensure_tiktoken_model
from loadtest.sglang_cpu.server import (
    AUTO_PORT,
    ServerSpec,
    SGLangServer,
    late_bind_port,
    start_all,
    stop_all,
)
from loadtest.simulator.fleet import SimFleet

MAX_TOTAL_TOKENS = 16384
MODEL = "tiny-llama"
TIKTOKEN_PAGE = 4  # the TikToken server's page size


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


@pytest.fixture(scope="package")
def tiktoken_server(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A real server of the tiny TikToken-form model (``loadtest/sglang_cpu/kimi_model.py``,
    loaded with ``--trust-remote-code`` as SGLang loads Kimi's), served as
    ``TIKTOKEN_MODEL_NAME``, publishing KV events; its KV pool is large enough that the
    tests using it evict nothing."""
    log_dir = tmp_path_factory.mktemp("sglang-tiktoken")
    spec = ServerSpec(port=AUTO_PORT, max_total_tokens=MAX_TOTAL_TOKENS, page_size=TIKTOKEN_PAGE,
                      served_model_name=TIKTOKEN_MODEL_NAME,
                      kv_events_endpoint=f"tcp://127.0.0.1:{late_bind_port()}",
                      kv_events_replay_endpoint=f"tcp://127.0.0.1:{late_bind_port()}",
                      extra_args=("--trust-remote-code",))
    started = [SGLangServer(sglang_env, spec, log_dir / "sglang.log", ensure_tiktoken_model(sglang_env.python))]
    start_all(started)
    yield started[0]
    stop_all(started)


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
