"""`kvgate simulate --index precise`: the router matches from the engines' own KV events."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from gateway.cli import main
from gateway.sglang_pages import page_hashes
from loadtest import traces
from loadtest.fleetsim.precise import PreciseFleetIndex, SglangPages
from loadtest.fleetsim.prompts import SessionPrompt
from loadtest.fleetsim.run import FleetRun, SimConfig
from loadtest.fleetsim.sync import finished
from loadtest.simulator.profile import load_profile
from prefix_index.base import ReplicaId
from replicas.kv_events import BlockStored, EventBatch, PublisherEndpoint
from replicas.kv_subscriber import APPLY_SLICE_HASHES
from tests.fleetsim.support import write_claude_traces, write_mooncake_trace


@pytest.mark.parametrize(("block_size", "page_size"), [(16, 16), (64, 16), (16, 64)])
def test_session_pages_equal_sglang_page_hashes(block_size: int, page_size: int) -> None:
    rng = random.Random(block_size * 7 + page_size)
    prompt = SessionPrompt("ns", "s1", block_size, 10_000, want_text=False)
    pages = SglangPages(page_size)
    ids: list[int] = []
    for turn in range(12):
        shared = rng.randint(0, len(ids)) if turn % 4 == 3 else len(ids)  # sometimes a rewind
        new = tuple(rng.randrange(1, 50) + 100 * turn for _ in range(rng.randint(1, 6)))
        prompt.advance(shared, new)
        pages.truncate(shared * block_size)
        ids = [*ids[:shared], *new]
        in_tokens = len(ids) * block_size + rng.randint(-block_size, block_size)
        tokens = prompt.prompt_ids(max(in_tokens, 1), turn)
        assert pages.hashes(tokens, prompt.tokens) == page_hashes(tokens.tolist(), page_size)


def _run(workload: Any, mode: str, kv_scale: float = 0.25) -> FleetRun:
    prof = load_profile("tiny")
    prof = prof.replace(device_tokens=int(prof.device_tokens * kv_scale), host_tokens=int(prof.host_tokens * kv_scale))
    run = FleetRun(workload, "cache-aware", SimConfig(profile=prof, replicas=2, gpus_per_replica=1, seed=3,
                                                      index_mode=mode))
    run.run()
    return run


def _workload(folder: Path) -> Any:
    return traces.load([folder])


def test_precise_index_is_the_engines_cache(tmp_path: Path) -> None:
    """After a run, the event-fed index holds exactly each engine's pages per tier."""
    run = _run(_workload(write_claude_traces(tmp_path / "cc", sessions=6, turns=8)), "precise")
    assert run.precise is not None and run.precise.batches > 0
    for i, engine in enumerate(run.engines):
        device, host = run.precise.index.blocks(ReplicaId(f"sim-{i}"))
        page = engine.profile.page_size
        c = engine.cache
        assert (device, host) == ((c.pinned_tokens + c.evictable_tokens) // page, c.host_used_tokens // page)
    assert not run.precise.index.uncertain


def test_precise_predicts_what_the_engine_reports(tmp_path: Path) -> None:
    """Eviction-heavy pools (x0.25): precise predictions are the engines' cached tokens
    (within a page, nearly always) and far better than approximate ones; routing
    with them is not worse."""
    workload = _workload(write_claude_traces(tmp_path / "cc", sessions=12, turns=10))
    approx, precise = _run(workload, "approximate"), _run(workload, "precise")
    share = [float(np.mean([abs(r.predicted_cached - r.cached) <= 16 for r in run.records if not r.rejected]))
             for run in (approx, precise)]
    assert share[1] >= 0.9 and share[1] > share[0]
    hit = [sum(r.cached for r in run.records) / sum(r.prompt_tokens for r in run.records) for run in (approx, precise)]
    assert hit[1] >= hit[0] - 0.02


def test_cli_index_modes(tmp_path: Path) -> None:
    trace = write_mooncake_trace(tmp_path / "mc.jsonl", rows=30)
    out = tmp_path / "out.json"
    rc = main(["simulate", "--trace", str(trace), "--replicas", "2", "--profile", "tiny", "--policy",
               "cache-aware", "--index", "approximate,precise", "--json", str(out), "--quiet",
               "--context-length", "4096"])
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    rows = doc["results"]
    assert [r["policy"] for r in rows] == ["cache-aware", "cache-aware (precise)"]
    assert [r["index"] for r in rows] == ["approximate", "precise"]
    assert rows[1]["requests"] == rows[0]["requests"] == 30
    assert rows[1]["prediction_within_page"] >= rows[0]["prediction_within_page"]
    assert rows[1]["cache_hit_rate"] >= rows[0]["cache_hit_rate"] - 0.02
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trace), "--profile", "tiny", "--index", "exact"])



def test_a_batch_larger_than_the_gateways_apply_slice_applies_whole() -> None:
    """The gateway applies a batch in slices, yielding to its loop between them; the
    simulation has no loop, so its sink applies any batch at once (it raised WouldWait on
    the first batch over the slice: every precise simulation of long sessions)."""
    idx = PreciseFleetIndex(page_size=4)
    endpoint = PublisherEndpoint(replica="http://a", dp_rank=0, endpoint="inproc://a", bind=False, topic=b"",
                                 block_size=4)
    hashes = tuple(range(1, 3 * APPLY_SLICE_HASHES))
    finished(idx.sink.apply(endpoint, EventBatch(0, 0.0, 0, (BlockStored(hashes, None, (), 4),))))
    assert idx.matches(list(hashes), [ReplicaId("http://a")])[ReplicaId("http://a")].device_blocks == 4 * len(hashes)  # in tokens
