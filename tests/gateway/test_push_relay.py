"""The push relay's run (gateway.push_relay.PushRun) over a stub source and writer: the
end, the stall bound, flow control, cancellation. The relay over real processes is in the
integration and safety suites (the default client pushes)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.h1_upstream import PushSink
from gateway.push_relay import PushRun, WritingListener
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
