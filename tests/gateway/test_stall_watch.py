"""StallWatch: one timer per stream that cancels only a read the replica leaves silent."""
from __future__ import annotations

import asyncio

import pytest

from gateway.stall_watch import StallWatch


async def _read(watch: StallWatch, wait_s: float) -> str:
    """One read that waits ``wait_s`` for its data: 'data' or 'stalled'."""
    watch.reading()
    try:
        await asyncio.sleep(wait_s)
    except asyncio.CancelledError as exc:
        if watch.stalled(exc):
            return "stalled"
        raise
    finally:
        watch.arrived()
    return "data"


async def test_a_silent_read_is_cancelled_after_the_limit() -> None:
    watch = StallWatch(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await _read(watch, 5.0) == "stalled"
    assert loop.time() - start >= 0.05  # never earlier than the limit
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # taken back
    watch.close()


async def test_reads_that_keep_getting_data_are_never_cancelled() -> None:
    watch = StallWatch(0.25)  # a margin of 0.23 s over each read: a loaded machine's loop delays
    results = [await _read(watch, 0.02) for _ in range(20)]  # 0.4 s in all, each read 0.02 s
    assert results == ["data"] * 20
    watch.close()


async def test_time_with_the_client_does_not_count() -> None:
    """Between reads (the task sends to a slow client) the watch does not cancel."""
    watch = StallWatch(0.25)
    assert await _read(watch, 0.0) == "data"
    await asyncio.sleep(1.0)  # not reading: four limits pass
    assert await _read(watch, 0.02) == "data"  # the next read's silence counts from its start
    assert await _read(watch, 5.0) == "stalled"
    watch.close()


async def test_another_cancellation_goes_on() -> None:
    async def stream() -> str:
        watch = StallWatch(10.0)
        try:
            return await _read(watch, 5.0)
        finally:
            watch.close()

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_closed_watch_never_fires() -> None:
    watch = StallWatch(0.02)
    watch.reading()
    watch.close()
    await asyncio.sleep(0.08)
    assert not watch.fired
