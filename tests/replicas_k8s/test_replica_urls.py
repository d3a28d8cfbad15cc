"""Replica URL validation (replicas.urls): start-up flags, config files and the admin API share it."""
from __future__ import annotations

import pytest

from replicas.urls import ReplicaUrlError, parse_replica_url


@pytest.mark.parametrize("url,expected", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
    ("https://sglang-0.sglang.kvgate.svc:30000", "https://sglang-0.sglang.kvgate.svc:30000"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    ("http://replica", "http://replica"),
])
def test_valid(url: str, expected: str) -> None:
    assert parse_replica_url(url) == expected


@pytest.mark.parametrize("url", [
    "127.0.0.1:30000", "replica:30000", "ftp://h:1", "http://", "http://[::1", "http://h:99999",
    "http://h:0", "http://u:p@h:1", "http://h:1/?x=1", "http://h\x00:1", "http://h 1:2", "",
    "http://-bad-:1", "http://[zz]:1",
])
def test_invalid(url: str) -> None:
    with pytest.raises(ReplicaUrlError):
        parse_replica_url(url)


def test_serve_refuses_a_replica_url_without_scheme_in_one_line() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--replica", "127.0.0.1:30000",
                           "--port", "0"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "registry.replicas" in lines[0] and "http://" in lines[0], done.stderr
