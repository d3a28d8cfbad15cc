"""The gateway keeps idle client connections open longer than clients do (keep-alive).

A server that closes an idle connection at the moment its client sends the next request
on it loses that request (the client sees a reset, no response). Clients such as httpx
and the openai SDK expire idle connections after 5 s; the gateway's
``server.header_timeout_s`` (30 s, which also bounds idle keep-alive connections) makes
the client close first.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

from tests.integration.conftest import GatewayFactory

REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n\r\n"


def _exchange(sock: socket.socket) -> bytes:
    sock.sendall(REQUEST)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _idle_then_reuse(url: str, idle_s: float) -> bytes:
    u = urlparse(url)
    with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=10.0) as sock:
        assert _exchange(sock).startswith(b"HTTP/1.1 200")
        time.sleep(idle_s)
        try:
            return _exchange(sock)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_idle_connection_outlives_the_timeout_setting(make_gateway: GatewayFactory) -> None:
    short = make_gateway([], "--set", "server.header_timeout_s=0.3")
    assert _idle_then_reuse(short.url, 1.5) == b""  # the server closed it: the setting applies
    default = make_gateway([])
    assert _idle_then_reuse(default.url, 1.5).startswith(b"HTTP/1.1 200")
