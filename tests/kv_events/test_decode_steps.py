"""The KV-event decoder in steps (issue 41): a huge batch is decoded in chunks that let the
event loop run between them, to exactly what a decode at once gives; and ``LoopShare`` keeps
the consumer's work within its share of the loop."""
from __future__ import annotations

import asyncio

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.kv_events import (
    DECODE_CHUNK,
    BlockRemoved,
    BlockStored,
    _int_chunks,
    decode_batch,
    decode_steps,
    encode_batch,
)
from replicas.loop_share import LoopShare

WIDTHS = [st.integers(0, 127), st.integers(-32, -1), st.integers(128, 255), st.integers(-128, -33),
          st.integers(256, 65535), st.integers(-(2**15), -129), st.integers(65536, 2**32 - 1),
          st.integers(-(2**31), -(2**15) - 1), st.integers(2**32, 2**64 - 1), st.integers(-(2**63), -(2**31) - 1)]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(st.one_of(*WIDTHS), max_size=300),  # mixed widths: decoded at once
                 st.sampled_from(WIDTHS).flatmap(lambda w: st.lists(w, max_size=300))),  # one width: chunked
       st.integers(1, 64))
def test_chunks_are_the_array(values: list[int], chunk: int) -> None:
    raw = msgspec.Raw(msgspec.msgpack.encode(values))
    assert [v for part in _int_chunks(raw, chunk) for v in part] == values


def test_a_huge_batch_decodes_in_steps_to_the_same_batch() -> None:
    hashes = tuple(range(1 << 40, (1 << 40) + 5 * DECODE_CHUNK + 7))  # 9 bytes each: chunked
    payload = encode_batch([BlockStored(hashes, 3, (1, 2), 16), BlockRemoved(hashes[:10], "CPU_PINNED")])
    steps = decode_steps(4, payload)
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            batch = done.value
            break
    assert yields >= 6 and batch == decode_batch(4, payload)
    assert batch.events[0] == BlockStored(hashes, 3, (1, 2), 16)
    assert decode_batch(4, payload, token_ids=False).events[0] == BlockStored(hashes, 3, (), 16)


async def test_loop_share_rests_as_long_as_the_work_at_half() -> None:
    loop = asyncio.get_running_loop()
    share = LoopShare(0.5)
    start = loop.time()
    await share.rest(0.05)
    assert loop.time() - start >= 0.049  # half the loop: as long a rest as the work
    await asyncio.sleep(0.1)  # idle time is not saved up
    start = loop.time()
    await share.rest(0.03)
    assert loop.time() - start >= 0.029

