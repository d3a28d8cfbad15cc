"""Engine timing model in virtual time: prefill, decode, speculation, cache, determinism."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pytest

from loadtest.simulator.engine import ReplicaEngine, RequestResult, SimRequest
from loadtest.simulator.profile import Profile, load_profile


class Recorder:
    def __init__(self) -> None:
        self.tokens: dict[str, list[tuple[int, float]]] = {}
        self.results: dict[str, RequestResult] = {}

    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None:
        self.tokens.setdefault(rid, []).append((len(token_ids), now_s))

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        assert result.finish_s == now_s
        self.results[result.rid] = result


def _ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 163_840, n).astype(np.uint32)


def _drain(engine: ReplicaEngine) -> None:
    for _ in range(1_000_000):
        nxt = engine.next_event_s()
        if nxt is None:
            return
        engine.advance(nxt)
    raise AssertionError("engine did not go idle")


@pytest.fixture(scope="module")
def kimi() -> Profile:
    return load_profile("kimi-k2.6-b200-tp8")


def test_cold_100k_prompt_prefills_in_about_2_5_s(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    engine.submit(SimRequest("a", _ids(0, 100_000), 8, ignore_eos=True), rec, 10.0)
    _drain(engine)
    result = rec.results["a"]
    assert result.first_token_s is not None
    assert result.first_token_s - 10.0 == pytest.approx(100_000 / 40_000, rel=0.01)
    assert result.cached_tokens == 0 and result.completion_tokens == 8
    stats = engine.snapshot()
    assert stats.total_prefill_uncached_tokens == 100_000
    assert stats.total_prefill_busy_s == pytest.approx(2.5, rel=0.01)


def test_shared_50k_prefix_is_reported_cached(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    prefix = _ids(1, 50_000)
    engine.submit(SimRequest("a", np.concatenate([prefix, _ids(2, 3000)]), 16), rec, 0.0)
    _drain(engine)
    engine.submit(SimRequest("b", np.concatenate([prefix, _ids(3, 3000)]), 16), rec, 100.0)
    _drain(engine)
    b = rec.results["b"]
    assert b.cached_tokens >= 0.95 * 50_000 and b.cached_device == b.cached_tokens
    assert b.first_token_s is not None
    assert b.first_token_s - 100.0 < 0.2  # only ~3k uncached tokens
    assert engine.snapshot().cached_tokens_total_device == b.cached_tokens


def test_host_hit_after_device_pressure() -> None:
    tiny = load_profile("tiny")
    engine, rec = ReplicaEngine(tiny), Recorder()
    first = _ids(10, 2000)
    engine.submit(SimRequest("a", first, 4, ignore_eos=True), rec, 0.0)
    _drain(engine)
    for i in range(3):  # fill the 4096-token device pool with other prompts
        engine.submit(SimRequest(f"x{i}", _ids(20 + i, 2000), 4, ignore_eos=True), rec, 10.0 + i)
        _drain(engine)
    engine.submit(SimRequest("again", first, 4, ignore_eos=True), rec, 50.0)
    _drain(engine)
    again = rec.results["again"]
    assert again.cached_host >= 1024 and again.cached_tokens >= 1984
    stats = engine.snapshot()
    assert stats.evicted_tokens_total > 0 and stats.load_back_tokens_total >= again.cached_host
    assert stats.cached_tokens_total_host == again.cached_host


def test_decode_slows_as_the_batch_grows(kimi: Profile) -> None:
    def step_time(n: int) -> float:
        engine, rec = ReplicaEngine(kimi), Recorder()
        for i in range(n):
            engine.submit(
                SimRequest(f"r{i}", _ids(100 + i, 100_000), 2000, ignore_eos=True), rec, 0.0
            )
        _drain(engine)
        all_decoding = rec.tokens[f"r{n - 1}"][0][1]  # the last prefill is over
        times = [t for _, t in rec.tokens["r0"] if t > all_decoding]
        return float(np.median(np.diff(times[:20])))

    one, eight = step_time(1), step_time(8)
    assert one == pytest.approx(0.015 + 0.0005 * 1.0, rel=0.05)
    assert eight == pytest.approx(0.015 + 0.0005 * 8.0, rel=0.05)


def test_speculative_accept_length_shows_in_tokens_per_step(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    engine.submit(SimRequest("a", _ids(5, 1000), 1001, ignore_eos=True), rec, 0.0)
    _drain(engine)
    result = rec.results["a"]
    assert result.completion_tokens == 1001
    assert result.spec_accept_length == pytest.approx(5.0, abs=0.05)
    sizes = [n for n, _ in rec.tokens["a"][1:-1]]
    assert set(sizes) == {5}
    assert engine.snapshot().spec_accept_length == pytest.approx(5.0, abs=0.05)


def test_fractional_accept_length_averages_out() -> None:
    tiny = load_profile("tiny")  # accept length 2.5
    engine, rec = ReplicaEngine(tiny), Recorder()
    engine.submit(SimRequest("a", _ids(6, 100), 1001, ignore_eos=True), rec, 0.0)
    _drain(engine)
    sizes = {n for n, _ in rec.tokens["a"][1:-1]}
    assert sizes == {2, 3}
    assert rec.results["a"].spec_accept_length == pytest.approx(2.5, abs=0.05)


def test_ignore_eos_gives_exactly_max_new_tokens_and_natural_length_stops(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    engine.submit(SimRequest("fixed", _ids(7, 500), 777, ignore_eos=True), rec, 0.0)
    for i in range(20):
        engine.submit(SimRequest(f"n{i}", _ids(8 + i, 500), 100_000, seed=i), rec, 0.0)
    _drain(engine)
    fixed = rec.results["fixed"]
    assert fixed.completion_tokens == 777 and len(fixed.output_ids) == 777
    assert fixed.finish_reason == "length"
    natural = [rec.results[f"n{i}"] for i in range(20)]
    assert all(r.finish_reason == "stop" for r in natural)
    assert len({r.completion_tokens for r in natural}) > 10
    streamed = sum(n for n, _ in rec.tokens["fixed"])
    assert streamed == 777


def test_outputs_are_deterministic_for_a_seed(kimi: Profile) -> None:
    def run(seed: int) -> RequestResult:
        engine, rec = ReplicaEngine(kimi), Recorder()
        engine.submit(SimRequest("a", _ids(9, 2000), 300, seed=seed), rec, 0.0)
        _drain(engine)
        return rec.results["a"]

    a, b, c = run(1), run(1), run(2)
    assert a.output_ids == b.output_ids and a.finish_s == b.finish_s
    assert a.output_ids != c.output_ids


def test_results_do_not_depend_on_how_often_advance_is_called(kimi: Profile) -> None:
    def run(step_by_step: bool) -> list[tuple[str, int, float]]:
        engine, rec = ReplicaEngine(kimi), Recorder()
        arrivals = [(i * 0.7, f"r{i}", _ids(200 + i % 3, 20_000 + 1000 * i)) for i in range(12)]
        for at, rid, ids in arrivals:
            if step_by_step:
                while (nxt := engine.next_event_s()) is not None and nxt <= at:
                    engine.advance(nxt)
            engine.submit(SimRequest(rid, ids, 120, ignore_eos=True), rec, at)
        _drain(engine)
        return sorted((r.rid, r.cached_tokens, r.finish_s) for r in rec.results.values())

    assert run(True) == run(False)


def test_waiting_queue_and_max_running(kimi: Profile) -> None:
    profile = kimi.replace(max_running_requests=2)
    engine, rec = ReplicaEngine(profile), Recorder()
    for i in range(5):
        engine.submit(SimRequest(f"r{i}", _ids(300 + i, 1000), 50, ignore_eos=True), rec, 0.0)
    engine.advance(0.03)  # the first chunk (r0 alone) is over; the next batch is admitted
    stats = engine.snapshot()
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 3
    assert stats.num_waiting_uncached_tokens >= 3000 and stats.num_total_tokens > 5000
    assert not engine.flush_cache()
    _drain(engine)
    admits = sorted(rec.results[f"r{i}"].admit_s or 0.0 for i in range(5))
    assert admits[2] > 0.0  # the third waited for a slot
    assert engine.snapshot().is_idle and engine.flush_cache()


def test_abort_waiting_and_running(kimi: Profile) -> None:
    profile = kimi.replace(max_running_requests=1)
    engine, rec = ReplicaEngine(profile), Recorder()
    engine.submit(SimRequest("run", _ids(400, 1000), 10_000, ignore_eos=True), rec, 0.0)
    engine.submit(SimRequest("wait", _ids(401, 1000), 10, ignore_eos=True), rec, 0.0)
    engine.abort("wait", 0.1)
    engine.abort("run", 1.0)
    _drain(engine)
    assert rec.results["wait"].finish_reason == "abort"
    run = rec.results["run"]
    assert run.finish_reason == "abort" and 0 < run.completion_tokens < 10_000
    assert run.finish_s == pytest.approx(1.0, abs=0.1)
    stats = engine.snapshot()
    assert stats.num_used_tokens == 0 and stats.num_aborted_requests_total == 2


def test_too_long_prompt_is_aborted(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi.replace(context_length=1000)), Recorder()
    engine.submit(SimRequest("long", _ids(500, 1000), 10), rec, 0.0)
    assert rec.results["long"].finish_reason == "abort" and engine.is_idle()


def test_snapshot_reports_load_and_throughput(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    for i in range(4):
        engine.submit(SimRequest(f"r{i}", _ids(600 + i, 10_000), 2000, ignore_eos=True), rec, 0.0)
    engine.advance(5.0)
    stats = engine.snapshot()
    assert stats.num_running_reqs == 4 and stats.num_used_tokens >= 40_000
    assert 0 < stats.token_usage < 1 and stats.gen_throughput > 100
    assert stats.spec_verify_calls_total > 0 and not stats.is_idle
    assert stats.decode_sum_seq_lens > 40_000


def test_listener_may_submit_from_on_finish(kimi: Profile) -> None:
    engine = ReplicaEngine(kimi)
    prompts = [_ids(700, 5000 + 500 * i) for i in range(4)]
    for i in range(1, 4):
        prompts[i][: len(prompts[i - 1])] = prompts[i - 1]

    class Chain(Recorder):
        def on_finish(self, result: RequestResult, now_s: float) -> None:
            super().on_finish(result, now_s)
            turn = int(result.rid[1:]) + 1
            if turn < 4:
                engine.submit(
                    SimRequest(f"t{turn}", prompts[turn], 20, ignore_eos=True), self, now_s
                )

    rec = Chain()
    engine.submit(SimRequest("t0", prompts[0], 20, ignore_eos=True), rec, 0.0)
    _drain(engine)
    assert [rec.results[f"t{i}"].completion_tokens for i in range(4)] == [20] * 4
    assert all(rec.results[f"t{i}"].cached_tokens >= 4992 for i in range(1, 4))
    assert engine.is_idle() and engine.snapshot().num_used_tokens == 0


def _stream_run(kimi: Profile, stream: bool | Literal["first"]) -> tuple[Recorder, ReplicaEngine]:
    """Six overlapping requests (prefill chunks and decode runs interleave), one mode."""
    engine, rec = ReplicaEngine(kimi), Recorder()
    for i in range(6):
        ids = _ids(800 + i, 3000 + 4000 * i)
        engine.submit(SimRequest(f"r{i}", ids, 300, ignore_eos=True, stream=stream), rec, 0.05 * i)
    _drain(engine)
    return rec, engine


def test_stream_first_reports_only_the_first_token(kimi: Profile) -> None:
    full, _ = _stream_run(kimi, True)
    first, first_engine = _stream_run(kimi, "first")
    silent, silent_engine = _stream_run(kimi, False)
    assert silent.tokens == {}
    for rid, result in first.results.items():
        assert first.tokens[rid] == [(1, result.first_token_s)]
        assert full.tokens[rid][0] == first.tokens[rid][0] and len(full.tokens[rid]) > 1
        assert result == full.results[rid] == silent.results[rid]
    assert first_engine.snapshot() == silent_engine.snapshot()


def test_stream_first_with_an_abort_during_prefill(kimi: Profile) -> None:
    engine, rec = ReplicaEngine(kimi), Recorder()
    engine.submit(SimRequest("a", _ids(900, 100_000), 50, stream="first"), rec, 0.0)
    engine.abort("a", 1.0)  # prefill takes ~2.5 s
    _drain(engine)
    assert "a" not in rec.tokens and rec.results["a"].first_token_s is None


def test_engine_stats_is_reexported_and_snapshot_is_consistent(kimi: Profile) -> None:
    from loadtest.simulator import engine as engine_mod
    from loadtest.simulator import stats as stats_mod

    assert engine_mod.EngineStats is stats_mod.EngineStats
    assert "EngineStats" in engine_mod.__all__
    profile = kimi.replace(max_running_requests=2)
    engine, rec = ReplicaEngine(profile), Recorder()
    for i in range(4):
        engine.submit(SimRequest(f"r{i}", _ids(950 + i, 2000), 400, ignore_eos=True), rec, 0.0)
    engine.advance(0.5)
    snap = engine.snapshot()
    assert isinstance(snap, stats_mod.EngineStats) and snap.now_s == 0.5
    assert snap.num_running_reqs == 2 and snap.num_waiting_reqs == 2
    assert snap.num_total_tokens == snap.num_used_tokens + 2 * 2000
    assert snap.max_running_requests == 2 and not snap.is_idle
    assert snap == engine.snapshot()  # a snapshot does not change the engine
