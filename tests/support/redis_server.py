"""A real ``redis-server`` for tests and benchmarks: free port, temp dir, no persistence.

    with redis_server() as url:   # "redis://127.0.0.1:<port>/0"
        ...
The server is stopped (and its directory removed) on exit. ``redis_process()`` yields the
``RedisServer`` itself, whose ``stop()``/``start()`` restart it on the same port.
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.procs import Proc, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            if conn.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.02)
    raise TimeoutError(f"redis-server on port {port} not ready after {timeout_s}s")


class RedisServer:
    """One redis-server process on a fixed free port, restartable."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", "--protected-mode", "yes",
        ]
        self.proc = Proc(args, self.dir / "redis.log")
        _wait_port(self.port, timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=5.0)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_process() -> Iterator[RedisServer]:
    """Start a redis-server on a free port, yield it (restartable), stop it."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Start a redis-server on a free port, yield its URL, stop it."""
    with redis_process() as server:
        yield server.url
