"""Paged prefix cache: chained page ids, tiers, LRU eviction, pinning, counters."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.simulator.kvcache import PagedPrefixCache, page_hashes

PAGE = 16


def _ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 163_840, n).astype(np.uint32)


def _cache_prompt(cache: PagedPrefixCache, ids: np.ndarray) -> list[int]:
    """Admit a prompt, compute it, release it (what a finished request does)."""
    hashes = cache.hashes(ids)
    match = cache.match(hashes)
    path = cache.try_admit(hashes, match, len(ids) - match.tokens)
    assert path is not None
    cache.commit(path, hashes[match.pages :])
    assert path == hashes
    cache.release(path, len(ids) - len(hashes) * PAGE)
    return hashes


def test_page_ids_are_chained_and_full_pages_only() -> None:
    a = _ids(0, 100)
    b = a.copy()
    b[40] += 1
    ha, hb = page_hashes(a, PAGE), page_hashes(b, PAGE)
    assert len(ha) == 100 // PAGE  # the trailing partial page is not a page
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert page_hashes(a[32:], PAGE, parent=ha[1]) == ha[2:]


def test_shared_prefix_is_matched_on_device() -> None:
    cache = PagedPrefixCache(PAGE, 4096, 8192)
    base = _ids(1, 1000)
    _cache_prompt(cache, base)
    longer = np.concatenate([base, _ids(2, 500)])
    match = cache.match(cache.hashes(longer))
    assert match.device_tokens == 1000 // PAGE * PAGE and match.host_tokens == 0
    assert cache.device_used_tokens == 1000 // PAGE * PAGE
    assert cache.locked_tokens == 0


def test_device_overflow_moves_pages_to_host_then_drops_them() -> None:
    cache = PagedPrefixCache(PAGE, 1024, 2048)
    first = _cache_prompt(cache, _ids(10, 1024))
    _cache_prompt(cache, _ids(11, 1024))  # pushes `first` to the host
    match = cache.match(first)
    assert match.device_pages == 0 and match.host_tokens == 1024
    assert cache.evicted_tokens_total >= 1024 and cache.host_used_tokens >= 1024
    for seed in (12, 13, 14):  # 3 more pools' worth: `first` falls off the host
        _cache_prompt(cache, _ids(seed, 1024))
    assert cache.match(first).tokens == 0
    assert cache.host_dropped_tokens_total > 0
    assert cache.host_used_tokens <= cache.host_total_tokens
    assert cache.device_used_tokens <= cache.device_total_tokens


def test_host_hit_is_loaded_back_on_admission() -> None:
    cache = PagedPrefixCache(PAGE, 1024, 2048)
    first = _cache_prompt(cache, _ids(20, 512))
    _cache_prompt(cache, _ids(21, 1024))
    match = cache.match(first)
    assert match.host_tokens == 512
    path = cache.try_admit(first, match, 0)
    assert path is not None
    assert cache.load_back_tokens_total == 512
    assert cache.match(first).device_tokens == 512 and cache.host_used_tokens == 512
    cache.release(path, 0)


def test_lru_evicts_least_recent_and_leaves_first() -> None:
    cache = PagedPrefixCache(PAGE, 1024, 0)
    old = _cache_prompt(cache, _ids(30, 512))
    recent = _cache_prompt(cache, _ids(31, 256))
    _cache_prompt(cache, _ids(32, 256))
    _cache_prompt(cache, recent_ids := _ids(31, 256))  # touch `recent` again
    assert cache.hashes(recent_ids) == recent
    _cache_prompt(cache, _ids(33, 256))  # needs room: `old` goes (its leaves first)
    assert cache.match(recent).device_tokens == 256
    left = cache.match(old).device_pages
    assert left < len(old)
    # whatever is left of `old` is a prefix (leaves were evicted first)
    assert all(cache.on_device(h) for h in old[:left])


def test_pinned_pages_are_never_evicted() -> None:
    cache = PagedPrefixCache(PAGE, 1024, 0)
    ids = _ids(40, 512)
    pinned = cache.hashes(ids)
    path = cache.try_admit(pinned, cache.match(pinned), 512)
    assert path is not None
    cache.commit(path, pinned)
    assert cache.pinned_tokens == 512 and cache.is_pinned(pinned[-1])
    # another request wants the whole rest of the pool, repeatedly
    for seed in range(41, 45):
        _cache_prompt(cache, _ids(seed, 512))
    assert cache.match(pinned).device_tokens == 512
    # more than what is left over cannot be admitted
    other = cache.hashes(_ids(50, 600))
    assert cache.try_admit(other, cache.match(other), 600) is None
    cache.release(path, 0)
    assert cache.pinned_tokens == 0 and cache.locked_tokens == 0


def test_flush_only_when_nothing_is_held() -> None:
    cache = PagedPrefixCache(PAGE, 1024, 1024)
    hashes = cache.hashes(_ids(60, 64))
    path = cache.try_admit(hashes, cache.match(hashes), 64)
    assert path is not None
    assert not cache.flush()
    cache.commit(path, hashes)
    cache.release(path, 0)
    assert cache.flush() and cache.is_empty()


def test_shared_pins_are_counted_once_and_kept_until_the_last_release() -> None:
    cache = PagedPrefixCache(PAGE, 4096, 0)
    common = _ids(70, 320)
    a_ids, b_ids = np.concatenate([common, _ids(71, 160)]), np.concatenate([common, _ids(72, 160)])
    a_hashes, b_hashes = cache.hashes(a_ids), cache.hashes(b_ids)
    a = cache.try_admit(a_hashes, cache.match(a_hashes), len(a_ids))
    assert a is not None
    cache.commit(a, a_hashes)
    b_match = cache.match(b_hashes)
    assert b_match.device_tokens == 320
    b = cache.try_admit(b_hashes, b_match, len(b_ids) - 320)
    assert b is not None
    cache.commit(b, b_hashes[b_match.pages :])
    assert cache.pinned_tokens == 320 + 160 + 160
    cache.release(a, 0)
    assert cache.pinned_tokens == 320 + 160
    assert all(cache.is_pinned(h) for h in a_hashes[:20])
    assert not any(cache.is_pinned(h) for h in a_hashes[20:])
    cache.release(b, 0)
    assert cache.pinned_tokens == 0 and cache.evictable_tokens == 320 + 160 + 160


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40), st.booleans()), max_size=40))
def test_invariants_hold_under_random_traffic(ops: list[tuple[int, int, bool]]) -> None:
    """Pools never overflow; pinned paths stay on the device; counts add up."""
    cache = PagedPrefixCache(PAGE, 512, 1024)
    trunks = [_ids(100 + i, 40 * PAGE) for i in range(8)]
    running: list[tuple[list[int], int]] = []
    for trunk, pages, finish_one in ops:
        if finish_one and running:
            done, private = running.pop(0)
            cache.release(done, private)
        hashes = cache.hashes(trunks[trunk][: pages * PAGE])
        match = cache.match(hashes)
        assert match.pages <= pages
        assert all(cache.on_device(h) for h in hashes[: match.device_pages])
        path = cache.try_admit(hashes, match, (pages - match.pages) * PAGE)
        if path is not None:
            cache.commit(path, hashes[match.pages :])
            running.append((path, 0))
        assert cache.device_used_tokens <= cache.device_total_tokens
        assert cache.host_used_tokens <= cache.host_total_tokens
        for held, _ in running:
            assert all(cache.is_pinned(h) for h in held)
        union = {h for held, _ in running for h in held}
        assert cache.pinned_tokens == len(union) * PAGE
    for done, private in running:
        cache.release(done, private)
    assert cache.locked_tokens == 0


def test_pool_fifo_skips_stale_entries_and_survives_rebuilds() -> None:
    from loadtest.simulator.kvcache import _Pool

    pool = _Pool()
    stamp = 0
    for _round in range(30):  # re-stamp the same 500 pages: most entries go stale
        pages = list(range(500))
        pool.add(pages, range(stamp, stamp + 500))
        stamp += 500
    assert len(pool) == 500
    pool.add([1000, 1001], [stamp, stamp + 1])
    victims, stamps = pool.pop_oldest(3)
    assert victims == [0, 1, 2] and stamps == sorted(stamps)
    rest, _ = pool.pop_oldest(10_000)
    assert rest[-2:] == [1000, 1001] and len(rest) == 499 and len(pool) == 0


def _recorded_cache(device: int, host: int) -> tuple[Any, Any, list[Any]]:
    """An engine (tiny profile, pools resized) whose events feed an EventBlockIndex."""
    from loadtest.simulator.engine import ReplicaEngine
    from loadtest.simulator.kv_publisher import KvEventRecorder
    from loadtest.simulator.profile import load_profile

    profile = load_profile("tiny").replace(device_tokens=device, host_tokens=host)
    engine = ReplicaEngine(profile)
    batches: list[Any] = []
    engine.attach_events(KvEventRecorder(profile.page_size, lambda events, ts: batches.append(events)))
    return engine, profile, batches


class _Done:
    def on_tokens(self, rid: str, token_ids: Any, now_s: float) -> None:
        pass

    def on_finish(self, result: Any, now_s: float) -> None:
        pass


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(2, 30)), min_size=1, max_size=30),
       st.sampled_from([0, 1024]))
def test_events_track_the_cache_per_medium(ops: list[tuple[int, int]], host: int) -> None:
    """Fed every event, an EventBlockIndex holds exactly the cache's pages, per tier, named
    by SGLang's hash of their tokens; a flush clears it."""
    from gateway.sglang_pages import page_hashes as sglang_page_hashes
    from loadtest.simulator.kv_publisher import KvEventRecorder
    from loadtest.simulator.requests import SimRequest
    from prefix_index.base import ReplicaId
    from prefix_index.precise import EventBlockIndex
    from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    engine, _, batches = _recorded_cache(512, host)
    index, rid = EventBlockIndex(), ReplicaId("r")
    trunks = [_ids(200 + i, 30 * PAGE) for i in range(6)]
    now = 0.0
    for k, (which, pages) in enumerate(ops):
        ids = trunks[which][: pages * PAGE + 3]
        engine.submit(SimRequest(f"q{k}", ids, 4, ignore_eos=True), _Done(), now)
        now += 0.05
        engine.advance(now)
    engine.advance(now + 100.0)
    for batch in batches:
        for e in batch:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * PAGE
                if e.parent_block_hash is None:  # a root chain: its hashes are its tokens' own
                    assert sglang_page_hashes(list(e.token_ids), PAGE) == list(e.block_hashes)
                index.stored(rid, e.block_hashes, e.medium)
            elif isinstance(e, BlockRemoved):
                index.removed(rid, e.block_hashes, e.medium)
    cache = engine.cache
    recorder = engine.events
    assert isinstance(recorder, KvEventRecorder)
    names = recorder.names
    device = {recorder.sglang_hash(h) for h in cache._device.stamps}
    host_pages = {recorder.sglang_hash(h) for h in cache._host.stamps}
    assert set(names) == set(cache._device.stamps) | set(cache._host.stamps)
    assert index.blocks(rid) == (len(device), len(host_pages))
    for trunk in trunks:  # lookups agree tier by tier
        hashes = sglang_page_hashes(trunk.tolist(), PAGE)
        m = index.match(hashes, [rid])[rid]
        cm = cache.match(cache.hashes(trunk))
        assert (m.device_blocks, m.host_blocks) == (cm.device_pages, cm.host_pages)
    assert engine.flush_cache()
    assert isinstance(batches[-1][-1], AllBlocksCleared) and not names
