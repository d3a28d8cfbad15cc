"""Simulator profiles that tests derive from the bundled ones."""
from __future__ import annotations

import re
from pathlib import Path

from loadtest.simulator.profile import PROFILES_DIR


def tiny_not_memory_bound(folder: Path) -> Path:
    """The ``tiny`` profile with its context length cut to its KV pool (4,096 tokens), so the
    replica is not memory-bound and prefill admission orders its queue
    (``replicas.model.memory_bound``; the bundled ``tiny`` serves 8,192 on a 4,096 pool)."""
    text = (PROFILES_DIR / "tiny.toml").read_text(encoding="utf-8")
    path = folder / "tiny.toml"
    path.write_text(re.sub(r"(?m)^context_length = \d+$", "context_length = 4096", text), encoding="utf-8")
    return path
