"""A free TCP port of a host (the harness, the demo and the simulator's KV-event ports).

The port is free when asked; another process may take it before the caller binds, so
callers that start servers retry on "address already in use".
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
