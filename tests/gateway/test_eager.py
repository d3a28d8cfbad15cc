"""gateway/eager.py: coroutines run to their end inside a callback when they never wait;
the rest of one that does wait goes on in a task, as a task would have run it."""
from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.eager import WouldWait, finished, run_now


async def _value(x: int) -> int:
    return x * 2


async def _waits(fut: asyncio.Future[int], seen: list[object]) -> None:
    seen.append("before")
    try:
        seen.append(await fut)
        await asyncio.sleep(0)  # a bare yield too
        seen.append("after")
    except asyncio.CancelledError:
        seen.append("cancelled")
        raise


def test_finished_returns_the_value_of_a_coroutine_that_does_not_wait() -> None:
    assert finished(_value(21)) == 42


def test_finished_refuses_a_coroutine_that_waits_and_closes_it() -> None:
    async def main() -> None:
        closed: list[bool] = []

        async def waits() -> int:
            try:
                await asyncio.sleep(1)
            finally:
                closed.append(True)
            return 1

        with pytest.raises(WouldWait):
            finished(waits())
        assert closed == [True]

    asyncio.run(main())


def test_run_now_finishes_at_once_without_a_task() -> None:
    done: list[int] = []

    async def book() -> None:
        done.append(1)

    assert run_now(book(), "bookkeeping") is None
    assert done == [1]


def test_run_now_continues_a_waiting_coroutine_in_a_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        seen: list[object] = []
        task = run_now(_waits(fut, seen), "bookkeeping")
        assert task is not None and seen == ["before"]
        loop.call_later(0.01, fut.set_result, 7)
        await asyncio.wait_for(task, 5.0)
        assert seen == ["before", 7, "after"]

    asyncio.run(main())


def test_the_rest_sees_its_future_failure_and_a_cancellation() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        failing: asyncio.Future[int] = loop.create_future()
        seen: list[object] = []

        async def catches() -> None:
            try:
                await failing
            except ValueError as exc:
                seen.append(str(exc))

        task = run_now(catches(), "x")
        assert task is not None
        failing.set_exception(ValueError("boom"))
        await asyncio.wait_for(task, 5.0)
        assert seen == ["boom"]

        pending: asyncio.Future[int] = loop.create_future()
        seen2: list[object] = []
        task2 = run_now(_waits(pending, seen2), "y")
        assert task2 is not None
        await asyncio.sleep(0.01)
        task2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task2
        assert seen2 == ["before", "cancelled"]

    asyncio.run(main())


def test_a_failure_is_logged_never_lost(caplog: pytest.LogCaptureFixture) -> None:
    async def fails_now() -> None:
        raise RuntimeError("at once")

    async def fails_later(fut: asyncio.Future[None]) -> None:
        await fut
        raise RuntimeError("later")

    async def main() -> None:
        assert run_now(fails_now(), "first") is None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = run_now(fails_later(fut), "second")
        assert task is not None
        fut.set_result(None)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="kvgate.eager"):
        asyncio.run(main())
    assert "first failed" in caplog.text and "second failed" in caplog.text
