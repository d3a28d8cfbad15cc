"""The push relay's run (gateway.push_relay.PushRun) over a stub source and writer: the
end, the stall bound, flow control, cancellation; ``ChunkWriter.one_write`` over a stub
cycle. The relay over real processes is in the
integration and safety suites (the default client pushes)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from gateway.h1_upstream import PushSink
from gateway.push_relay import ChunkWriter, PushRun, WritingListener
from gateway.upstream import Disconnected


class Source:
    def __init__(self, buffered: list[bytes] | None = None) -> None:
        self.sink: PushSink | None = None
        self.buffered = buffered or []
        self.reading = True
        self.calls: list[str] = []

    def push(self, sink: PushSink) -> None:
        for data in self.buffered:
            sink.chunk(data)
        self.sink = sink
        self.reading = True
        self.calls.append("push")

    def unpush(self) -> None:
        self.sink = None
        self.calls.append("unpush")

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Writer:
    def __init__(self, paused: bool = False) -> None:
        self.written: list[bytes] = []
        self.paused = paused
        self.listener: WritingListener | None = None

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def listen(self, listener: WritingListener | None) -> None:
        self.listener = listener


def run(source: Source, writer: Writer, stall_s: float = 5.0) -> tuple[PushRun, list[bytes]]:
    fed: list[bytes] = []
    return PushRun(source, writer, stall_s, fed.append), fed  # type: ignore[arg-type]


async def test_chunks_are_written_and_fed_until_the_end() -> None:
    source, writer = Source([b"a"]), Writer()
    relay, fed = run(source, writer)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0)
    assert source.sink is not None
    source.sink.chunk(b"b")
    source.sink.end(None)
    await asyncio.wait_for(task, 5.0)
    assert writer.written == fed == [b"a", b"b"]
    assert source.calls == ["push", "unpush"] and writer.listener is None


async def test_a_broken_answer_raises() -> None:
    source, writer = Source(), Writer()
    relay, _ = run(source, writer)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0)
    assert source.sink is not None
    source.sink.end(Disconnected("reset"))
    with pytest.raises(Disconnected):
        await asyncio.wait_for(task, 5.0)


async def test_a_silent_replica_stalls_but_a_paused_client_does_not_count() -> None:
    source, writer = Source(), Writer()
    relay, _ = run(source, writer, stall_s=0.1)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0)
    assert writer.listener is not None
    writer.listener(False)  # the client's buffer is full: reading from the replica pauses
    assert not source.reading
    await asyncio.sleep(0.3)
    assert not task.done()  # paused time is not the replica's silence
    writer.listener(True)
    assert source.reading
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, 5.0)


async def test_a_client_already_paused_pauses_the_replica_at_once() -> None:
    source, writer = Source(), Writer(paused=True)
    relay, _ = run(source, writer)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0)
    assert not source.reading
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.calls == ["push", "unpush"] and source.reading and writer.listener is None


async def test_cancelled_run_detaches(monkeypatch: Any) -> None:
    source, writer = Source(), Writer()
    relay, _ = run(source, writer)
    task = asyncio.ensure_future(relay.run())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.sink is None and writer.listener is None


# -- one_write: a whole answer's head and body in one transport write ---------------------------
class Transport:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def writelines(self, parts: tuple[bytes, ...]) -> None:
        self.calls.append(("writelines", b"|".join(parts)))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append(("close", b""))


class Cycle:
    def __init__(self) -> None:
        self.transport: Any = Transport()


def one_write_writer() -> tuple[ChunkWriter, Cycle, Transport]:
    cycle = Cycle()
    transport = cycle.transport
    return ChunkWriter(cycle, lambda listener: None), cycle, transport  # type: ignore[arg-type]


def test_one_write_sends_the_head_with_the_body_and_restores_the_transport() -> None:
    writer, cycle, transport = one_write_writer()
    with writer.one_write():
        cycle.transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert transport.calls == []  # held for the body
        cycle.transport.write(b"body")
        cycle.transport.close()  # (uvicorn closes a connection that does not keep alive)
        assert transport.calls == [("writelines", b"HTTP/1.1 200 OK\r\n\r\n|body"), ("close", b"")]
    assert cycle.transport is transport


@pytest.mark.parametrize("fails", [False, True])
def test_one_write_writes_a_head_left_held_at_the_end(fails: bool) -> None:
    writer, cycle, transport = one_write_writer()
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext(), writer.one_write():
        cycle.transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        if fails:
            raise RuntimeError("the body send failed")
    assert transport.calls == [("write", b"HTTP/1.1 204 No Content\r\n\r\n")] and cycle.transport is transport


def test_one_write_passes_through_what_is_not_a_head_or_a_closing_transport() -> None:
    writer, cycle, transport = one_write_writer()
    with writer.one_write():
        cycle.transport.write(b"not a head")
    transport.closing = True
    with writer.one_write():
        cycle.transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.calls == [("write", b"not a head"), ("write", b"HTTP/1.1 200 OK\r\n\r\n")]


# ---------------------------------------------------------------------------------------- ChunkWriter.answer

class _Transport:
    """What uvicorn's cycle writes, and whether it closed the connection."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, parts: Any) -> None:
        self.data += b"".join(parts)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _cycle(keep_alive: bool = True) -> tuple[Any, _Transport, list[str]]:
    """A real uvicorn cycle over a recording transport; the list records ``on_response``."""
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    transport = _Transport()
    completed: list[str] = []
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "http_version": "1.1"}
    cycle = RequestResponseCycle(
        scope, transport, FlowControl(transport), logging.getLogger("t"), logging.getLogger("t"),  # type: ignore[arg-type]
        False, [(b"server", b"uvicorn"), (b"date", b"Fri, 04 Dec 2026 17:00:00 GMT")], asyncio.Event(),
        False, keep_alive, lambda: completed.append("done"))
    return cycle, transport, completed


HEADERS = [(b"Content-Type", b"application/json"), (b"x-kvgate-replica", b"http://127.0.0.1:1"),
           (b"content-length", b"11")]


@pytest.mark.parametrize("keep_alive,draining", [(True, False), (False, False), (True, True)])
async def test_answer_writes_what_uvicorns_send_writes_and_completes_the_cycle(keep_alive: bool,
                                                                               draining: bool) -> None:
    """The bytes on the wire and the cycle's state after ``ChunkWriter.answer`` are those of
    uvicorn's own two sends (as ``AnsweredResponse`` makes them, with ``connection: close``
    added while draining as ``EdgeApp`` adds it); one write; ``on_response`` once."""
    ours, ours_transport, ours_done = _cycle(keep_alive)
    theirs, theirs_transport, theirs_done = _cycle(keep_alive)
    writer = ChunkWriter(ours, lambda listener: None, lambda: draining)
    assert writer.answer(200, HEADERS, b'{"ok": true}'[:11])
    headers = HEADERS + ([(b"connection", b"close")] if draining else [])
    await theirs.send({"type": "http.response.start", "status": 200, "headers": headers})
    await theirs.send({"type": "http.response.body", "body": b'{"ok": true}'[:11]})
    assert ours_transport.data == theirs_transport.data
    assert ours_transport.closed == theirs_transport.closed == (not keep_alive or draining)
    for field in ("response_started", "response_complete", "chunked_encoding", "expected_content_length",
                  "keep_alive", "waiting_for_100_continue"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.message_event.is_set() and ours_done == theirs_done == ["done"]


async def test_answer_writes_nothing_once_a_head_is_sent_or_the_client_is_gone() -> None:
    started, started_transport, _ = _cycle()
    await started.send({"type": "http.response.start", "status": 200, "headers": []})
    before = started_transport.data
    assert not ChunkWriter(started, lambda listener: None).answer(200, HEADERS, b"x" * 11)
    assert started_transport.data == before
    gone, gone_transport, done = _cycle()
    gone.disconnected = True
    assert not ChunkWriter(gone, lambda listener: None).answer(200, HEADERS, b"x" * 11)
    assert gone_transport.data == b"" and done == [] and not gone.response_started


async def test_answer_refuses_a_header_uvicorn_would_refuse_before_writing() -> None:
    cycle, transport, _ = _cycle()
    with pytest.raises(RuntimeError):
        ChunkWriter(cycle, lambda listener: None).answer(200, [(b"x-bad", b"a\r\nb")], b"")
    assert transport.data == b"" and not cycle.response_started


HEADER_BYTES = st.binary(max_size=5) | st.sampled_from([b"x-a", b"", b"a b", b"v:1", b"\t", b"\x7f", b"ok\r\n"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(headers=st.lists(st.tuples(HEADER_BYTES, HEADER_BYTES), max_size=4))
def test_answer_refuses_exactly_the_headers_uvicorn_refuses(headers: list[tuple[bytes, bytes]]) -> None:
    """The names and values are checked in two searches over them all: refused exactly when
    one header, on its own, fails uvicorn's own check (``send``'s), and nothing written then."""
    cycle, transport, _ = _cycle()
    refused = any(HEADER_RE.search(n) or HEADER_VALUE_RE.search(v) for n, v in headers)
    out = [*headers, (b"content-length", b"1")]
    if refused:
        with pytest.raises(RuntimeError):
            ChunkWriter(cycle, lambda listener: None).answer(200, out, b"x")
        assert transport.data == b"" and not cycle.response_started
    else:
        assert ChunkWriter(cycle, lambda listener: None).answer(200, out, b"x")
        assert transport.data.endswith(b"\r\n\r\nx")


async def test_a_client_that_closes_after_its_whole_answer_has_not_left_early() -> None:
    cycle, _, _ = _cycle()
    writer = ChunkWriter(cycle, lambda listener: None)
    told: list[str] = []
    assert writer.watch(lambda: told.append("left"))
    assert writer.answer(200, HEADERS, b"x" * 11)
    writer.client_lost()  # e.g. the client read its answer and closed
    assert told == [] and not cycle.disconnected
