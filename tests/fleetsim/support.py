"""Tiny trace files for fleetsim tests (small prompts that fit the ``tiny`` profile)."""
from __future__ import annotations

import gzip
import random
from pathlib import Path
from typing import Any

import orjson

BLOCK = 16


def claude_session(rng: random.Random, turns: int, with_subagent: bool) -> dict[str, Any]:
    """A Claude Code style session: every turn extends the previous one's hash ids."""
    ids = list(range(1, 9))  # 8 system blocks
    next_id = 100
    requests: list[dict[str, Any]] = []
    t = 0.0
    for i in range(turns):
        grow = rng.randint(2, 8)
        ids = ids + list(range(next_id, next_id + grow))
        next_id += grow
        requests.append({"t": t, "type": "n", "in": len(ids) * BLOCK + rng.randint(0, BLOCK - 1),
                         "out": rng.randint(4, 40), "hash_ids": list(ids), "api_time": 0.5,
                         "think_time": rng.uniform(0.1, 3.0)})
        t += 4.0
        if with_subagent and i == 1:
            sub_ids = ids[:8] + [9000, 9001]
            requests.append({"type": "subagent", "agent_id": "a1", "t": t + 1.0, "duration_ms": 500,
                             "requests": [{"t": t, "type": "n", "in": len(sub_ids) * BLOCK, "out": 8,
                                           "hash_ids": sub_ids, "api_time": 0.2, "think_time": 0.0},
                                          {"t": t + 1, "type": "n", "in": (len(sub_ids) + 2) * BLOCK,
                                           "out": 8, "hash_ids": sub_ids + [9002, 9003],
                                           "api_time": 0.2, "think_time": 0.3}]})
    return {"id": "x", "block_size": BLOCK, "tool_tokens": 64, "system_tokens": 64, "requests": requests}


def write_claude_traces(folder: Path, sessions: int = 6, turns: int = 6, seed: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for k in range(sessions):
        doc = claude_session(rng, turns, with_subagent=k == 0)
        (folder / f"trace_{k:04d}.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    return folder


def write_mooncake_trace(path: Path, rows: int = 30, seed: int = 2) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        shared = [1, 2] if i % 2 else [1, 3]
        ids = shared + [1000 + i]
        lines.append(orjson.dumps({"timestamp": i * 200, "input_length": len(ids) * 512 - rng.randint(0, 100),
                                   "output_length": rng.randint(2, 20), "hash_ids": ids}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def write_bailian_trace(path: Path, chats: int = 8, seed: int = 3) -> Path:
    """Chat chains: each child turn extends its parent's hash ids (16-token blocks)."""
    rng = random.Random(seed)
    lines = []
    chat_id = 0
    for c in range(chats):
        ids = [1, 2, 3] + [100 * (c + 1) + k for k in range(4)]
        parent = -1
        for turn in range(3):
            ids = ids + [10_000 * (c + 1) + 10 * turn + k for k in range(rng.randint(1, 5))]
            lines.append(orjson.dumps({"chat_id": chat_id, "parent_chat_id": parent, "timestamp": c * 2.0 + turn * 5.0,
                                       "input_length": len(ids) * 16 + 3, "output_length": rng.randint(2, 20),
                                       "type": "text", "turn": turn + 1, "hash_ids": ids}))
            parent, chat_id = chat_id, chat_id + 1
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path
