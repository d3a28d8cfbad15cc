"""Trace turns -> what the gateway and the engine see: block hashes, token ids, routing text.

The traces carry chained hash ids, not text. For one session, every turn's prompt is
built *incrementally* from the previous turn's (turns are delta-encoded in
`loadtest.workload`), so a turn costs O(its new blocks), not O(its prompt):

- **block hashes** (`RequestContext.block_hashes`): a 64-bit mix of the namespace's
  ``xxh3_64`` and the hash id, per block (vectorised). The trace ids are already chained (equal id = equal prefix), so a per-block
  value names the prefix exactly as the gateway's chained text hashes would: equal id
  prefixes give equal hash prefixes. Capped like the gateway's ``max_blocks`` (the
  gateway hashes at most 8192 x 64 tokens of a prompt).
- **token ids** (the engine's prompt): each hash id becomes ``block_size`` deterministic
  token ids (a 64-bit mix of the block value and the position), so identical hash-id
  prefixes give identical token-id prefixes and the engine's page hashes (64 tokens)
  share exactly what the trace shares. The tail (``in - blocks * block_size`` tokens, the
  trace's partial last block) is fresh: keyed by (session, turn), shared with nobody.
  Mooncake's last block may be partial (``in < blocks * block_size``): the prompt is cut.
- **routing text** (`RequestContext.routing_text`, only for policies that read text,
  e.g. ``sglang-cache-aware``): ``TEXT_CHARS_PER_BLOCK`` characters per block (from the
  block value) and a proportional fresh tail; ratios of matched to total characters are
  those of the real text, absolute sizes are ``TEXT_CHARS_PER_BLOCK / (4 * block_size)``
  of it (the runner scales that policy's character budget by the same factor).
- **engine page hashes** (`SessionPrompt.page_hashes`): what the simulated engine would
  compute from the prompt's token ids (``kvcache.page_hashes``), kept per session for the
  block tokens (a turn hashes only the pages past what it shares with the previous
  turn's) plus the pages of the fresh tail: the same values, without rehashing the
  whole prompt every turn.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

from loadtest.simulator.kvcache import ROOT_SEED, page_hashes

TokenIds = npt.NDArray[np.uint32]
VOCAB = 160_000  # token ids stay below a realistic vocabulary size
TEXT_CHARS_PER_BLOCK = 4
_TEXT_BASE = 0x4E00  # CJK block: 20,000 distinct one-character "digits"
_TEXT_RADIX = 20_000
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, vectorised (a bijection of 64-bit values)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def block_values(namespace_seed: int, hash_ids: tuple[int, ...] | list[int]) -> list[int]:
    """The 64-bit values naming (namespace, hash id) blocks: ``mix64(seed + mix64(id))``."""
    if not hash_ids:
        return []
    ids = np.array(hash_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        v = _mix64(_mix64(ids) + np.uint64(namespace_seed))
    out: list[int] = v.tolist()
    return out


def namespace_seed(namespace: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode())


def block_tokens(values: list[int], block_size: int) -> TokenIds:
    """``block_size`` token ids per block value, concatenated (vectorised)."""
    if not values:
        return np.empty(0, dtype=np.uint32)
    keys = np.array(values, dtype=np.uint64)
    pos = np.arange(block_size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (keys[:, None] * _MIX) + pos[None, :]
        x ^= x >> np.uint64(29)
        x *= _MIX2
        x ^= x >> np.uint64(32)
    return (x % np.uint64(VOCAB)).astype(np.uint32).reshape(-1)


def fresh_tokens(key: int, n: int) -> TokenIds:
    """``n`` token ids nobody else shares (keyed by a 64-bit value)."""
    if n <= 0:
        return np.empty(0, dtype=np.uint32)
    return block_tokens([key], n)


def block_text(values: list[int]) -> str:
    """``TEXT_CHARS_PER_BLOCK`` characters per block value."""
    out: list[str] = []
    for v in values:
        for _ in range(TEXT_CHARS_PER_BLOCK):
            out.append(chr(_TEXT_BASE + v % _TEXT_RADIX))
            v //= _TEXT_RADIX
    return "".join(out)


class SessionPrompt:
    """One conversation's prompt state, advanced turn by turn (see the module docstring)."""

    __slots__ = ("block_size", "hashes", "key", "max_blocks", "ns_seed", "pages", "text", "tokens",
                 "want_text")

    def __init__(self, namespace: str, session_id: str, block_size: int, max_blocks: int,
                 want_text: bool) -> None:
        self.ns_seed = namespace_seed(namespace)
        self.key = xxhash.xxh3_64_intdigest(session_id.encode(), self.ns_seed)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.want_text = want_text
        self.hashes: list[int] = []
        self.tokens: TokenIds = np.empty(0, dtype=np.uint32)
        self.pages: tuple[int, list[int]] = (0, [])  # (page size, page hashes of tokens' first pages)
        self.text = ""

    def advance(self, shared_blocks: int, new_ids: tuple[int, ...]) -> None:
        """Keep ``shared_blocks`` blocks of the previous turn, append ``new_ids``."""
        bs, seed = self.block_size, self.ns_seed
        new = block_values(seed, new_ids)
        del self.hashes[shared_blocks:]
        self.hashes.extend(new)
        kept = self.tokens[: shared_blocks * bs]
        page_size, pages = self.pages
        if page_size:
            del pages[len(kept) // page_size :]
        self.tokens = np.concatenate((kept, block_tokens(new, bs))) if new else kept
        if self.want_text:
            self.text = self.text[: shared_blocks * TEXT_CHARS_PER_BLOCK] + block_text(new)

    def prompt_ids(self, in_tokens: int, turn: int) -> TokenIds:
        """The engine's prompt for this turn: the blocks, then a fresh tail (or cut)."""
        full = len(self.tokens)
        if in_tokens <= full:
            return self.tokens[: max(in_tokens, 1)]
        tail = fresh_tokens(self.key ^ (turn + 1) * 0x9E3779B1, in_tokens - full)
        return np.concatenate((self.tokens, tail))

    def page_hashes(self, prompt: TokenIds, page_size: int) -> list[int]:
        """``kvcache.page_hashes(prompt, page_size)`` for a prompt from `prompt_ids`."""
        if self.pages[0] != page_size:
            self.pages = (page_size, [])
        pages = self.pages[1]
        common = min(len(prompt), len(self.tokens)) // page_size  # pages the prompt shares
        if len(pages) < common:
            parent = pages[-1] if pages else ROOT_SEED
            pages += page_hashes(self.tokens[len(pages) * page_size : common * page_size], page_size, parent)
        out = pages[:common]
        rest = prompt[common * page_size :]
        if len(rest) >= page_size:
            out += page_hashes(rest, page_size, out[-1] if out else ROOT_SEED)
        return out

    def block_hashes(self) -> tuple[int, ...]:
        """The gateway's block hashes (capped at ``max_blocks``)."""
        return tuple(self.hashes[: self.max_blocks])

    def routing_text(self, in_tokens: int, turn: int) -> str:
        if not self.want_text:
            return ""
        full = len(self.hashes) * self.block_size
        tail_chars = -(-max(in_tokens - full, 0) * TEXT_CHARS_PER_BLOCK // self.block_size)
        if tail_chars <= 0:
            return self.text
        n = -(-tail_chars // TEXT_CHARS_PER_BLOCK)
        base = self.key + (turn + 1) * 1_000_003
        tail = block_text([(base + i) & 0xFFFFFFFFFFFFFFFF for i in range(n)])
        return self.text + tail[:tail_chars]
