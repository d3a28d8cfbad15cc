"""The server side of a loopback HTTP/1.1 stub: an asyncio connection parsing requests
with httptools (the benchmarks' Protocol floor and the stub fleet share it)."""
from __future__ import annotations

import asyncio

import httptools


class RequestParsing(asyncio.Protocol):
    """Feeds every byte to an ``httptools.HttpRequestParser`` whose callbacks (``on_url``,
    ``on_message_complete``, ...) are the subclass's; a request it cannot parse gets
    ``bad_request`` (default: the connection closed)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.bad_request()

    def bad_request(self) -> None:
        if self.transport is not None:
            self.transport.close()
