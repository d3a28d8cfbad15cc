"""``WriteQueue.settled``: the write barrier a response's last byte waits on (issue 45).

No Redis: ``send`` is a fake whose batches wait for an event the test sets, so "the
waiter is released once its own writes have left the queue, not before, and not later"
is checked by order, not by time.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prefix_index.write_behind import QueuedWrite, WriteQueue


class HeldSend:
    """A ``send`` that answers each batch once ``release()`` lets one batch through."""

    def __init__(self, deliver: bool = True) -> None:
        self.batches: list[list[str]] = []
        self.deliver = deliver
        self._go = asyncio.Semaphore(0)

    def release(self) -> None:
        self._go.release()

    async def __call__(self, batch: Sequence[QueuedWrite]) -> Sequence[object] | None:
        await self._go.acquire()
        self.batches.append([w.name for w in batch])
        return [w.name for w in batch] if self.deliver else None


async def until(cond: object, what: str) -> None:
    async with asyncio.timeout(5.0):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0)


async def test_nothing_queued_settles_at_once() -> None:
    queue = WriteQueue(HeldSend(), max_items=10, delay_s=0.0)
    assert await queue.settled(0.0)  # no wait at all: a zero bound still answers True


async def test_a_waiter_is_released_by_its_own_writes_not_by_later_ones() -> None:
    send = HeldSend()
    queue = WriteQueue(send, max_items=10, delay_s=0.0, batch=1)
    queue.put(QueuedWrite("a", ()))
    waiter = asyncio.ensure_future(queue.settled(30.0))
    await asyncio.sleep(0)
    queue.put(QueuedWrite("b", ()))  # queued after the waiter: not waited for
    assert not waiter.done()
    send.release()  # "a" reaches the store
    assert await asyncio.wait_for(waiter, 5.0) is True
    assert send.batches == [["a"]] and queue.finished_total == 1  # "b" is still on its way
    send.release()
    await queue.close(5.0)


async def test_the_bound_is_reported_when_the_writes_are_still_held() -> None:
    send = HeldSend()
    queue = WriteQueue(send, max_items=10, delay_s=0.0)
    queue.put(QueuedWrite("a", ()))
    assert await queue.settled(0.01) is False
    send.release()
    assert await queue.settled(5.0) is True
    await queue.close(5.0)


async def test_failed_and_dropped_writes_release_their_waiters() -> None:
    send = HeldSend(deliver=False)  # Redis down: the batch is counted as failed
    queue = WriteQueue(send, max_items=10, delay_s=0.0)
    queue.put(QueuedWrite("a", ()))
    waiter = asyncio.ensure_future(queue.settled(30.0))
    await asyncio.sleep(0)
    send.release()
    assert await asyncio.wait_for(waiter, 5.0) is True and queue.failed_total == 1

    bounded = WriteQueue(HeldSend(), max_items=1, delay_s=60.0)  # the drain task sleeps: nothing is sent
    bounded.put(QueuedWrite("x", ()))
    waiter = asyncio.ensure_future(bounded.settled(30.0))
    await asyncio.sleep(0)
    bounded.put(QueuedWrite("y", ()))  # drops "x", the oldest: it has left the queue
    assert await asyncio.wait_for(waiter, 5.0) is True and bounded.dropped_total == 1
    await bounded.close(0.01)


async def test_a_timed_out_waiter_is_forgotten() -> None:
    send = HeldSend()
    queue = WriteQueue(send, max_items=10, delay_s=0.0)
    queue.put(QueuedWrite("a", ()))
    assert await queue.settled(0.01) is False
    send.release()
    await until(lambda: queue.finished_total == 1, "the write is sent")
    assert not queue._waiters  # the cancelled waiter was pruned
    await queue.close(5.0)
