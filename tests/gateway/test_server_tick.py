"""The gateway server's main loop: a slow tick that a signal ends at once."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from gateway.edge import Edge
from gateway.server import GatewayServer
from gateway.settings import ServerConfig


async def _app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError("no request in this test")


def _server(tick_s: float) -> GatewayServer:
    config = uvicorn.Config(_app, lifespan="off", log_level="warning")
    config.load()
    return GatewayServer(config, Edge(ServerConfig(), 16), tick_s=tick_s)


async def test_a_signal_ends_the_ticks_wait_at_once() -> None:
    server = _server(tick_s=3600.0)  # a tick that never comes within the test
    loop_task = asyncio.create_task(server.main_loop())
    await asyncio.sleep(0.05)
    assert not loop_task.done()
    assert any(name == b"date" for name, _ in server.server_state.default_headers)  # set at the first tick
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(loop_task, 10.0)  # the loop returns: it did not wait for the hour
    assert server.should_exit


async def test_the_loop_ticks_and_sees_should_exit_set_without_a_signal() -> None:
    server = _server(tick_s=0.01)
    loop_task = asyncio.create_task(server.main_loop())
    await asyncio.sleep(0.05)
    server.should_exit = True  # e.g. set by uvicorn itself, not by a signal
    await asyncio.wait_for(loop_task, 10.0)


def test_a_signal_after_the_loop_and_its_event_loop_ended_is_harmless() -> None:
    server = _server(tick_s=0.01)

    async def run_then_exit() -> None:
        task = asyncio.create_task(server.main_loop())
        await asyncio.sleep(0.05)
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)

    asyncio.run(run_then_exit())  # the event loop is closed after this
    server.handle_exit(signal.SIGINT, None)  # a late signal (before uvicorn restores the handlers)
    assert server.force_exit  # uvicorn's own meaning of a second SIGINT, nothing raised
