"""Benchmark of the simulated replica: cache-index memory, and virtual-time speed.

Memory: fills one ``PagedPrefixCache`` of the default profile's sizes (2M device + 4M
host tokens) with 6M tokens of distinct content (60 prompts of 100k tokens, admitted,
computed and released like finished requests, so 2M stay on the device and 4M move to the
host) and prints the Python memory the index holds (tracemalloc) and the process RSS.

Speed (``--speed``): a closed-loop multi-turn workload on 8 engines in a ``VirtualFleet``
(each session resends its growing history, ~60k-130k tokens, plus a shared 10k-token
system prompt; 5 s think time) and prints requests, virtual seconds and CPU seconds.

    python -m loadtest.bench_simulator_memory            # memory
    python -m loadtest.bench_simulator_memory --speed --sessions 200 --turns 100
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence

import numpy as np

from loadtest.simulator.clock import VirtualFleet
from loadtest.simulator.engine import ReplicaEngine, RequestResult, SimRequest
from loadtest.simulator.kvcache import PagedPrefixCache
from loadtest.simulator.profile import DEFAULT_PROFILE, load_profile


def measure_memory(total_tokens: int, prompt_tokens: int = 100_000) -> tuple[float, int]:
    """MB traced in the cache index holding ``total_tokens`` of content, and its pages."""
    profile = load_profile(DEFAULT_PROFILE)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    cache = PagedPrefixCache(profile.page_size, profile.device_tokens, profile.host_tokens)
    for _ in range(total_tokens // prompt_tokens):
        ids = rng.integers(0, 163_840, prompt_tokens).astype(np.uint32)
        hashes = cache.hashes(ids)
        match = cache.match(hashes)
        path = cache.try_admit(hashes, match, prompt_tokens - match.tokens)
        assert path is not None
        cache.commit(path, hashes[match.pages :])
        cache.release(path, prompt_tokens - len(hashes) * profile.page_size)
        del ids, hashes
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    traced = sum(s.size_diff for s in after.compare_to(before, "filename"))
    pages = (cache.device_used_tokens + cache.host_used_tokens) // profile.page_size
    return traced / 1e6, pages


class _Session:
    def __init__(
        self,
        fleet: VirtualFleet,
        index: int,
        shared: np.ndarray,
        turns: int,
        rng: np.random.Generator,
        done: list[RequestResult],
    ) -> None:
        self.fleet, self.index, self.turns, self.rng, self.done = fleet, index, turns, rng, done
        self.prompt = np.concatenate([shared, self._new(50_000)])
        self.turn = 0

    def _new(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 163_840, n).astype(np.uint32)

    def send(self, now_s: float) -> None:
        self.prompt = np.concatenate([self.prompt, self._new(700)])
        req = SimRequest(f"{self.index}-{self.turn}", self.prompt, 1000, stream=False, seed=1)
        self.fleet.submit(self.index % len(self.fleet.engines), req, self)

    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None:
        return None

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        self.done.append(result)
        self.turn += 1
        if self.turn < self.turns:
            self.fleet.schedule(now_s + 5.0, self.send)


def measure_speed(sessions: int, turns: int, engines: int = 8) -> dict[str, float]:
    profile = load_profile(DEFAULT_PROFILE)
    fleet = VirtualFleet([ReplicaEngine(profile, seed=i) for i in range(engines)])
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 163_840, 10_000).astype(np.uint32)
    done: list[RequestResult] = []
    for i in range(sessions):
        fleet.schedule(2.0 * i, _Session(fleet, i, shared, turns, rng, done).send)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    end = fleet.run()
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(done),
        "mean_prompt_tokens": prompt / max(1, len(done)),
        "hit_rate": sum(r.cached_tokens for r in done) / max(1, prompt),
        "virtual_s": end,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - wall0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=6_000_000)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=100)
    args = parser.parse_args(argv)
    command = "python -m loadtest.bench_simulator_memory " + " ".join(argv or sys.argv[1:])
    print(f"command: {command.strip()}")
    if args.speed:
        for key, value in measure_speed(args.sessions, args.turns).items():
            print(f"{key}: {value:,.3f}")
        return 0
    mb, pages = measure_memory(args.tokens)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"cache content: {pages * load_profile(DEFAULT_PROFILE).page_size:,} tokens"
        f" in {pages:,} pages"
    )
    print(f"cache index (tracemalloc): {mb:.1f} MB ({mb * 1e6 / max(1, pages):.0f} B/page)")
    print(f"process max RSS: {rss_mb:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
