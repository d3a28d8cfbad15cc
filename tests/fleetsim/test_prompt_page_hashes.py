"""`SessionPrompt.page_hashes` (kept per session) equals hashing the whole prompt."""
from __future__ import annotations

import random

import pytest

from loadtest.fleetsim.prompts import SessionPrompt
from loadtest.simulator.kvcache import page_hashes


@pytest.mark.parametrize(("block_size", "page_size"), [(64, 64), (64, 16), (16, 64), (32, 48)])
def test_incremental_page_hashes_equal_full_hashing(block_size: int, page_size: int) -> None:
    rng = random.Random(block_size * 1000 + page_size)
    prompt = SessionPrompt("ns", "session-1", block_size, max_blocks=10_000, want_text=False)
    blocks: list[int] = []
    for turn in range(60):
        shared = rng.randrange(len(blocks) + 1) if rng.random() < 0.3 else len(blocks)
        new = tuple(rng.randrange(1 << 40) for _ in range(rng.randrange(0, 12)))
        blocks = blocks[:shared] + list(new)
        prompt.advance(shared, new)
        full = len(blocks) * block_size
        in_tokens = max(1, full + rng.randrange(-2 * block_size, 3 * block_size))  # cut or a tail
        ids = prompt.prompt_ids(in_tokens, turn)
        assert prompt.page_hashes(ids, page_size) == page_hashes(ids, page_size)
