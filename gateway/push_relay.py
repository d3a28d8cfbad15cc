"""The push relay: a streamed answer's chunks written to the client as they are parsed.

The pull relay (``RelayResponse`` iterating the proxy's generator) costs, per SSE event,
a task wake-up and a future in the upstream client, an async generator step, and an
ASGI ``send`` through three wrappers into uvicorn's cycle. The push relay does none of
that. The upstream connection (``gateway.h1_upstream``) hands each parsed chunk to a
``PushRun`` from its own ``data_received``; the run writes the chunk, framed as HTTP
chunked encoding, into the client's transport through the connection's ``ChunkWriter``,
and feeds the usage sniffer. The request's task only waits for the end.

``ChunkWriter`` is what ``EdgeProtocol`` (gateway/edge.py) hands the app for each
request, as the ASGI scope extension ``PUSH_EXTENSION``. It writes only while the head is
sent, chunked, the response is not complete and the client is there. Everything else
stays on the ASGI path: the head, the last chunk (``0\\r\\n\\r\\n``, uvicorn's keep-alive
bookkeeping) and the shutdown cut's event. ``boundary`` tells the cut whether the pushed
bytes ended between two events. Two more duties: a whole non-streamed answer can be
written in one go from the upstream connection's callback (``ChunkWriter.answer``, which
completes uvicorn's cycle as its ``send`` would), and the connection tells the request's
``ClientWatch`` when the client is lost (``watch``, ``client_lost``).

What the run keeps, as the pull relay does:

- **Flow control.** When the client's transport pauses writing (its buffer is over the
  high-water mark), reading from the replica pauses, and resumes with it.
- **The stall bound.** One timer per stream. A replica silent for ``stall_s`` ends the
  stream with ``TimeoutError``. Time the relay spends paused for the client does not
  count as the replica's silence.
- **The client leaving and the shutdown cut** cancel the waiting task (``ClientWatch``,
  ``GatewayServer``). The run then detaches from the connection, which the proxy's
  cleanup closes.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

if TYPE_CHECKING:
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from gateway.h1_upstream import PushSink

PUSH_EXTENSION = "kvgate.push"


def edge_writer(scope: Mapping[str, Any]) -> ChunkWriter | None:
    """The request's ``ChunkWriter``, when kvgate's own edge serves it (else None)."""
    writer = scope.get("extensions", {}).get(PUSH_EXTENSION)
    return writer if isinstance(writer, ChunkWriter) else None


class WritingListener(Protocol):
    def __call__(self, writable: bool) -> None: ...


class _Event(Protocol):
    def set(self) -> None: ...


class Cycle(Protocol):
    """What a ``ChunkWriter`` reads and sets of its request's cycle: uvicorn's
    ``RequestResponseCycle``, or a request held for the callbacks path until it has one
    (``gateway.edge.HeldCycle``)."""

    keep_alive: bool
    disconnected: bool
    response_started: bool
    response_complete: bool
    waiting_for_100_continue: bool
    chunked_encoding: bool | None
    expected_content_length: int

    @property
    def scope(self) -> Mapping[str, Any] | None: ...

    @property
    def transport(self) -> asyncio.Transport: ...

    @property
    def flow(self) -> FlowControl: ...

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]: ...

    @property
    def message_event(self) -> _Event: ...

    def on_response(self) -> None: ...


class ChunkWriter:
    """Writes body chunks of one response straight into the client's transport."""

    __slots__ = ("boundary", "cycle", "draining", "listen", "lost")

    def __init__(self, cycle: Cycle, listen: Callable[[WritingListener | None], None],
                 draining: Callable[[], bool] = lambda: False) -> None:
        """``cycle``: uvicorn's, or a request held for the callbacks path until it has one
        (``gateway.edge.HeldCycle``); ``listen``: registers the listener of the connection's
        pause/resume writing; ``draining``: the gateway is shutting down (an answer then
        closes its connection)."""
        self.cycle = cycle
        self.listen = listen
        self.draining = draining
        self.boundary = True  # the pushed bytes so far end between two SSE events
        self.lost: Callable[[], None] | None = None  # told when the client's connection is lost

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """A whole answer, head and body in one write, the response then completed as
        uvicorn's ``send`` completes it (keep-alive or close, the next pipelined request);
        from the upstream connection's callback, without waking the request's task.
        ``headers`` must carry the ``content-length``. False, with nothing written, unless
        no head is sent yet and the client is there; raises on a header uvicorn would refuse
        (before writing anything)."""
        c = self.cycle
        if c.response_started or c.disconnected or c.transport.is_closing():
            return False
        keep_alive = c.keep_alive and not self.draining()
        content = [STATUS_LINE[status], _server_headers(c.default_headers)]
        names: list[bytes] = []
        values: list[bytes] = []
        for name, value in headers:
            names.append(name)
            values.append(value)
            content += (name.lower(), b": ", value, b"\r\n")
        # uvicorn's checks of every name and value, in two searches over them all (joining
        # adds no byte either looks for)
        if _invalid(names, values):
            raise RuntimeError("invalid HTTP header")
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        c.response_started = True
        c.waiting_for_100_continue = False
        c.chunked_encoding = False
        c.expected_content_length = 0
        c.transport.writelines((b"".join(content), body))
        c.response_complete = True
        c.message_event.set()
        if not keep_alive:
            c.keep_alive = False
            c.transport.close()
        c.on_response()
        return True

    def detach(self) -> None:
        """The response is complete: its scope stops naming this writer, so the scope, the
        cycle and the writer (which name each other) are freed when the request ends, by
        reference counting, not by the garbage collector (a collection of a few hundred
        requests' cycles is a pause of ~0.2 ms on some request's path)."""
        scope = self.cycle.scope
        extensions = scope.get("extensions") if scope is not None else None
        if extensions is not None:
            extensions.pop(PUSH_EXTENSION, None)

    def watch(self, lost: Callable[[], None] | None) -> bool:
        """``lost`` is called (once) when the client's connection is lost; None stops
        watching. False when the client is gone already (``lost`` is then not kept)."""
        if lost is not None and self.cycle.disconnected:
            return False
        self.lost = lost
        return True

    def client_lost(self) -> None:
        """The connection is lost (``EdgeProtocol.connection_lost``): a response not complete
        is disconnected (uvicorn marks only the request it parsed last; an earlier one of a
        pipelined connection would write to the closed transport) and its watcher told. A
        client that closes after its whole answer (``answer``) has not left early."""
        cycle = self.cycle
        cycle.message_event.set()
        lost, self.lost = self.lost, None
        if not cycle.response_complete:
            cycle.disconnected = True
            if lost is not None:
                lost()

    def ready(self) -> bool:
        """The head is sent, the body chunked, the response not complete, the client there."""
        c = self.cycle
        return (c.response_started and c.chunked_encoding is True and not c.response_complete
                and not c.disconnected and not c.transport.is_closing())

    def write(self, data: bytes) -> None:
        c = self.cycle
        if data and not (c.disconnected or c.response_complete or c.transport.is_closing()):
            c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            self.boundary = data.endswith(b"\n\n")

    @property
    def paused(self) -> bool:
        return bool(self.cycle.flow.write_paused)

    @contextlib.contextmanager
    def one_write(self) -> Iterator[None]:
        """Inside the block, uvicorn's cycle writes a response's head and its first body
        part into the transport at once (one send instead of two: a whole answer's head
        and body, ``gateway.relay.AnsweredResponse``); a head left held is written at the
        end of the block."""
        cycle = cast("RequestResponseCycle", self.cycle)  # (the task path's: a held request has no task)
        held = _HeadHeld(cycle.transport)
        cycle.transport = held  # type: ignore[assignment]  # the transport's one write() is what the cycle calls
        try:
            yield
        finally:
            cycle.transport = held.transport
            held.flush()


def _invalid(names: list[bytes], values: list[bytes]) -> bool:
    """A name or a value uvicorn's ``send`` refuses."""
    return bool(HEADER_RE.search(b"".join(names)) or HEADER_VALUE_RE.search(b"".join(values)))


_rendered: tuple[object, bytes] = (None, b"")  # the server's headers last rendered: (their list, bytes)


def _server_headers(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The server's own headers (``date``, ``server``) rendered and checked as ``answer``
    does the answer's, once for each list: uvicorn's main loop makes a new one when the
    date changes."""
    global _rendered
    seen, rendered = _rendered
    if seen is default_headers:
        return rendered
    names = [name for name, _ in default_headers]
    values = [value for _, value in default_headers]
    if _invalid(names, values):
        raise RuntimeError("invalid HTTP header")
    rendered = b"".join(b"%s: %s\r\n" % (name.lower(), value) for name, value in default_headers)
    _rendered = (default_headers, rendered)
    return rendered


class _HeadHeld:
    """A transport whose first write (the head) waits for the second; the rest is the transport's."""

    __slots__ = ("head", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        head, self.head = self.head, None
        if head is None and not self.transport.is_closing() and data.startswith(b"HTTP/"):
            self.head = data  # held for the body
        elif head is None:
            self.transport.write(data)
        else:
            self.transport.writelines((head, data))

    def flush(self) -> None:
        head, self.head = self.head, None
        if head is not None:
            self.transport.write(head)

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


class PushSource(Protocol):
    """An upstream answer that can push its chunks (``gateway.h1_upstream.H1Response``)."""

    def push(self, sink: PushSink) -> None: ...

    def unpush(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class PushRun:
    """One pushed stream: the sink of the upstream answer, the stall timer, flow control."""

    __slots__ = ("_loop", "_timer", "done", "feed", "last", "paused", "source", "stall_s", "writer")

    def __init__(self, source: PushSource, writer: ChunkWriter, stall_s: float, feed: Callable[[bytes], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.source, self.writer, self.stall_s, self.feed = source, writer, stall_s, feed
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.last = self._loop.time()
        self.paused = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self.last + stall_s, self._check)

    async def run(self) -> None:
        """Relay until the answer ends; raises ``UpstreamFailure`` (it broke) or
        ``TimeoutError`` (it stalled); a cancellation detaches and goes on."""
        writer = self.writer
        writer.listen(self.writable)
        try:
            self.source.push(self)  # (resumes reading: a pulled body may have paused it)
            if writer.paused:
                self.writable(False)
            await self.done
        finally:
            writer.listen(None)
            self.source.unpush()
            self.source.resume_reading()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    # ---------------------------------------------------------------- the sink
    def chunk(self, data: bytes) -> None:
        self.last = self._loop.time()
        self.writer.write(data)
        self.feed(data)

    def end(self, error: BaseException | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    # ---------------------------------------------------------------- flow control, stall
    def writable(self, writable: bool) -> None:
        """The client's transport paused (False) or resumed (True) writing."""
        self.paused = not writable
        if writable:
            self.last = self._loop.time()  # the silence is counted from the resume
            self.source.resume_reading()
        else:
            self.source.pause_reading()

    def _check(self) -> None:
        now = self._loop.time()
        due = self.last + self.stall_s
        if not self.paused and now >= due:
            self._timer = None
            self.end(TimeoutError(f"no data for {self.stall_s:g} s"))
            return
        self._timer = self._loop.call_at(due if due > now else now + self.stall_s, self._check)
