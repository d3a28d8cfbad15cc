"""Trace loaders: Claude Code sessions, Mooncake JSONL, Qwen Bailian JSONL -> `Workload`.

Formats (see ../shared/traces/README.md):

- ``claude-code``: one JSON document per session (``.json`` or ``.json.gz``) with
  ``block_size`` (64), ``tool_tokens``, ``system_tokens`` and ``requests``; entries of type
  ``"subagent"`` hold a nested sub-conversation in the parent's hash id namespace. Hash
  ids are local to a file, so the namespace is the file name. Closed loop.
  A subagent is attached to the parent turn before it and starts
  ``(t - duration_ms/1000) - (t_prev + api_time_prev)`` seconds after that turn's response
  (its ``t`` is when it ended). Sessions send ``x-claude-code-session-id``; subagents add
  ``x-claude-code-agent-id`` and ``x-claude-code-parent-agent-id`` (the parent session).
- ``mooncake``: JSONL (plain or ``.gz``), ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (512-token blocks, global to the file). Open loop; one
  single-turn session per line.
- ``bailian``: JSONL with ``chat_id``, ``parent_chat_id`` (-1 at a root), ``timestamp``
  (s), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids`` (16-token
  blocks). Sessions are chat_id chains (a child joins its parent's root); open loop.
  Sessions send ``x-session-id``.

A PATH is a file or a folder (every ``*.json[l][.gz]`` in it, sorted by name).
"""
from __future__ import annotations

import gzip
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.workload import Session, Turn, Workload, delta_encode

FORMATS = ("claude-code", "mooncake", "bailian", "synthetic")
_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
_UUID_NS = uuid.UUID("5b1f0a52-6c8e-4d8f-9a59-6b7667617465")


class TraceError(ValueError):
    """A trace file that cannot be read as the requested format."""


def trace_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
    if not p.exists():
        raise TraceError(f"no such trace: {p}")
    return [p]


def read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def detect_format(path: Path) -> str:
    """claude-code for JSON documents; bailian or mooncake for JSONL (by the first line)."""
    if path.name.endswith((".json", ".json.gz")):
        return "claude-code"
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        first: bytes = f.readline()
    try:
        row = orjson.loads(first)
    except orjson.JSONDecodeError as e:
        raise TraceError(f"{path}: first line is not JSON: {e}") from e
    return "bailian" if isinstance(row, dict) and "chat_id" in row else "mooncake"


def load(paths: Sequence[str | Path], fmt: str | None = None,
         limit_sessions: int | None = None) -> Workload:
    """Load one or more trace paths (files or folders) into one workload."""
    files = [f for p in paths for f in trace_files(p)]
    if not files:
        raise TraceError(f"no trace files in {list(map(str, paths))}")
    fmt = fmt or detect_format(files[0])
    if fmt == "claude-code":
        return load_claude_code(files, limit_sessions)
    if fmt == "mooncake":
        sessions = [s for f in files for s in _mooncake_sessions(f)]
        return Workload("mooncake", tuple(sessions), open_loop=True).limited(limit_sessions)
    if fmt == "bailian":
        sessions = [s for f in files for s in _bailian_sessions(f)]
        sessions.sort(key=lambda s: s.turns[0].arrival_s)
        return Workload("bailian", tuple(sessions), open_loop=True).limited(limit_sessions)
    raise TraceError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS[:3])})")


# ---- Claude Code -------------------------------------------------------------------

def session_uuid(*parts: str) -> str:
    """A stable UUID for a session or agent (uuid5: same input, same id, any process)."""
    return str(uuid.uuid5(_UUID_NS, "/".join(parts)))


def load_claude_code(files: Iterable[Path], limit_sessions: int | None = None) -> Workload:
    sessions: list[Session] = []
    for f in files:
        if limit_sessions is not None and len(sessions) >= limit_sessions:
            break
        try:
            doc = orjson.loads(read_bytes(f))
        except (orjson.JSONDecodeError, OSError, EOFError) as e:
            raise TraceError(f"{f}: {e}") from e
        ns = _stem(f)
        sid = session_uuid("claude-code", ns)
        sessions.append(_claude_session(doc, ns, sid, int(doc.get("block_size", 64)),
                                        {"x-claude-code-session-id": sid}, None, 0.0))
    return Workload("claude-code", tuple(sessions))


def _claude_session(doc: dict[str, Any], ns: str, sid: str, block_size: int,
                    headers: dict[str, str], parent: str | None, delay_s: float) -> Session:
    root_sid = headers["x-claude-code-session-id"]
    turns: list[Turn] = []
    subs: list[list[Session]] = []
    early: list[Session] = []  # subagents listed before the first turn
    prev_ids: list[int] = []
    prev_end_s = 0.0
    for req in doc.get("requests", ()):
        if req.get("type") == "subagent":
            agent = session_uuid("claude-code", ns, str(req.get("agent_id", len(subs))))
            start_s = float(req.get("t", 0.0)) - float(req.get("duration_ms", 0.0)) / 1000.0
            sub_headers = {"x-claude-code-session-id": root_sid, "x-claude-code-agent-id": agent,
                           "x-claude-code-parent-agent-id": sid}
            sub = _claude_session(req, ns, agent, block_size, sub_headers, sid,
                                  max(0.0, start_s - prev_end_s))
            (subs[-1] if subs else early).append(sub)
            continue
        ids = req.get("hash_ids") or []
        shared, new = delta_encode(prev_ids, ids)
        prev_ids = ids
        t_s = float(req.get("t", 0.0))
        prev_end_s = t_s + float(req.get("api_time") or 0.0)
        turns.append(Turn(float(req.get("think_time") or 0.0), int(req.get("in", 0)),
                          max(1, int(req.get("out", 1))), shared, new, t_s,
                          kind=str(req.get("type", "n"))))
        subs.append([])
    if subs:
        subs[0][:0] = early
    turns = [_with_subagents(t, s) for t, s in zip(turns, subs)]
    system_blocks = (int(doc.get("tool_tokens", 0)) + int(doc.get("system_tokens", 0))) // block_size
    return Session(sid, ns, block_size, tuple(turns), system_blocks, headers, parent, delay_s)


def _with_subagents(turn: Turn, subs: list[Session]) -> Turn:
    if not subs:
        return turn
    return Turn(turn.think_time_s, turn.in_tokens, turn.out_tokens, turn.shared_blocks,
                turn.new_hash_ids, turn.arrival_s, tuple(subs), turn.kind)


# ---- JSONL formats ------------------------------------------------------------------

def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    for lineno, line in enumerate(read_bytes(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise TraceError(f"{path}:{lineno}: {e}") from e
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{lineno}: not a JSON object")
        yield row


def _mooncake_sessions(path: Path, block_size: int = 512) -> Iterator[Session]:
    ns = _stem(path)
    for i, row in enumerate(_jsonl_rows(path)):
        ids = tuple(int(h) for h in row.get("hash_ids") or ())
        turn = Turn(0.0, int(row["input_length"]), max(1, int(row["output_length"])), 0, ids,
                    float(row.get("timestamp", 0)) / 1000.0)
        yield Session(f"{ns}-{i}", ns, block_size, (turn,))


def _bailian_sessions(path: Path, block_size: int = 16) -> Iterator[Session]:
    ns = _stem(path)
    root_of: dict[int, int] = {}
    chains: dict[int, list[dict[str, Any]]] = {}
    for row in _jsonl_rows(path):
        chat, parent = int(row["chat_id"]), int(row.get("parent_chat_id", -1))
        root = root_of.get(parent, chat) if parent != -1 else chat
        root_of[chat] = root
        chains.setdefault(root, []).append(row)
    for root, rows in chains.items():
        rows.sort(key=lambda r: (float(r.get("timestamp", 0.0)), int(r.get("turn", 0))))
        sid = f"{ns}-{root}"
        turns: list[Turn] = []
        prev_ids: list[int] = []
        prev_t = float(rows[0].get("timestamp", 0.0))
        for row in rows:
            ids = [int(h) for h in row.get("hash_ids") or ()]
            shared, new = delta_encode(prev_ids, ids)
            prev_ids = ids
            t_s = float(row.get("timestamp", 0.0))
            turns.append(Turn(max(0.0, t_s - prev_t), int(row["input_length"]),
                              max(1, int(row["output_length"])), shared, new, t_s,
                              kind=str(row.get("type", ""))))
            prev_t = t_s
        yield Session(sid, ns, block_size, tuple(turns), headers={"x-session-id": sid})
