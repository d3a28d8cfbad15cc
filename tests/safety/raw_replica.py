"""A tiny raw-asyncio HTTP/1.1 "replica" for framing and fault cases the simulator cannot make.

Run: ``python -m tests.safety.raw_replica --port P [--mode M] [--hints] [--events N]``.
Answers ``/ready`` and ``/health`` with 200 (``/server_info`` and the rest with 404: the
gateway then takes its capacity as unknown), ``GET /_raw/stats`` with its counters, and
every POST by its mode (``--mode``, or per request the ``x-raw-mode`` header):

| mode | answer |
|---|---|
| ``echo`` | the request's ``x-request-token`` back as ``id``, with the headers it received; a stream (``"stream": true``) as ``--events`` SSE events + usage + ``[DONE]``, chunked |
| ``close`` | ``echo``'s body, close-delimited (no length, no chunking, ``connection: close``), written in pieces |
| ``split`` | ``echo``'s answer (with its length), its head first and its body 5 ms later (two reads for the gateway) |
| ``half_body`` | ``echo``'s head (with its length) and half its body, then nothing (until the client leaves) |
| ``large_split`` | ``split`` with the body padded to ~3 MB (past 1 MiB plus one read), written in 64 KiB pieces |
| ``poison`` | 500 for exactly ``POISON``'s bytes, else ``echo`` |
| ``kill_stream`` | a stream's head and first event, then the connection is dropped mid-body |
| ``hang`` | reads the request, never answers; counts the client leaving (``disconnects``) |
| ``head_only`` | a stream's head, then nothing (until the client leaves) |
| ``stall`` | a stream's head and first event, then nothing (until the client leaves) |

``--hints`` sends ``100 Continue`` and ``103 Early Hints`` before every final answer.
``RawFleet`` (below) starts N of them for a test and stops them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.integration.conftest import Gateway

POISON = b'{"messages":[{"role":"assistant","content":null,"tool_calls":[{"function":3}]}]}'
STATS = {"requests": 0, "disconnects": 0, "answered": 0}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, list[tuple[str, str]], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if line)]
    length = int(dict(headers).get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return method, target, headers, body


def _json(status: int, payload: object, extra: bytes = b"") -> bytes:
    data = json.dumps(payload).encode()
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status, len(data), extra, data)


def _completion(token: str, headers: list[tuple[str, str]], body: bytes) -> dict[str, object]:
    return {"id": token, "object": "chat.completion", "headers": headers, "body_len": len(body),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}


async def _until_gone(reader: asyncio.StreamReader) -> None:
    if await reader.read(1) == b"":
        STATS["disconnects"] += 1


async def _stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str, events: int,
                  mode: str) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()
    if mode == "head_only":
        return await _until_gone(reader)
    for i in range(events):
        event = {"id": token, "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
        writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        await writer.drain()
        if mode == "kill_stream":
            writer.transport.abort()
            return
        if mode == "stall":
            return await _until_gone(reader)
        await asyncio.sleep(0.005)
    usage = {"id": token, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": events}}
    writer.write(_chunk(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace,
                  headers: list[tuple[str, str]], body: bytes) -> bool:
    """One POST; False when the connection must close afterwards."""
    STATS["requests"] += 1
    mode: str = dict(headers).get("x-raw-mode", args.mode)
    token = dict(headers).get("x-request-token", "")
    if args.hints:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.002)
    streaming = b'"stream": true' in body or b'"stream":true' in body
    if mode == "hang" or (mode in ("head_only", "stall") and not streaming):
        await _until_gone(reader)
        return False
    STATS["answered"] += 1
    if mode == "poison" and body == POISON:
        writer.write(_json(500, {"object": "error", "message": "poisoned", "code": 500}))
    elif streaming:
        await _stream(reader, writer, token, args.events, mode)
        return mode in ("echo", "poison")
    elif mode in ("split", "half_body", "large_split"):
        pad = {"pad": "x" * (3_000_000 if mode == "large_split" else 0)}
        data = json.dumps(_completion(token, headers, body) | pad).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data))
        await writer.drain()
        await asyncio.sleep(0.005)
        if mode == "half_body":
            writer.write(data[:len(data) // 2])
            await _until_gone(reader)
            return False
        for at in range(0, len(data), 65536):
            writer.write(data[at:at + 65536])
            await writer.drain()
    elif mode == "close":
        data = json.dumps(_completion(token, headers, body) | {"pad": "x" * 200_000}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
        for at in range(0, len(data), 65536):
            writer.write(data[at:at + 65536])
            await writer.drain()
            await asyncio.sleep(0.002)
        return False
    else:
        writer.write(_json(200, _completion(token, headers, body)))
    return True


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace) -> None:
    try:
        while True:
            method, target, headers, body = await _read_request(reader)
            if method == "GET":
                if target in ("/ready", "/health"):
                    writer.write(_json(200, {"status": "ok"}))
                elif target == "/_raw/stats":
                    writer.write(_json(200, STATS))
                else:
                    writer.write(_json(404, {"detail": "not found"}))
                keep = True
            else:
                keep = await _answer(reader, writer, args, headers, body)
            await writer.drain()
            if not keep:
                break
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="echo", choices=["echo", "split", "half_body", "large_split", "close", "poison", "kill_stream", "hang",
                                                    "head_only", "stall"])
    parser.add_argument("--hints", action="store_true")
    parser.add_argument("--events", type=int, default=3)
    args = parser.parse_args(argv)

    async def run() -> None:
        server = await asyncio.start_server(lambda r, w: _serve(r, w, args), "127.0.0.1", args.port)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


class RawFleet:
    """N raw replicas as processes (``tests.support.procs``); stopped on exit."""

    def __init__(self, n: int, log_dir: Path, *extra: str, modes: list[str] | None = None) -> None:
        from tests.support.procs import Proc, free_port, wait_http

        self.procs: list[Proc] = []
        self.urls: list[str] = []
        try:
            for i in range(n):
                port = free_port()
                mode = ["--mode", modes[i]] if modes else []
                cmd = [sys.executable, "-m", "tests.safety.raw_replica", "--port", str(port), *mode, *extra]
                self.procs.append(Proc(cmd, log_dir / f"raw-{i}.log"))
                self.urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(self.urls, self.procs, strict=True):
                wait_http(url + "/health", timeout_s=15.0, proc=proc.popen)
        except BaseException:
            self.stop()
            raise

    def stats(self, i: int) -> dict[str, int]:
        import httpx

        stats: dict[str, int] = httpx.get(self.urls[i] + "/_raw/stats", timeout=5.0).json()
        return stats

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.stop()


@contextlib.contextmanager
def raw_fleet(n: int, log_dir: Path, *extra: str, modes: list[str] | None = None) -> Iterator[RawFleet]:
    fleet = RawFleet(n, log_dir, *extra, modes=modes)
    try:
        yield fleet
    finally:
        fleet.stop()


@contextlib.contextmanager
def raw_gateway(log_dir: Path, *gateway_args: str) -> Iterator[tuple[RawFleet, Gateway]]:
    """One raw replica and a ``kvgate serve`` in front of it (``gateway_args`` added)."""
    from tests.integration.conftest import start_gateway

    with raw_fleet(1, log_dir) as fleet:
        gateway = start_gateway(fleet.urls, log_dir / "gateway.log", *gateway_args)
        try:
            yield fleet, gateway
        finally:
            gateway.proc.stop()


if __name__ == "__main__":
    main()
