"""Many replica URLs served by one cheap process: every answer replayed from one real
simulated replica.

A fleet of hundreds of ``kvgate sim`` processes does not fit on this machine, and what
`kvgate bench polls` measures is the gateway's side of a large fleet (its probes, load
polls and decisions over N replicas), not the replicas. So ``capture`` asks one real
simulated replica every path the gateway calls (readiness, ``/server_info``,
``/v1/models``, ``/v1/loads``, and one chat completion) and keeps each answer as it came
(status, headers, body); ``serve`` listens on N loopback ports and answers each request
with the captured answer of its path (the query ignored; unknown paths 404), over
keep-alive HTTP/1.1 parsed by httptools. Every port answers the same: N URLs, one replica's
behaviour, ~20-30 us of CPU a request.

    python -m loadtest.stub_fleet --answers answers.json --ports 512 --announce ports.json

``running(answers, ports, work)`` starts it so and yields its URLs (`kvgate bench polls`).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.h1_server import RequestParsing
from loadtest.simulator.fleet import stop_process

ROOT = Path(__file__).resolve().parents[1]

CAPTURED_GETS = ("/ready", "/health", "/server_info", "/v1/models", "/v1/loads?include=core,spec")
Answer = bytes  # a whole HTTP/1.1 response, ready to write


def capture(replica: str, chat_body: bytes) -> dict[str, dict[str, Any]]:
    """The replica's answers, by path (JSON-ready: body base64)."""
    out: dict[str, dict[str, Any]] = {}
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        calls: list[tuple[str, str, bytes | None]] = [("GET", path, None) for path in CAPTURED_GETS]
        calls.append(("POST", "/v1/chat/completions", chat_body))
        for method, path, body in calls:
            r = client.request(method, replica + path, content=body,
                               headers={"content-type": "application/json"} if body else None)
            headers = [(k, v) for k, v in r.headers.items() if k.lower() not in ("content-length", "date",
                                                                                 "server", "transfer-encoding")]
            out[path.split("?", 1)[0]] = {"status": r.status_code, "headers": headers,
                                          "body": base64.b64encode(r.content).decode()}
    return out


def wire_answers(captured: dict[str, dict[str, Any]]) -> dict[bytes, Answer]:
    """Path -> the bytes of its whole response."""
    answers = {}
    for path, a in captured.items():
        body = base64.b64decode(a["body"])
        head = [b"HTTP/1.1 %d X\r\n" % a["status"]]
        head += [b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in a["headers"]]
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        answers[path.encode()] = b"".join(head) + body
    return answers


NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class _Replayer(RequestParsing):
    """One connection: each complete request gets its path's captured answer."""

    def __init__(self, answers: dict[bytes, Answer]) -> None:
        super().__init__()
        self.answers = answers
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        self.url = b""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.answers.get(path, NOT_FOUND))


async def serve(answers: dict[bytes, Answer], ports: int, announce: Path) -> None:
    """Listen on ``ports`` free loopback ports; their numbers go to ``announce`` (JSON)."""
    loop = asyncio.get_running_loop()
    servers = []
    for _ in range(ports):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        servers.append(await loop.create_server(lambda: _Replayer(answers), sock=sock, backlog=64))
    numbers = [s.sockets[0].getsockname()[1] for s in servers]
    tmp = announce.with_suffix(".tmp")
    tmp.write_text(json.dumps(numbers))
    tmp.rename(announce)  # whole or absent
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


@contextlib.contextmanager
def running(answers: dict[str, Any], ports: int, work: Path) -> Iterator[tuple[list[str], int]]:
    """This module as a child process on ``ports`` ports, replaying ``answers`` (``capture``'s);
    yields (replica URLs, pid) and stops it at the end. Its log and files go to ``work``."""
    answers_path, announce = work / "answers.json", work / "ports.json"
    answers_path.write_text(json.dumps(answers))
    with open(work / "stub-fleet.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "loadtest.stub_fleet", "--answers", str(answers_path),
                                 "--ports", str(ports), "--announce", str(announce)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 60.0
        while not announce.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stub fleet did not start; log: {work / 'stub-fleet.log'}")
            time.sleep(0.1)
        yield [f"http://127.0.0.1:{p}" for p in json.loads(announce.read_text())], proc.pid
    finally:
        stop_process(proc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True, help="JSON written by capture()")
    parser.add_argument("--ports", type=int, required=True)
    parser.add_argument("--announce", type=Path, required=True, help="where the port numbers go (JSON)")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.run(serve(wire_answers(json.loads(args.answers.read_text())), args.ports, args.announce))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
