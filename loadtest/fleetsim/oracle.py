"""The upper bound every policy is compared with: an infinite cache and perfect affinity.

For each request, in the order the simulation sent them, the oracle's cached tokens are
the longest prefix of its block chain already seen in ANY earlier request (any session,
any replica), times the block size (at most the prompt). Chains are prefix-closed (a
block value names its whole prefix), so the seen set is prefix-closed too and the
longest seen prefix is found by binary search. Only requests the fleet accepted are
recorded (a request rejected for its size never reaches any cache).

The oracle's TTFT is the prefill of only its uncached tokens at the profile's prefill
speed, with no queueing and no host load-back: the best any router could do on this
hardware.
"""
from __future__ import annotations

from collections.abc import Sequence


class Oracle:
    def __init__(self) -> None:
        self._seen: set[int] = set()

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` seen before (binary search on a prefix-closed set)."""
        seen = self._seen
        lo, hi = 0, len(hashes)
        if hi and hashes[hi - 1] in seen:
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, hashes: Sequence[int], from_block: int = 0) -> None:
        self._seen.update(hashes[from_block:])

    def cached_tokens(self, hashes: Sequence[int], block_size: int, prompt_tokens: int) -> int:
        """Cached tokens of a request under the oracle (does not record it)."""
        return min(self.match_blocks(hashes) * block_size, prompt_tokens)
