"""What a caller hands the simulated engine and gets back: a request, its result, a listener.

``Listener`` is the asyncio side of a listener: engine callbacks land in a queue the
HTTP routes read (``updates`` merges what queued up meanwhile into one update).

Their own module so that the engine (``engine.py``) and its statistics (``stats.py``)
both import them and not each other.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt


@dataclass
class SimRequest:
    rid: str
    prompt_ids: npt.NDArray[np.uint32]
    max_new_tokens: int
    ignore_eos: bool = False
    seed: int = 0
    # True: on_tokens for every emission; "first": for the first token only (time to
    # first token, virtual-time load tests); False: never (results only)
    stream: bool | Literal["first"] = True
    # the prompt's page hashes when the caller already has them (it must pass exactly
    # ``kvcache.page_hashes(prompt_ids, page_size)``); None: the engine hashes the prompt
    page_hashes: list[int] | None = None
    # plain prose rather than agent-shaped (a chat request without tools, a prose workload):
    # decoded at the profile's prose accept length (`Profile.accept_length`)
    prose: bool = False


@dataclass
class RequestResult:
    rid: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_device: int
    cached_host: int
    finish_reason: str  # "stop" | "length" | "abort"
    output_ids: list[int]
    spec_verify_ct: int
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    admit_s: float | None = None  # left the waiting queue

    @property
    def spec_accept_length(self) -> float:
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0


class RequestListener(Protocol):
    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None: ...

    def on_finish(self, result: RequestResult, now_s: float) -> None: ...


Update = tuple[list[int], RequestResult | None]


class Listener:
    """Engine callbacks -> an asyncio queue of token batches, then the result."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[int] | RequestResult] = asyncio.Queue()

    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None:
        self.queue.put_nowait(list(token_ids))

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        self.queue.put_nowait(result)

    async def updates(self) -> AsyncIterator[Update]:
        """Batches as they come; what queued up meanwhile is merged into one update."""
        while True:
            item = await self.queue.get()
            tokens: list[int] = []
            while True:
                if isinstance(item, list):
                    tokens.extend(item)
                else:
                    yield tokens, item
                    return
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            yield tokens, None

    async def result(self) -> RequestResult:
        while True:
            item = await self.queue.get()
            if not isinstance(item, list):
                return item
