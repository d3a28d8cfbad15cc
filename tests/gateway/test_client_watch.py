"""ClientWatch: the work stops when the client leaves, and only then is its cancellation swallowed."""
from __future__ import annotations

import asyncio

from starlette.types import Message, Receive

from gateway.client_watch import ClientWatch


def _receive(gone: asyncio.Event) -> Receive:
    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_client_leaving_cancels_the_work_and_is_swallowed() -> None:
    gone = asyncio.Event()
    receive = _receive(gone)
    reached_end = False

    async def work() -> bool:
        nonlocal reached_end
        async with ClientWatch(receive) as watch:
            gone.set()
            await asyncio.sleep(10)
            reached_end = True
        return watch.left

    assert await asyncio.wait_for(work(), 5) is True
    assert not reached_end
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_work_that_ends_first_is_untouched_and_the_watcher_is_gone() -> None:
    gone = asyncio.Event()
    receive = _receive(gone)
    before = len(asyncio.all_tasks())
    async with ClientWatch(receive) as watch:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not watch.left
    assert len(asyncio.all_tasks()) == before
    gone.set()  # a disconnect after the block changes nothing
    await asyncio.sleep(0.01)
    assert not watch.left


async def test_other_cancellations_go_on() -> None:
    gone = asyncio.Event()
    receive = _receive(gone)

    async def work() -> None:
        async with ClientWatch(receive):
            await asyncio.sleep(10)

    task = asyncio.create_task(work())
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. the shutdown's cut
    await asyncio.wait([task], timeout=5)
    assert task.cancelled()


async def test_an_outside_cancellation_with_the_client_gone_goes_on() -> None:
    gone = asyncio.Event()
    receive = _receive(gone)
    started = asyncio.Event()

    async def work() -> None:
        async with ClientWatch(receive):
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(work())
    await started.wait()
    gone.set()
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.cancelled()


async def test_a_failing_receive_does_not_cancel_the_work() -> None:
    async def receive() -> Message:
        raise RuntimeError("transport gone")

    async with ClientWatch(receive) as watch:
        await asyncio.sleep(0.01)
    assert not watch.left
