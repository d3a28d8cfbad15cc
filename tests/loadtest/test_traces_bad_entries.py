"""Trace loaders survive bad entries (issue 10, item 11): skipped or defaulted, counted,
reported by `kvgate simulate`. Every file is synthetic, written in tmp_path."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import orjson

from gateway.cli import main
from loadtest import traces


def _req(t: float, ids: list[Any] | None, **extra: Any) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": 64 * len(ids or []), "out": 10, "hash_ids": ids, "think_time": 1.0,
            "api_time": 0.5, **extra}


def _doc(requests: list[Any], **top: Any) -> dict[str, Any]:
    return {"id": "x", "block_size": 64, "tool_tokens": 64, "system_tokens": 64, "requests": requests, **top}


def write_bad_claude_folder(folder: Path) -> Path:
    """Four sessions with bad entries, one truncated file, one non-JSON file."""
    folder.mkdir(parents=True, exist_ok=True)
    sub = {"t": 5.0, "type": "subagent", "agent_id": "a1", "duration_ms": None, "tool_tokens": 64,
           "system_tokens": 0, "requests": [_req(1.0, [100, 101])]}
    docs = {
        "trace_0001": _doc([_req(0.0, [1, 2]), sub, _req(10.0, [1, 2, 3], think_time=None)]),
        "trace_0002": _doc([_req(0.0, [1]), _req(3.0, None), {"t": 4.0},
                            _req(6.0, [1, 2, 3], **{"in": "lots", "out": None, "api_time": -1})]),
        "trace_0003": _doc([_req(0.0, [7]), "not an object", _req(2.0, [7, "x"]),
                            {"type": "subagent", "t": None, "requests": None}], block_size=None),
        "trace_0004": _doc([_req(0.0, [5, 6])]),
    }
    for name, doc in docs.items():
        (folder / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    whole = gzip.compress(json.dumps(_doc([_req(0.0, [9])])).encode())
    (folder / "trace_0005.json.gz").write_bytes(whole[: len(whole) // 2])  # truncated
    (folder / "trace_0006.json").write_text("{not json")
    (folder / "trace_0007.json").write_text(json.dumps(_doc([_req(0.0, None)])))  # nothing usable
    return folder


def test_claude_code_bad_entries_are_skipped_or_defaulted_and_counted(tmp_path: Path) -> None:
    folder = write_bad_claude_folder(tmp_path / "cc")
    report = traces.LoadReport()
    w = traces.load([folder], report=report)
    by_ns = {s.namespace: s for s in w.sessions}
    assert sorted(by_ns) == ["trace_0001", "trace_0002", "trace_0003", "trace_0004"]
    one = by_ns["trace_0001"]
    assert [t.think_time_s for t in one.turns] == [1.0, 0.0]  # null think_time -> 0
    (sub,) = one.turns[0].subagents  # null duration_ms: starts when listed
    assert sub.start_delay_s == 4.5  # t 5.0 - (turn 0's t 0.0 + api_time 0.5)
    two = by_ns["trace_0002"]
    assert len(two.turns) == 2  # null and missing hash_ids skipped
    assert (two.turns[1].in_tokens, two.turns[1].out_tokens) == (3 * 64, 1)  # from hash_ids; 1 token
    assert list(two.hash_id_lists())[-1] == [1, 2, 3]
    three = by_ns["trace_0003"]
    assert three.block_size == 64 and len(three.turns) == 1
    assert report.as_dict() == {
        "defaulted: api_time": 1, "defaulted: block_size": 1, "defaulted: duration_ms": 2,
        "defaulted: in": 1, "defaulted: out": 1, "defaulted: t": 1, "defaulted: think_time": 1,
        "skipped: bad hash_ids": 1, "skipped: no hash_ids": 3, "skipped: not an object": 1,
        "skipped: session without requests": 1, "skipped: subagent without requests": 1,
        "skipped: truncated file": 1, "skipped: unreadable file": 2,
    }
    assert "skipped: no hash_ids 3" in report.summary()


def test_jsonl_bad_lines_and_a_truncated_gz(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": None, "input_length": "?", "output_length": None, "hash_ids": [1, 3]},
            {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": None}, [1, 2]]
    lines = [json.dumps(r).encode() for r in rows] + [b"{broken"]
    whole = gzip.compress(b"\n".join(lines + [json.dumps(rows[0]).encode()] * 50))
    path = tmp_path / "m.jsonl.gz"
    path.write_bytes(whole[: len(whole) - 20])  # cut inside the last rows
    report = traces.LoadReport()
    w = traces.load([path], "mooncake", report=report)
    assert w.sessions[1].turns[0].in_tokens == 2 * 512 and w.sessions[1].turns[0].out_tokens == 1
    assert w.sessions[1].turns[0].arrival_s == 0.0  # the previous row's timestamp
    counts = report.as_dict()
    assert counts["skipped: truncated file"] == 1 and counts["skipped: no hash_ids"] == 1
    assert counts["skipped: not JSON"] >= 1 and counts["skipped: not an object"] == 1
    assert counts["defaulted: timestamp"] == 1 and counts["defaulted: input_length"] == 1


def test_bailian_bad_rows(tmp_path: Path) -> None:
    rows = [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 32, "output_length": 2,
             "type": "text", "turn": 1, "hash_ids": [1, 2]},
            {"chat_id": 2, "parent_chat_id": 1, "timestamp": None, "input_length": 48, "output_length": 2,
             "turn": 2, "hash_ids": [1, 2, 3]},
            {"chat_id": None, "timestamp": 3.0, "hash_ids": [9]},
            {"chat_id": 4, "parent_chat_id": None, "timestamp": 4.0, "hash_ids": None}]
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = traces.LoadReport()
    w = traces.load([path], report=report)
    (s,) = w.sessions
    assert [t.arrival_s for t in s.turns] == [1.0, 1.0]
    assert report.as_dict() == {"defaulted: parent_chat_id": 1, "defaulted: timestamp": 1,
                                "skipped: no chat_id": 1, "skipped: no hash_ids": 1,
                                "skipped: session without requests": 1}


def test_simulate_over_a_bad_folder_completes_and_reports_the_counts(tmp_path: Path, capsys: Any) -> None:
    folder = write_bad_claude_folder(tmp_path / "cc")
    out = tmp_path / "out.json"
    rc = main(["simulate", "--trace", str(folder), "--replicas", "2", "--profile", "tiny",
               "--policy", "cache-aware", "--json", str(out)])
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["config"]["sessions"] == 4
    assert doc["config"]["trace_entries"]["skipped: no hash_ids"] == 3
    assert doc["config"]["trace_entries"]["defaulted: duration_ms"] == 2
    assert doc["results"][0]["requests"] == 7  # 1+1 (and its subagent's 1) + 2 + 1 + 1
    captured = capsys.readouterr()
    err, out_text = " ".join(captured.err.split()), " ".join(captured.out.split())  # rich wraps lines
    assert "skipped: no hash_ids 3" in err and "skipped: no hash_ids 3" in out_text
