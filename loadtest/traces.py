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

Bad entries never kill a run (real traces have missing and null fields: a subagent's
``"duration_ms": null``, requests without ``think_time`` or ``api_time``). A field that is
missing, null, non-numeric, negative or not finite gets a default, and an entry that
cannot be replayed is skipped; both are counted by kind in a ``LoadReport``
(``"defaulted: think_time"``, ``"skipped: no hash_ids"``) that ``kvgate simulate``
prints. The defaults:

| field | default |
|---|---|
| ``think_time``, ``api_time`` (Claude Code) | 0 s |
| ``t`` (Claude Code), ``timestamp`` (JSONL) | the previous entry's (0 for the first) |
| subagent ``duration_ms`` | 0: it starts when it is listed (``t``) |
| ``in`` / ``input_length`` | ``len(hash_ids) * block_size`` |
| ``out`` / ``output_length`` | 1 token |
| ``type`` | ``"n"`` (Claude Code), ``""`` (Bailian); ``turn`` 0; ``parent_chat_id`` -1 (a root) |
| ``block_size`` / ``tool_tokens`` / ``system_tokens`` | 64 / 0 / 0 |

Skipped: a request whose ``hash_ids`` is missing, null or not a list of integers (its
prefix is unknown; an empty list is kept), a line that is not JSON or not an object, a
Bailian row without an integer ``chat_id``, a file that cannot be read or parsed (a
truncated ``.gz`` keeps the lines before the cut and counts ``skipped: truncated
file``), a session or subagent left without requests. A load that ends with no
session at all still raises ``TraceError``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import uuid
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import xxhash

from loadtest.workload import Session, Turn, Workload, delta_encode

FORMATS = ("claude-code", "mooncake", "bailian", "synthetic")
_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
_UUID_NS = uuid.UUID("5b1f0a52-6c8e-4d8f-9a59-6b7667617465")
log = logging.getLogger("kvgate.traces")


class TraceError(ValueError):
    """A trace file that cannot be read as the requested format."""


class LoadReport:
    """What a load skipped or defaulted, counted by kind (``"skipped: no hash_ids"``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def skipped(self, why: str) -> None:
        self.counts[f"skipped: {why}"] += 1

    def defaulted(self, name: str) -> None:
        self.counts[f"defaulted: {name}"] += 1

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def summary(self) -> str:
        """``"defaulted: think_time 47, skipped: no hash_ids 2"``, or ``"none"``."""
        return ", ".join(f"{k} {n:,}" for k, n in sorted(self.counts.items())) or "none"


def _number(row: dict[str, Any], key: str, default: float, report: LoadReport) -> float:
    """``row[key]`` as a finite number >= 0; else (missing, null, a string, negative, NaN)
    ``default``, counted as ``defaulted: <key>``."""
    v = row.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    report.defaulted(key)
    return default


def _hash_ids(row: dict[str, Any], report: LoadReport) -> list[int] | None:
    ids = row.get("hash_ids")
    if not isinstance(ids, list):
        report.skipped("no hash_ids")
        return None
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        report.skipped("bad hash_ids")
        return None
    return ids


def trace_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
    if not p.exists():
        raise TraceError(f"no such trace: {p}")
    return [p]


def _gunzip(data: bytes) -> tuple[bytes, bool]:
    """Decompress (every member of) a gzip file; (what was readable, truncated?)."""
    out: list[bytes] = []
    while data:
        d = zlib.decompressobj(wbits=31)
        try:
            out.append(d.decompress(data))
        except zlib.error:
            return b"".join(out), True
        if not d.eof:
            return b"".join(out), True
        data = d.unused_data
    return b"".join(out), False


def read_bytes(path: Path, report: LoadReport | None = None) -> bytes:
    """The file's bytes, gunzipped for ``.gz``; a truncated gzip gives what precedes the
    cut (counted in ``report``; without one it raises ``TraceError``)."""
    data = path.read_bytes()
    if not path.name.endswith(".gz"):
        return data
    data, truncated = _gunzip(data)
    if truncated:
        if report is None:
            raise TraceError(f"{path}: truncated gzip file")
        report.skipped("truncated file")
    return data


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def detect_format(path: Path) -> str:
    """claude-code for JSON documents; bailian or mooncake for JSONL (by the first object)."""
    if path.name.endswith((".json", ".json.gz")):
        return "claude-code"
    lines = read_bytes(path, LoadReport()).splitlines()
    for line in lines[:100]:
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(row, dict):
            return "bailian" if "chat_id" in row else "mooncake"
    raise TraceError(f"{path}: no JSON object in its first lines")


def load(paths: Sequence[str | Path], fmt: str | None = None,
         limit_sessions: int | None = None, report: LoadReport | None = None) -> Workload:
    """Load one or more trace paths (files or folders) into one workload.

    Bad entries are skipped or defaulted and counted in ``report`` (and logged once).
    """
    report = LoadReport() if report is None else report
    files = [f for p in paths for f in trace_files(p)]
    if not files:
        raise TraceError(f"no trace files in {list(map(str, paths))}")
    fmt = fmt or detect_format(files[0])
    if fmt == "claude-code":
        workload = load_claude_code(files, limit_sessions, report)
    elif fmt == "mooncake":
        sessions = [s for f in files for s in _mooncake_sessions(f, report)]
        workload = Workload("mooncake", tuple(sessions), open_loop=True).limited(limit_sessions)
    elif fmt == "bailian":
        sessions = [s for f in files for s in _bailian_sessions(f, report)]
        sessions.sort(key=lambda s: s.turns[0].arrival_s)
        workload = Workload("bailian", tuple(sessions), open_loop=True).limited(limit_sessions)
    else:
        raise TraceError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS[:3])})")
    if report.counts:
        log.warning("trace %s: %s", ", ".join(map(str, paths)), report.summary())
    if not workload.sessions:
        raise TraceError(f"no usable {fmt} session in {list(map(str, paths))} ({report.summary()})")
    return workload


def rate_scaled(workload: Workload, factor: float) -> Workload:
    """An open-loop workload replayed ``factor`` times as fast: every arrival time divided
    by ``factor`` (the same requests, in the same order, at ``factor`` x the rate)."""
    if factor <= 0 or not math.isfinite(factor):
        raise TraceError(f"rate scale must be a finite number > 0, not {factor!r}")
    if not workload.open_loop:
        raise TraceError(f"{workload.name} is replayed closed loop: scale its think times instead")
    if factor == 1.0:
        return workload
    sessions = tuple(dataclasses.replace(s, turns=tuple(dataclasses.replace(t, arrival_s=t.arrival_s / factor)
                                                        for t in s.turns))
                     for s in workload.sessions)
    return Workload(workload.name, sessions, open_loop=True)


HALVES = ("tuning", "validation")


def half(workload: Workload, which: str) -> Workload:
    """One of two disjoint halves of an open-loop workload, for held-out evaluation: sessions
    are split by the first hash block of their first turn (a stable hash of it), so that
    requests sharing their first block (an app's system prompt, a shared document) all fall
    in one half and nothing one half teaches a policy is seen by the other. Each half keeps
    its recorded arrival times: about half the rate (replay it with ``rate_scaled(.., 2)``
    for the whole trace's load)."""
    if which not in HALVES:
        raise TraceError(f"half must be one of {', '.join(HALVES)}, not {which!r}")
    if not workload.open_loop:
        raise TraceError(f"{workload.name} is replayed closed loop: take a slice of its sessions instead")
    want = HALVES.index(which)

    def side(s: Session) -> int:
        first = s.turns[0].new_hash_ids[:1] if s.turns else ()
        return xxhash.xxh64_intdigest(f"{s.namespace}/{first[0] if first else s.id}".encode()) & 1

    return Workload(f"{workload.name}-{which}", tuple(s for s in workload.sessions if side(s) == want), True)


# ---- Claude Code -------------------------------------------------------------------

def session_uuid(*parts: str) -> str:
    """A stable UUID for a session or agent (uuid5: same input, same id, any process)."""
    return str(uuid.uuid5(_UUID_NS, "/".join(parts)))


def _read_doc(path: Path, report: LoadReport) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(read_bytes(path, report))
    except (orjson.JSONDecodeError, OSError, EOFError):
        report.skipped("unreadable file")
        return None
    if not isinstance(doc, dict):
        report.skipped("not an object")
        return None
    return doc


def load_claude_code(files: Iterable[Path], limit_sessions: int | None = None,
                     report: LoadReport | None = None) -> Workload:
    report = LoadReport() if report is None else report
    sessions: list[Session] = []
    for f in files:
        if limit_sessions is not None and len(sessions) >= limit_sessions:
            break
        doc = _read_doc(f, report)
        if doc is None:
            continue
        ns = _stem(f)
        sid = session_uuid("claude-code", ns)
        block_size = int(_number(doc, "block_size", 64, report)) or 64
        session = _claude_session(doc, ns, sid, block_size, {"x-claude-code-session-id": sid},
                                  None, 0.0, report)
        if session is not None:
            sessions.append(session)
    return Workload("claude-code", tuple(sessions))


class _Conversation:
    """Builds one Claude Code (sub)conversation's turns, entry by entry."""

    def __init__(self, block_size: int, report: LoadReport) -> None:
        self.block_size, self.report = block_size, report
        self.turns: list[Turn] = []
        self.subs: list[list[Session]] = []
        self.early: list[Session] = []  # subagents listed before the first turn
        self.prev_ids: list[int] = []
        self.prev_t = 0.0
        self.prev_end_s = 0.0

    def turn(self, req: dict[str, Any]) -> None:
        ids = _hash_ids(req, self.report)
        if ids is None:
            return
        rep = self.report
        shared, new = delta_encode(self.prev_ids, ids)
        self.prev_ids = ids
        t_s = self.prev_t = _number(req, "t", self.prev_t, rep)
        self.prev_end_s = t_s + _number(req, "api_time", 0.0, rep)
        in_tokens = int(_number(req, "in", float(len(ids) * self.block_size), rep))
        out_tokens = max(1, int(_number(req, "out", 1.0, rep)))
        kind = req.get("type")
        self.turns.append(Turn(_number(req, "think_time", 0.0, rep), in_tokens, out_tokens, shared, new, t_s,
                               kind=kind if isinstance(kind, str) else "n"))
        self.subs.append([])

    def subagent(self, sub: Session) -> None:
        (self.subs[-1] if self.subs else self.early).append(sub)

    def turns_with_subagents(self) -> tuple[Turn, ...]:
        if self.subs:
            self.subs[0][:0] = self.early
        elif self.early:
            self.report.skipped("subagent without a parent turn")
        return tuple(_with_subagents(t, s) for t, s in zip(self.turns, self.subs))


def _claude_session(doc: dict[str, Any], ns: str, sid: str, block_size: int,
                    headers: dict[str, str], parent: str | None, delay_s: float,
                    report: LoadReport) -> Session | None:
    root_sid = headers["x-claude-code-session-id"]
    conv = _Conversation(block_size, report)
    requests = doc.get("requests")
    for req in requests if isinstance(requests, list) else ():
        if not isinstance(req, dict):
            report.skipped("not an object")
        elif req.get("type") == "subagent":
            agent = session_uuid("claude-code", ns, str(req.get("agent_id", len(conv.subs))))
            t_s = _number(req, "t", conv.prev_end_s, report)
            start_s = t_s - _number(req, "duration_ms", 0.0, report) / 1000.0
            sub_headers = {"x-claude-code-session-id": root_sid, "x-claude-code-agent-id": agent,
                           "x-claude-code-parent-agent-id": sid}
            sub = _claude_session(req, ns, agent, block_size, sub_headers, sid,
                                  max(0.0, start_s - conv.prev_end_s), report)
            if sub is not None:
                conv.subagent(sub)
        else:
            conv.turn(req)
    turns = conv.turns_with_subagents()
    if not turns:
        report.skipped("subagent without requests" if parent else "session without requests")
        return None
    tokens = _number(doc, "tool_tokens", 0.0, report) + _number(doc, "system_tokens", 0.0, report)
    return Session(sid, ns, block_size, turns, int(tokens) // block_size, headers, parent, delay_s)


def _with_subagents(turn: Turn, subs: list[Session]) -> Turn:
    if not subs:
        return turn
    return Turn(turn.think_time_s, turn.in_tokens, turn.out_tokens, turn.shared_blocks,
                turn.new_hash_ids, turn.arrival_s, tuple(subs), turn.kind)


# ---- JSONL formats ------------------------------------------------------------------

def _jsonl_rows(path: Path, report: LoadReport) -> Iterator[dict[str, Any]]:
    try:
        data = read_bytes(path, report)
    except OSError:
        report.skipped("unreadable file")
        return
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            report.skipped("not JSON")
            continue
        if not isinstance(row, dict):
            report.skipped("not an object")
            continue
        yield row


def _mooncake_sessions(path: Path, report: LoadReport, block_size: int = 512) -> Iterator[Session]:
    ns = _stem(path)
    prev_ms = 0.0
    for i, row in enumerate(_jsonl_rows(path, report)):
        ids = _hash_ids(row, report)
        if ids is None:
            continue
        prev_ms = _number(row, "timestamp", prev_ms, report)
        turn = Turn(0.0, int(_number(row, "input_length", float(len(ids) * block_size), report)),
                    max(1, int(_number(row, "output_length", 1.0, report))), 0, tuple(ids), prev_ms / 1000.0)
        yield Session(f"{ns}-{i}", ns, block_size, (turn,))


def _bailian_chains(path: Path, report: LoadReport) -> dict[int, list[dict[str, Any]]]:
    """Rows grouped by the root of their chat_id chain (each row gets ``_t``: its timestamp)."""
    root_of: dict[int, int] = {}
    chains: dict[int, list[dict[str, Any]]] = {}
    prev_t = 0.0
    for row in _jsonl_rows(path, report):
        chat, parent = row.get("chat_id"), row.get("parent_chat_id", -1)
        if not isinstance(chat, int) or isinstance(chat, bool):
            report.skipped("no chat_id")
            continue
        if not isinstance(parent, int) or isinstance(parent, bool):
            report.defaulted("parent_chat_id")
            parent = -1
        root = root_of.get(parent, chat) if parent != -1 else chat
        root_of[chat] = root
        row["_t"] = prev_t = _number(row, "timestamp", prev_t, report)
        chains.setdefault(root, []).append(row)
    return chains


def _bailian_sessions(path: Path, report: LoadReport, block_size: int = 16) -> Iterator[Session]:
    ns = _stem(path)
    for root, rows in _bailian_chains(path, report).items():
        rows.sort(key=lambda r: (r["_t"], r.get("turn") if isinstance(r.get("turn"), int) else 0))
        sid = f"{ns}-{root}"
        turns: list[Turn] = []
        prev_ids: list[int] = []
        prev_t = rows[0]["_t"]
        for row in rows:
            ids = _hash_ids(row, report)
            if ids is None:
                continue
            shared, new = delta_encode(prev_ids, ids)
            prev_ids = ids
            t_s = row["_t"]
            kind = row.get("type", "")
            turns.append(Turn(max(0.0, t_s - prev_t), int(_number(row, "input_length", len(ids) * block_size, report)),
                              max(1, int(_number(row, "output_length", 1.0, report))), shared, new, t_s,
                              kind=kind if isinstance(kind, str) else str(kind)))
            prev_t = t_s
        if turns:
            yield Session(sid, ns, block_size, tuple(turns), headers={"x-session-id": sid})
        else:
            report.skipped("session without requests")
