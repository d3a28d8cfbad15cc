"""`kvgate bench peers --engine sglang-cpu` on REAL SGLang CPU servers, smallest version
(issue 11, item 5): the package's two real servers (``--replica-url``), a slice of the
Claude Code sessions scaled to the tiny model (x1/16), kvgate and sglang-router, a few
requests each. Checks that every target served requests without errors, that the
replicas' own counters saw them, and that kvgate's requests report real cached tokens.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from loadtest.demo import TRACE_DIRS
from tests.support.procs import kvgate_cmd

pytestmark = pytest.mark.sglang_real

TARGETS = ("kvgate", "sglang-router")


def test_bench_peers_on_real_servers(real_urls: list[str], tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    trace = [a for d in TRACE_DIRS if d.is_dir() for a in ("--trace", str(d))][:2]
    args = ["bench", "peers", "--engine", "sglang-cpu", *(a for u in real_urls for a in ("--replica-url", u)),
            *trace, "--limit-sessions", "12", "--sessions-concurrent", "2", "--targets", ",".join(TARGETS),
            "--duration-s", "10", "--max-requests", "8", "--warm-up-s", "0", "--grace-s", "30",
            "--think-scale", "0.01", "--max-think-s", "0.5", "--gpus-per-replica", "1", "--json", str(out)]
    done = subprocess.run(kvgate_cmd(*args), capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["config"]["target_label"]: r for r in orjson.loads(out.read_bytes())["runs"]}
    assert set(runs) == set(TARGETS), list(runs)
    for target, run in runs.items():
        summary = run["summary"]
        assert summary["requests"] > 0 and summary["errors"] == 0, (target, summary)
        assert summary["prompt_tokens"] > 0 and summary["output_tokens"] > 0, (target, summary)
    assert runs["kvgate"]["summary"]["cached_tokens"] > 0, runs["kvgate"]["summary"]
