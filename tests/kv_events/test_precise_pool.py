"""The tokenizer pool (gateway/precise_pool.py): bounded queue, per-request deadline, two lanes,
and the event loop free while a job runs."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.precise_pool import PoolDeadline, PoolFull, TokenizePool


async def test_runs_off_the_loop_and_returns_the_result() -> None:
    pool = TokenizePool(workers=1, queue_max=2, deadline_s=5.0)
    try:
        loop_thread = threading.get_ident()
        assert await pool.run(threading.get_ident) != loop_thread
        assert await pool.run(lambda: 41 + 1, heavy=True) == 42
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 // 0)
        assert pool.pending == 0
    finally:
        pool.close()


async def test_a_job_past_the_deadline_routes_approximately_and_still_finishes() -> None:
    pool = TokenizePool(workers=1, queue_max=2, deadline_s=0.05)
    finished = threading.Event()

    def slow() -> int:
        time.sleep(0.3)
        finished.set()
        return 1

    try:
        with pytest.raises(PoolDeadline):
            await pool.run(slow, heavy=True)
        assert pool.pending == 1
        async with asyncio.timeout(5):
            while pool.pending:
                await asyncio.sleep(0.01)
        assert finished.is_set()  # its results (caches) are kept for the next turn
    finally:
        pool.close()


async def test_the_queue_is_bounded() -> None:
    pool = TokenizePool(workers=1, queue_max=1, deadline_s=5.0)
    gate = threading.Event()
    try:
        jobs = [asyncio.create_task(pool.run(lambda: gate.wait(5), heavy=True)) for _ in range(3)]
        await asyncio.sleep(0.05)  # workers + light lane + queue: 3 accepted
        with pytest.raises(PoolFull):
            await pool.run(lambda: None)
        gate.set()
        assert await asyncio.gather(*jobs) == [True, True, True]
    finally:
        pool.close()


async def test_a_light_job_does_not_wait_behind_a_heavy_one() -> None:
    pool = TokenizePool(workers=1, queue_max=4, deadline_s=5.0)
    gate = threading.Event()
    try:
        heavy = asyncio.create_task(pool.run(lambda: gate.wait(5), heavy=True))
        await asyncio.sleep(0.02)
        assert await pool.run(lambda: "light") == "light"
        assert not heavy.done()  # answered while the heavy job still holds its thread
        gate.set()
        await heavy
    finally:
        pool.close()


def test_bounds_are_checked() -> None:
    for kwargs in ({"workers": 0}, {"queue_max": -1}, {"deadline_s": 0.0}):
        with pytest.raises(ValueError):
            TokenizePool(**kwargs)  # type: ignore[arg-type]
