"""SGLang's page hashes (gateway.sglang_pages) against the reference of the contract doc."""
from __future__ import annotations

import hashlib
import struct

from hypothesis import given
from hypothesis import strategies as st

from gateway.sglang_pages import PageHasher, page_hashes, uses_bigrams


def reference(tokens: list[int], page_size: int) -> list[int]:
    """The pure-Python reference checked against the engine's C++ hash (unigram)."""
    out, prior = [], b""
    for s in range(0, len(tokens), page_size):
        d = hashlib.sha256(prior + b"".join(struct.pack("<I", t) for t in tokens[s:s + page_size])).digest()
        u = int.from_bytes(d[:8], "big")
        out.append(u - 2**64 if u >= 2**63 else u)
        prior = d
    return out


def test_known_values() -> None:
    expected = [-7118152853857507680, -5037572900866013165, 4207034500940810232]
    assert page_hashes(list(range(100, 110)), 4, include_partial=True) == expected
    assert page_hashes(list(range(100, 110)), 4) == expected[:2]  # full pages only


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, 17))
def test_full_pages_match_the_reference(tokens: list[int], page: int) -> None:
    full = len(tokens) // page * page
    assert page_hashes(tokens, page) == reference(tokens[:full], page)


@given(st.lists(st.integers(0, 50_000), max_size=200), st.integers(1, 9), st.lists(st.integers(0, 200), max_size=5),
       st.booleans())
def test_incremental_equals_at_once(tokens: list[int], page: int, cuts: list[int], bigram: bool) -> None:
    hasher = PageHasher(page, bigram=bigram)
    start = 0
    for cut in sorted(c for c in cuts if c <= len(tokens)):
        hasher.extend(tokens[start:cut])
        start = cut
    hasher.extend(tokens[start:])
    assert hasher.hashes == page_hashes(tokens, page, bigram=bigram)


def test_bigram_pages_hash_pairs() -> None:
    tokens = [1, 2, 3, 4, 5]
    pairs = struct.pack("<IIII", 1, 2, 2, 3)  # the first page: pairs (1,2), (2,3)
    d = hashlib.sha256(pairs).digest()
    u = int.from_bytes(d[:8], "big")
    assert page_hashes(tokens, 2, bigram=True)[0] == (u - 2**64 if u >= 2**63 else u)
    assert len(page_hashes(tokens, 2, bigram=True)) == 2  # 4 pairs -> 2 pages
    assert uses_bigrams("eagle3") and not uses_bigrams("DFLASH") and not uses_bigrams(None)
