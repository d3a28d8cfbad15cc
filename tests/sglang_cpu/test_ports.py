"""Ports of real SGLang servers (loadtest/sglang_cpu/server.py), without SGLang.

A server binds its HTTP port only when it is ready, so a port picked long before can be
taken by then (a CI run lost 240 s and 48 tests to that). The stand-in below is the
process ``SGLangServer`` launches (``<python> -m sglang.launch_server --port P ...``): it
binds ``P`` and answers ``/health`` like the real server, or, when ``P`` is taken, prints
uvicorn's bind error and hangs, as SGLang 0.5.23 did in that run.
"""
from __future__ import annotations

import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.sglang_cpu import server as server_module
from loadtest.sglang_cpu.env import SGLangEnv
from loadtest.sglang_cpu.server import (
    AUTO_PORT,
    LATE_BIND_PORTS,
    PortTaken,
    ServerSpec,
    SGLangServer,
)

STANDIN = f'''#!{sys.executable}
import http.server, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()
try:
    httpd = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(f"ERROR:    [Errno {{e.errno}}] error while attempting to bind on address "
          f"('127.0.0.1', {{port}}): address already in use", flush=True)
    time.sleep(3600)
httpd.serve_forever()
'''


@pytest.fixture
def env(tmp_path: Path) -> SGLangEnv:
    python = tmp_path / "python"
    python.write_text(STANDIN)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return SGLangEnv(python=python, model_dir=tmp_path)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port in the late-bind range held by a listening socket of this test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", server_module.late_bind_port()))
        s.listen()
        yield s.getsockname()[1]


def test_late_bind_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [server_module.late_bind_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(p in LATE_BIND_PORTS and p < low for p in ports)
    assert max(LATE_BIND_PORTS) < 22000  # SGLang's own nccl_port range starts there


def test_auto_port_taken_is_restarted_on_a_fresh_port(env: SGLangEnv, taken: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([taken])
    fresh = server_module.late_bind_port
    monkeypatch.setattr(server_module, "late_bind_port", lambda host="127.0.0.1": next(picks, None) or fresh(host))
    server = SGLangServer(env, ServerSpec(port=AUTO_PORT), tmp_path / "server.log")
    assert server.url.endswith(f":{taken}")
    server.start()
    try:
        server.wait_healthy(timeout_s=20)
        assert not server.url.endswith(f":{taken}")
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
        assert "address already in use" in server.log_path.read_text()  # the first start's line
    finally:
        server.stop(timeout_s=2)


def test_fixed_port_taken_fails_at_once(env: SGLangEnv, taken: int, tmp_path: Path) -> None:
    server = SGLangServer(env, ServerSpec(port=taken), tmp_path / "server.log")
    server.start()
    try:
        with pytest.raises(PortTaken, match=str(taken)):
            server.wait_healthy(timeout_s=20)  # not the 20 s: the log says so within a second
    finally:
        server.stop(timeout_s=2)
