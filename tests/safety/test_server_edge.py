"""The client edge of a real ``kvgate serve``: deadlines, connection and concurrency caps,
config errors at start-up.

Finding 3 of issue 10: idle, slow-header and 1-byte-per-second-body connections were
held forever, and 20,400 idle connections locked every new client (``/ready`` too) out.
The server (Granian, ``gateway/server.py``) closes a connection that has not delivered a
request's headers within ``server.header_timeout_s`` (silent, trickling or idle alike);
the ASGI front answers a late body with a 408. Deadlines here are set small
(``--set server.*``); each wait is bounded by a socket timeout a few seconds above the
deadline.
"""
from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway
from tests.support.procs import ROOT, kvgate_cmd

pytestmark = pytest.mark.safety

DEADLINE_S = 1.0
BOUND_S = 8.0  # a socket read waits at most this long for the close


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=1.0, seed=9, log_dir=tmp_path_factory.mktemp("sim")) as f:
        yield f


@pytest.fixture(scope="module")
def gw(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(fleet.urls, tmp_path_factory.mktemp("gw") / "gw.log",
                      "--set", f"server.header_timeout_s={DEADLINE_S}",
                      "--set", f"server.body_timeout_s={DEADLINE_S}", "--set", "server.max_connections=200")
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def capped(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(fleet.urls, tmp_path_factory.mktemp("capped") / "gw.log",
                      "--set", "server.max_connections=6", "--set", "server.max_concurrent_requests=2",
                      "--set", "server.header_timeout_s=20")
    yield g
    g.proc.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=BOUND_S)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _answer(reply: bytes) -> tuple[bytes, dict[str, str]]:
    """(status line and headers, the OpenAI error object) of a JSON error reply."""
    head, _, body = reply.partition(b"\r\n\r\n")
    error: dict[str, str] = json.loads(body)["error"]
    return head, error


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed ``sock`` (nothing may be sent); fails after ``limit_s``."""
    start = time.monotonic()
    assert _read_all(sock) == b""
    took = time.monotonic() - start
    assert took < limit_s, took
    return took


def test_silent_and_idle_keep_alive_connections_are_closed(gw: Gateway) -> None:
    with _connect(gw.url) as sock:
        _closed_within(sock, DEADLINE_S + 2.0)  # never sent a byte
    with _connect(gw.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(BOUND_S)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        _closed_within(sock, DEADLINE_S + 2.0)  # idle after its answer


def test_slow_headers_are_closed(gw: Gateway) -> None:
    with _connect(gw.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        start = time.monotonic()
        try:
            while time.monotonic() - start < DEADLINE_S + 3.0:  # a header line now and then, never the end
                time.sleep(DEADLINE_S / 4)
                sock.sendall(b"x-slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(BOUND_S)
        try:
            rest = _read_all(sock)
        except ConnectionResetError:
            rest = b""
    assert time.monotonic() - start < DEADLINE_S + 3.0 + BOUND_S
    assert rest == b""  # closed, nothing answered


def test_one_byte_per_interval_body_gets_408_and_close(gw: Gateway) -> None:
    before = gw.metric('kvgate_requests_rejected_total{reason="body_timeout"}')
    with _connect(gw.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n")
        reply = b""
        for byte in b'{"model": "tiny", "messages": [':
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.25)  # a byte every 0.25 s: the whole body would take 250 s
            try:
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            break
        sock.settimeout(BOUND_S)
        reply += _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408")
    head, error = _answer(reply)
    assert b"connection: close" in head.lower() and error["code"] == "request_timeout"
    assert gw.metric('kvgate_requests_rejected_total{reason="body_timeout"}') == before + 1
    assert "Traceback" not in gw.proc.output()


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    b"GET /health HTTP/1.1\r\nbad header\r\n\r\n",
])
def test_ambiguous_framing_gets_one_answer_and_is_closed(gw: Gateway, request_bytes: bytes) -> None:
    """A conflicting length or a malformed header: a 400; Content-Length with
    Transfer-Encoding: the body read as chunked (RFC 9112 6.3) and the connection closed
    after the one answer, so nothing after it can be smuggled as a second request."""
    with _connect(gw.url) as sock:
        sock.sendall(request_bytes + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # a would-be smuggled request
        reply = _read_all(sock)
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    if b"transfer-encoding" not in request_bytes:
        assert reply.startswith(b"HTTP/1.1 400"), reply


def test_idle_connections_beyond_the_cap_do_not_lock_clients_out(gw: Gateway) -> None:
    """300 silent connections against a cap of 200: a new client waits at most about the
    header deadline (the silent ones are closed by then), never for good."""
    socks = []
    try:
        for _ in range(300):
            socks.append(_connect(gw.url))
        start = time.monotonic()
        r = httpx.get(gw.url + "/ready", timeout=DEADLINE_S + BOUND_S)
        waited = time.monotonic() - start
    finally:
        for s in socks:
            s.close()
    assert r.status_code == 200 and r.json()["ready"] is True
    assert waited < DEADLINE_S + 3.0, waited


def test_at_the_connection_cap_a_new_client_waits_for_a_slot(capped: Gateway) -> None:
    """Every slot mid-request (headers begun, never finished): a new client is not served
    while they hold the slots, and is served once they end (here: closed by their client;
    at the latest they reach their header deadline)."""
    busy = []
    try:
        for _ in range(6):
            s = _connect(capped.url)
            s.sendall(b"GET /health HTTP/1.1\r\n")
            busy.append(s)
        time.sleep(0.2)
        with _connect(capped.url) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            extra.settimeout(1.0)
            with pytest.raises(TimeoutError):
                extra.recv(65536)  # no slot: not accepted yet
            for s in busy:
                s.close()
            extra.settimeout(BOUND_S)
            reply = _read_all(extra)
    finally:
        for s in busy:
            s.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply


def test_concurrency_cap_answers_503_json_and_probes_still_pass(capped: Gateway) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 600,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30.0) as a, httpx.Client(timeout=30.0) as b, \
            a.stream("POST", capped.url + "/v1/chat/completions", json=body) as s1, \
            b.stream("POST", capped.url + "/v1/chat/completions", json=body) as s2:
        assert s1.status_code == s2.status_code == 200
        third = httpx.post(capped.url + "/v1/chat/completions", json=body | {"stream": False}, timeout=10.0)
        health = httpx.get(capped.url + "/health", timeout=5.0)
        ready = httpx.get(capped.url + "/ready", timeout=5.0)
    assert third.status_code == 503 and third.headers["retry-after"] == "1"
    assert third.json()["error"] == {"message": third.json()["error"]["message"], "type": "service_unavailable",
                                     "code": "concurrency_cap", "param": None}
    assert health.status_code == 200 and ready.status_code == 200
    assert capped.metric('kvgate_requests_rejected_total{reason="concurrency_cap"}') >= 1


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("bad.yaml", "server:\n  max_connections: [1\n", "kvgate serve: config file {p}, line 3: "),
    ("bad.toml", "[server]\nheader_timeout_s = -1\n",
     "kvgate serve: config file {p}, line 2: field server.header_timeout_s: Input should be greater than 0"),
    ("bad.yaml", "admin:\n  port: 70000\n",
     "kvgate serve: config file {p}, line 2: field admin.port: Input should be less than or equal to 65535"),
])
def test_config_errors_are_one_line_and_exit_2(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    done = subprocess.run(kvgate_cmd("serve", "--config", str(path)), capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(expected.format(p=path))
    assert "Traceback" not in done.stderr


def _responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each content-length framed response in ``data``, in order."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                      if line.split(b":", 1)[0].strip().lower() == b"content-length")
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


def test_whole_answers_keep_http_framing_pipelined_and_with_connection_close(gw: Gateway) -> None:
    """Three requests pipelined on one connection get their three answers in order, each
    framed by its content-length, the last (``Connection: close``) closing the connection."""
    def request(tokens: int, close: bool = False) -> bytes:
        body = json.dumps({"model": "tiny", "max_tokens": tokens,
                           "messages": [{"role": "user", "content": f"pipelined {tokens}"}]}).encode()
        extra = b"connection: close\r\n" if close else b""
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"%scontent-length: %d\r\n\r\n%s" % (extra, len(body), body))

    with _connect(gw.url) as sock:
        sock.sendall(request(1) + request(2) + request(3, close=True))
        answers = _responses(_read_all(sock))  # ends: the server closed after the third
    assert [head.split(b"\r\n")[0] for head, _ in answers] == [b"HTTP/1.1 200 OK"] * 3
    assert [json.loads(body)["usage"]["completion_tokens"] for _, body in answers] == [1, 2, 3]
    assert all(b"\r\nx-kvgate-replica: " in head for head, _ in answers)
    assert [b"\r\nconnection: close" in head for head, _ in answers] == [False, False, True]
