"""Trace loaders: the real shared traces (a few files) and small files written here."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loadtest import traces
from loadtest.workload import Session, common_prefix_len

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"  # ../shared beside the project
CC = SHARED / "claude-code"
needs_shared = pytest.mark.skipif(not CC.is_dir(), reason="shared traces not on this machine")


def _full_ids(session: Session) -> list[list[int]]:
    return [list(ids) for ids in session.hash_id_lists()]


@needs_shared
def test_real_claude_code_file_with_subagents() -> None:
    w = traces.load([CC / "trace_0010.json.gz"])
    assert w.name == "claude-code" and not w.open_loop
    (s,) = w.sessions
    assert s.block_size == 64 and s.namespace == "trace_0010"
    assert s.headers == {"x-claude-code-session-id": s.id}
    raw = json.loads(gzip.decompress((CC / "trace_0010.json.gz").read_bytes()))
    main = [r for r in raw["requests"] if r["type"] != "subagent"]
    assert len(s.turns) == len(main)
    assert [len(ids) for ids in _full_ids(s)] == [len(r["hash_ids"]) for r in main]
    assert _full_ids(s)[13] == main[13]["hash_ids"]
    subs = [sub for t in s.turns for sub in t.subagents]
    assert len(subs) == 4
    assert all(sub.parent == s.id and sub.namespace == s.namespace for sub in subs)
    assert subs[0].headers["x-claude-code-parent-agent-id"] == s.id
    assert subs[0].headers["x-claude-code-session-id"] == s.id
    assert subs[0].headers["x-claude-code-agent-id"] != s.id
    assert 0 <= subs[0].start_delay_s < 5  # started right after turn 0's response
    assert s.turns[0].subagents == tuple(subs[:1])


@needs_shared
def test_real_claude_code_folder_limit_and_stable_ids() -> None:
    a = traces.load([CC], limit_sessions=3)
    b = traces.load([CC], limit_sessions=3)
    assert len(a.sessions) == 3
    assert [s.id for s in a.sessions] == [s.id for s in b.sessions]
    assert len({s.namespace for s in a.sessions}) == 3


@needs_shared
def test_real_mooncake_trace() -> None:
    w = traces.load([SHARED / "mooncake"])
    assert w.open_loop and len(w.sessions) == 3993
    first = w.sessions[0].turns[0]
    assert (first.in_tokens, first.out_tokens, first.arrival_s) == (40160, 6, 0.0)
    assert w.sessions[0].block_size == 512
    arrivals = [s.turns[0].arrival_s for s in w.sessions]
    assert arrivals == sorted(arrivals)


def _write_claude(path: Path, gz: bool) -> None:
    doc = {"id": "x", "block_size": 4, "tool_tokens": 4, "system_tokens": 4, "requests": [
        {"t": 0.0, "type": "n", "in": 10, "out": 3, "hash_ids": [1, 2], "think_time": 0.0, "api_time": 1.0},
        {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "duration_ms": 2000, "tool_tokens": 4,
         "system_tokens": 0, "requests": [
             {"t": 0.0, "type": "n", "in": 9, "out": 2, "hash_ids": [50, 51], "think_time": 0.0}]},
        {"t": 9.0, "type": "s", "in": 14, "out": 4, "hash_ids": [1, 2, 3], "think_time": 2.5},
        {"t": 20.0, "type": "n", "in": 12, "out": 5, "hash_ids": [1, 7, 8], "think_time": 3.0},
    ]}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
def test_small_claude_code_file(tmp_path: Path, gz: bool) -> None:
    path = tmp_path / ("s.json.gz" if gz else "s.json")
    _write_claude(path, gz)
    (s,) = traces.load([path]).sessions
    assert s.namespace == "s" and s.system_blocks == 2
    assert _full_ids(s) == [[1, 2], [1, 2, 3], [1, 7, 8]]
    assert [t.shared_blocks for t in s.turns] == [0, 2, 1]
    assert [t.think_time_s for t in s.turns] == [0.0, 2.5, 3.0]
    assert [t.kind for t in s.turns] == ["n", "s", "n"]
    (sub,) = s.turns[0].subagents
    assert sub.start_delay_s == pytest.approx(2.0)  # (5 - 2) - (0 + 1)
    assert sub.system_blocks == 1 and _full_ids(sub) == [[50, 51]]
    assert s.request_count() == 4


def _bailian_rows() -> list[dict[str, object]]:
    return [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 5,
         "type": "text", "turn": 1, "hash_ids": [10, 11]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 20, "output_length": 4,
         "type": "text", "turn": 1, "hash_ids": [20]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 3.0, "input_length": 70, "output_length": 6,
         "type": "text", "turn": 2, "hash_ids": [10, 11, 12, 13]},
        {"chat_id": 4, "parent_chat_id": 3, "timestamp": 7.0, "input_length": 90, "output_length": 2,
         "type": "text", "turn": 3, "hash_ids": [10, 11, 12, 13, 14]},
    ]


def test_bailian_sessions_from_chat_chains(tmp_path: Path) -> None:
    path = tmp_path / "qwen.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in _bailian_rows()).encode()))
    assert traces.detect_format(path) == "bailian"
    w = traces.load([tmp_path])
    assert w.open_loop and [len(s.turns) for s in w.sessions] == [3, 1]
    s = w.sessions[0]
    assert s.block_size == 16 and s.headers == {"x-session-id": s.id}
    assert [t.arrival_s for t in s.turns] == [0.5, 3.0, 7.0]
    assert [t.think_time_s for t in s.turns] == [0.0, 2.5, 4.0]
    assert _full_ids(s)[-1] == [10, 11, 12, 13, 14]


def test_mooncake_plain_and_folder(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = traces.load([tmp_path / "m.jsonl"], limit_sessions=None)
    assert [s.turns[0].arrival_s for s in w.sessions] == [0.0, 1.5]
    assert common_prefix_len(w.sessions[0].turns[0].new_hash_ids, w.sessions[1].turns[0].new_hash_ids) == 1
    assert traces.load([tmp_path], "mooncake", limit_sessions=1).sessions[0].id == "m-0"


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(traces.TraceError):
        traces.load([tmp_path / "missing.json"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(traces.TraceError):
        traces.load([bad])
    (tmp_path / "empty").mkdir()
    with pytest.raises(traces.TraceError):
        traces.load([tmp_path / "empty"])


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), list(range(700)) + [-1]) == 700
