"""`kvgate bench peers --overhead` (loadtest.peers.overhead): cases, rows, table, JSON, and
one tiny end-to-end run against a simulated replica and kvgate only."""
from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import orjson
from rich.console import Console

from loadtest.bench_gateway import Samples
from loadtest.peers.overhead import (
    QS,
    Options,
    add_overhead_arguments,
    case_rows,
    cases,
    main,
    max_rate_table,
    measured_rows,
    overhead_table,
)
from loadtest.peers.python_floor import Replicas
from loadtest.simulator.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _samples(n: int) -> Samples:
    direct = [0.001 + 0.00001 * (i % 7) for i in range(n)]
    via = [d + 0.0005 for d in direct]
    return Samples(direct, direct, via, [v + 0.0001 for v in via], cpu_s=0.002 * n)


def test_options_from_bench_peers_flags_and_own_flags() -> None:
    peers = Options.from_args(argparse.Namespace(small=300, large=100, kb=400))
    assert (peers.small, peers.large, peers.kbs, peers.concurrency) == (300, 100, (100, 400), (1, 32))
    parser = argparse.ArgumentParser()
    add_overhead_arguments(parser)
    own = Options.from_args(parser.parse_args(["--concurrency", "1,32", "--max-rate"]))
    assert own.small >= 2000 and own.large >= 2000 and own.max_rate and own.resamples == 1000
    found = [(c.body, c.stream, c.concurrency) for c, _ in cases(own)]
    assert len(found) == 12 and ("400KB", True, 32) in found and ("small", False, 1) in found
    assert all(c.kb > 390 for c, _ in cases(own) if c.body == "400KB")


def test_stream_tokens_sets_the_streamed_cases_length() -> None:
    parser = argparse.ArgumentParser()
    add_overhead_arguments(parser)
    opts = Options.from_args(parser.parse_args(["--concurrency", "1", "--kbs", "100", "--stream-tokens", "200"]))
    lengths = {(c.stream, orjson.loads(b)["max_tokens"]) for c, b in cases(opts)}
    assert lengths == {(False, 1), (True, 200)}
    assert Options().stream_tokens == 8


def test_a_paced_replica_run_records_its_time_scale(tmp_path: Path) -> None:
    """``--replica-time-scale 5``: the replica paces its tokens (the per-chunk relay cost as on
    a fleet); the default keeps compute ~0."""
    assert Options().replica_time_scale == 1e6
    out = tmp_path / "paced.json"
    code = main(["--targets", "kvgate", "--small", "0", "--large", "3", "--kbs", "100", "--concurrency", "1",
                 "--stream-tokens", "40", "--replica-time-scale", "5", "--resamples", "20", "--json", str(out)])
    doc = orjson.loads(out.read_bytes())
    assert code == 0 and doc["options"]["replica_time_scale"] == 5.0
    streamed = [r for r in doc["overhead"] if r["stream"] and r["metric"] == "end"]
    assert len(streamed) == 1 and streamed[0]["n"] == 3 and "error" not in streamed[0]


def test_rows_state_counts_and_flag_p999() -> None:
    opts = Options(resamples=50)
    case = next(c for c, _ in cases(opts) if c.stream)
    rows = case_rows({"target": "kvgate", "version": "kvgate cache-aware"}, case, _samples(2000), opts)
    assert [r["metric"] for r in rows] == ["first byte", "end"]
    for r in rows:
        assert r["n"] == 2000 and r["cpu_ms_per_request"] == 2.0
        assert set(r["added_ms"]) == {f"p{q:g}" for q in QS}
        p50, p999 = r["added_ms"]["p50"], r["added_ms"]["p99.9"]
        assert p50["n"] == 2000 and p50["supported"] and not p999["supported"]
        assert p50["lo"] <= p50["value"] <= p50["hi"]
    assert abs(rows[0]["added_ms"]["p50"]["value"] - 0.5) < 1e-9
    assert abs(rows[1]["added_ms"]["p50"]["value"] - 0.6) < 1e-9
    console = Console(record=True, width=250)
    console.print(overhead_table([*rows, {"target": "smg", "version": "smg 1.13.0", "error": "boom"}]))
    text = console.export_text()
    assert "+0.50 [+0.50,+0.50]" in text and "failed: boom" in text and "* unsupported" in text
    assert "*+0.50 [+0.50,+0.50]" in text  # p99.9 of 2,000 samples, flagged
    rate = {"target": "kvgate", "version": "kvgate cache-aware", "kb": 400, "p99_limit_ms": 10.0,
            "sustained_rate": 30.0, "steps": [{"rate": 45.0, "n": 900, "error": "HTTP 503"}]}
    console.print(max_rate_table([rate]))
    text = console.export_text()
    assert "30.0/s" in text and "HTTP 503" in text
    orjson.dumps(rows)  # JSON-ready


def test_tiny_run_two_kvgates_interleaved(tmp_path: Path) -> None:
    """Two real gateway processes measured in one interleaved run: rows, counts, rates."""
    out = tmp_path / "overhead.json"
    code = main(["--targets", "kvgate,kvgate-round-robin", "--small", "12", "--large", "4", "--kbs", "100",
                 "--concurrency", "1,4", "--resamples", "50", "--max-rate", "--max-rate-start", "20",
                 "--max-rate-s", "0.5", "--max-rate-n", "10", "--max-rate-steps", "2", "--json", str(out)])
    doc = orjson.loads(out.read_bytes())
    rows = doc["overhead"]
    assert code == 0 and all("error" not in r for r in rows)
    for target in ("kvgate", "kvgate-round-robin"):
        mine = [r for r in rows if r["target"] == target]
        seen = {(r["body"], r["stream"], r["concurrency"], r["metric"]) for r in mine}
        assert len(mine) == 12 and ("100KB", True, 4, "first byte") in seen
    for r in rows:
        assert r["n"] >= (12 if r["body"] == "small" else 4) and r["cpu_ms_per_request"] >= 0
        assert not r["added_ms"]["p99"]["supported"]
    assert [rate["target"] for rate in doc["max_rate"]] == ["kvgate", "kvgate-round-robin"]
    for rate in doc["max_rate"]:
        assert 1 <= len(rate["steps"]) <= 2 and "n" in rate["steps"][0]
    assert doc["options"]["concurrency"] == [1, 4]


def test_a_size_with_no_samples_is_not_measured() -> None:
    parser = argparse.ArgumentParser()
    add_overhead_arguments(parser)
    opts = Options.from_args(parser.parse_args(["--concurrency", "1", "--large", "0"]))
    assert [(c.body, c.stream) for c, _ in cases(opts)] == [("small", False), ("small", True)]
    opts = Options.from_args(parser.parse_args(["--concurrency", "1", "--small", "0", "--kbs", "400"]))
    assert [(c.body, c.stream) for c, _ in cases(opts)] == [("400KB", False), ("400KB", True)]


def test_tiny_run_of_kvgate_from_another_checkout_beside_this_one(tmp_path: Path) -> None:
    """``kvgate@<checkout>``: a second kvgate process started from that checkout (this very
    one here) and measured beside ``kvgate`` in the same interleaved run."""
    out = tmp_path / "overhead.json"
    other = f"kvgate@{ROOT}"
    code = main(["--targets", f"kvgate,{other}", "--small", "6", "--large", "0", "--concurrency", "1",
                 "--resamples", "20", "--json", str(out)])
    rows = orjson.loads(out.read_bytes())["overhead"]
    assert code == 0 and all("error" not in r for r in rows)
    assert {r["target"] for r in rows} == {"kvgate", other}
    assert {r["version"] for r in rows if r["target"] == other} == {f"kvgate cache-aware from {ROOT}"}
    assert {r["body"] for r in rows} == {"small"}


def test_tiny_run_sequential(tmp_path: Path) -> None:
    """``--sequential``: each target measured alone, one after the other (two real gateways)."""
    out = tmp_path / "overhead.json"
    code = main(["--targets", "kvgate,kvgate-round-robin", "--sequential", "--small", "6", "--large", "2",
                 "--kbs", "100", "--concurrency", "1", "--resamples", "20", "--json", str(out)])
    doc = orjson.loads(out.read_bytes())
    rows = doc["overhead"]
    assert code == 0 and doc["options"]["sequential"] is True and doc["max_rate"] == []
    assert [r["target"] for r in rows] == ["kvgate"] * 6 + ["kvgate-round-robin"] * 6


def test_tiny_run_beside_the_python_floors(tmp_path: Path) -> None:
    """The pass-through proxies (``python-floor`` on uvicorn, ``python-floor-granian`` and
    ``python-floor-rsgi`` on Granian's two interfaces) measured beside kvgate."""
    out = tmp_path / "overhead.json"
    targets = ["python-floor", "python-floor-granian", "python-floor-rsgi"]
    code = main(["--targets", ",".join(["kvgate", *targets]), "--small", "6", "--large", "2",
                 "--kbs", "100", "--concurrency", "1", "--resamples", "20", "--json", str(out)])
    rows = orjson.loads(out.read_bytes())["overhead"]
    assert code == 0
    for target in targets:
        floor = [r for r in rows if r["target"] == target]
        assert len(floor) == 6 and all("error" not in r and r["n"] >= 2 for r in floor), target
    assert next(r for r in rows if r["target"] == "python-floor")["version"] == "pass-through (uvicorn+aiohttp)"


def test_the_floors_keep_a_session_on_one_replica_and_spread_the_rest() -> None:
    replicas = Replicas(["a", "b", "c"])
    picks = {replicas.pick(b"session-%d" % i) for i in range(30)}
    assert picks == {"a", "b", "c"}  # sessions spread over the fleet
    assert {replicas.pick(b"session-7") for _ in range(5)} == {replicas.pick(b"session-7")}
    assert [replicas.pick(b"") for _ in range(4)] == ["a", "b", "c", "a"]  # no session: in turn


def test_a_failing_target_named_twice_gets_two_error_rows() -> None:
    """Rows follow the opened targets, not their names: two targets of one name that fail
    (nothing listens on their port) give one error row each."""
    dead = f"http://127.0.0.1:{free_port()}"
    opts = Options(small=2, large=1, kbs=(), concurrency=(1,))
    rows, rates = asyncio.run(measured_rows([("kvgate", dead, os.getpid()), ("kvgate", dead, os.getpid())],
                                            dead, opts, Console(record=True)))
    assert [r["target"] for r in rows] == ["kvgate", "kvgate"] and all("error" in r for r in rows)
    assert rates == []
