"""CPU of one ``record`` in the embedded index where sessions' chains move between tiers.

In ``kvgate bench peers`` (KV x0.25) the index's ``record`` is one of the largest pieces
of a request's CPU (docs/profile.md): a session that comes back after the others has had
its chain demoted to host (or dropped), so its record promotes (or re-inserts) every
block and demotes as many others. This replays that shape on one replica: ``--sessions``
chains of ``--blocks`` blocks, each growing ``--grow`` blocks a turn, recorded round-robin
for ``--turns`` turns, under each ``--tiers`` device/host capacity (blocks). The first
third of the records (warm-up) is not counted. The working tree's index is the gateway's
(``prefix_index.local_index.embedded_index``: the segment index). With ``--against REV`` the
same workload runs, alternating per configuration, on the gateway's embedded index as of
that git revision too (``prefix_index/segments.py`` where the revision has it, else
``prefix_index/memory.py`` in its chain mode), and the ratio is printed.

    python tools/bench/index_record.py [--against HEAD~1] [--tiers 3000/6000,6000/12000,20000/40000]
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prefix_index.base import ReplicaCapacity, ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.local_index import embedded_index

Make = Callable[[ReplicaCapacity], Any]  # capacity -> an embedded index with record_now


def working_tree(capacity: ReplicaCapacity) -> Any:
    return embedded_index(IndexConfig(default_device_blocks=capacity.device_blocks,
                                      default_host_blocks=capacity.host_blocks))


def _module_at(rev: str, path: str) -> ModuleType:
    """``path`` as of ``rev`` (git show), imported under its own name."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = Path(path).stem + "_at_rev"
    with tempfile.TemporaryDirectory(prefix="kvgate-index-record-") as tmp:  # gone once imported
        file = Path(tmp) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def load_revision(rev: str) -> Make:
    """The gateway's embedded index as of ``rev``."""
    has_segments = subprocess.run(["git", "cat-file", "-e", f"{rev}:prefix_index/segments.py"], cwd=ROOT,
                                  capture_output=True, check=False).returncode == 0
    if has_segments:
        segments = _module_at(rev, "prefix_index/segments.py")
        return lambda capacity: segments.SegmentPrefixIndex(default_capacity=capacity)
    memory = _module_at(rev, "prefix_index/memory.py")
    return lambda capacity: memory.MemoryPrefixIndex(assume_chains=True, default_capacity=capacity)


def run(make: Make, device: int, host: int, sessions: int, blocks: int, grow: int, turns: int,
        seed: int) -> list[float]:
    """Seconds per counted record."""
    index = make(ReplicaCapacity(device, host))
    rid = ReplicaId("replica")
    rng = random.Random(seed)
    chains = [[rng.getrandbits(63) for _ in range(blocks)] for _ in range(sessions)]
    times: list[float] = []
    for _ in range(turns):
        for chain in chains:
            chain.extend(rng.getrandbits(63) for _ in range(grow))
            start = time.perf_counter()
            index.record_now(rid, chain)
            times.append(time.perf_counter() - start)
    return times[len(times) // 3:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="3000/6000,6000/12000,20000/40000",
                        help="device/host capacities in blocks, comma-separated")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1560, help="a chain's first length (100k tokens / 64)")
    parser.add_argument("--grow", type=int, default=5, help="blocks a chain grows a turn")
    parser.add_argument("--turns", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", default=None, help="a git revision to compare with")
    args = parser.parse_args(argv)
    versions: list[tuple[str, Make]] = [("working tree", working_tree)]
    if args.against:
        versions.append((args.against, load_revision(args.against)))
    print(f"{args.sessions} sessions x {args.blocks} blocks (+{args.grow} a turn), {args.turns} turns, "
          f"{args.sessions * args.turns - args.sessions * args.turns // 3} records counted each")
    for tier in args.tiers.split(","):
        device, host = (int(x) for x in tier.split("/"))
        p50s = {}
        for name, make in versions:
            t = run(make, device, host, args.sessions, args.blocks, args.grow, args.turns, args.seed)
            q = statistics.quantiles(t, n=10)
            p50s[name] = statistics.median(t)
            print(f"device {device:>6} / host {host:>6} blocks  {name:>14}: record p50 {p50s[name] * 1e6:7.1f} us"
                  f"  p90 {q[8] * 1e6:7.1f} us  mean {statistics.fmean(t) * 1e6:7.1f} us")
        if args.against:
            print(f"{'':>42}working tree / {args.against}: {p50s['working tree'] / p50s[args.against]:.2f} at p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
