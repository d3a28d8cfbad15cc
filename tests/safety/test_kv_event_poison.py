"""A bad KV-event stream never poisons routing (issue 41, failures 5 and 6), over real
processes: a ``kvgate serve`` gateway in front of hand-made replicas (a tiny HTTP server
advertising KV events in ``/server_info``) and a hand-made pyzmq publisher on loopback
that follows ``replicas/kv_events.py``'s wire format.

Before the fix one event with ``block_size: "abc"`` killed the subscriber's task: the
batches after it were never applied while the replica stayed reported precise. Now the bad
batch is a counted decode error, the stream goes on (the replica uncertain, not frozen, until
rebuilt), a too-large message makes the subscriber rejoin, and a ``dp_size`` beyond the
bound is refused.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from replicas.kv_events import AllBlocksCleared, BlockStored, Event, encode_batch
from tests.integration.conftest import Gateway, metric_value, start_gateway
from tests.kv_events.tokmodel import write_model
from tests.support.procs import free_port

pytestmark = pytest.mark.safety
TOPIC = b"kv"
PAGE = 4


class InfoReplica:
    """``/ready``, ``/health`` and ``/server_info`` (with ``kv_events``) on loopback; 404 otherwise."""

    def __init__(self, info: dict[str, Any]) -> None:
        body = json.dumps(info).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                known = self.path in ("/ready", "/health", "/server_info")
                payload = body if self.path == "/server_info" else b"{}"
                self.send_response(200 if known else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def info(model: Path, port: int, dp_size: int = 1) -> dict[str, Any]:
    return {"model_path": str(model), "page_size": PAGE, "startup_time": 1.0,
            "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port,
                          "topic": "kv", "block_size": PAGE, "dp_size": dp_size}}


class Publisher:
    """One replica DP rank's PUB socket (the gateway connects: a wildcard endpoint host)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.port = free_port()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")

    def send(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def events(self, seq: int, events: list[Event]) -> None:
        self.send(seq, encode_batch(events))


def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0, each: Callable[[], None] | None = None) -> None:
    """Poll ``cond`` (calling ``each`` first every round) until it holds, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if each is not None:
            each()
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def setup(tmp_path: Path, zctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[tuple[Gateway, Publisher, str, InfoReplica]]:
    model = write_model(tmp_path / "model")
    pub = Publisher(zctx)
    good = InfoReplica(info(model, pub.port))
    wide = InfoReplica(info(model, free_port(), dp_size=200))  # refused: beyond index.event_max_dp_size
    gw = start_gateway([good.url, wide.url], tmp_path / "gateway.log",
                       "--set", "index.event_max_message_bytes=65536",
                       "--set", "index.event_restart_backoff_min_s=0.1")
    try:
        yield gw, pub, good.url, wide
    finally:
        gw.proc.stop()
        good.close()
        wide.close()


def applied(gw: Gateway, replica: str) -> float:
    return metric_value(gw.metrics(), f'kvgate_kv_events_applied_total{{replica="{replica}"}}')


def state(gw: Gateway, name: str) -> float:
    return metric_value(gw.metrics(), f'kvgate_precise_replicas{{state="{name}"}}')


def stored(h: int) -> list[Event]:
    return [BlockStored((h,), None, (1, 2, 3, 4), PAGE)]


def test_a_poisoned_stream_keeps_applying_and_is_never_trusted_frozen(
        setup: tuple[Gateway, Publisher, str, InfoReplica]) -> None:
    gw, pub, replica, _ = setup
    # ZMQ drops what is published before the subscription reached the publisher: resend seq 0
    until(lambda: applied(gw, replica) >= 1, "the first batch applied", each=lambda: pub.events(0, stored(1)))
    until(lambda: state(gw, "precise") == 1, "the replica in precise mode")
    first = applied(gw, replica)

    bad = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
                                         "token_ids": [1, 2, 3, 4], "block_size": "abc", "medium": "GPU"}], 0])
    pub.send(1, bad)
    for seq in range(2, 31):  # the 29 valid batches after it
        pub.events(seq, stored(seq + 10))
    until(lambda: applied(gw, replica) >= first + 29, "the 29 batches after the bad one applied")
    text = gw.metrics()
    assert metric_value(text, 'kvgate_kv_event_streams_total{outcome="decode_error"}') == 1
    # the skipped batch's effect is unknown: uncertain (routed approximately), never precise and frozen
    assert metric_value(text, 'kvgate_kv_event_streams_total{outcome="lost"}') == 1
    assert state(gw, "precise") == 0 and state(gw, "uncertain") == 1

    pub.events(31, [AllBlocksCleared()])  # rebuilt from here: precise again, the stream still alive
    until(lambda: state(gw, "precise") == 1, "precise again after AllBlocksCleared", timeout_s=10.0)
    assert httpx.get(gw.url + "/ready", timeout=5.0).status_code == 200
    gw.assert_quiet()


def test_an_oversized_message_makes_the_subscriber_rejoin(setup: tuple[Gateway, Publisher, str, InfoReplica]) -> None:
    gw, pub, replica, _ = setup
    until(lambda: applied(gw, replica) >= 1, "the first batch applied", each=lambda: pub.events(0, stored(1)))
    until(lambda: state(gw, "precise") == 1, "the replica in precise mode")
    before = applied(gw, replica)
    huge = tuple(range(1 << 40, (1 << 40) + 20_000))  # 9 bytes a hash: ~180 kB > 64 KiB, refused by ZMQ
    pub.events(1, [BlockStored(huge, None, (), PAGE)])
    restarts = f'kvgate_kv_subscriber_restarts_total{{replica="{replica}"}}'
    until(lambda: gw.metric(restarts) >= 1, "the subscriber restarted", timeout_s=10.0)
    seq = iter(range(2, 10_000))
    until(lambda: applied(gw, replica) > before, "batches applied after the rejoin", timeout_s=15.0,
          each=lambda: pub.events(next(seq), stored(5)))
    assert applied(gw, replica) - before < 20_000  # the huge batch itself never reached the index
    gw.assert_quiet()


def test_a_huge_dp_size_is_refused(setup: tuple[Gateway, Publisher, str, InfoReplica]) -> None:
    gw, pub, replica, _wide = setup
    until(lambda: "dp_size 200 exceeds" in gw.proc.output(), "the refusal logged", timeout_s=15.0)
    until(lambda: applied(gw, replica) >= 1, "the other replica's first batch", each=lambda: pub.events(0, stored(1)))
    until(lambda: state(gw, "precise") == 1, "only the other replica in precise mode")
    assert state(gw, "joining") == 0  # the refused replica has no subscriber at all: approximate
