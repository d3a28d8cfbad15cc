"""CPU of one ``record`` in the embedded index where sessions' chains move between tiers.

In ``kvgate bench peers`` (KV x0.25) the index's ``record`` is one of the largest pieces
of a request's CPU (docs/profile.md): a session that comes back after the others has had
its chain demoted to host (or dropped), so its record promotes (or re-inserts) every
block and demotes as many others. This replays that shape on one replica: ``--sessions``
chains of ``--blocks`` blocks, each growing ``--grow`` blocks a turn, recorded round-robin
for ``--turns`` turns, under each ``--tiers`` device/host capacity (blocks). The first
third of the records (warm-up) is not counted. With ``--against REV`` the same workload
runs, alternating per configuration, on ``prefix_index/memory.py`` as of that git revision
too, and the ratio is printed.

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
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prefix_index import memory
from prefix_index.base import ReplicaCapacity, ReplicaId


def load_revision(rev: str) -> ModuleType:
    """``prefix_index/memory.py`` as of ``rev`` (git show), imported under its own name."""
    source = subprocess.run(["git", "show", f"{rev}:prefix_index/memory.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="kvgate-index-record-") as tmp:  # gone once imported
        path = Path(tmp) / "memory_at_rev.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("memory_at_rev", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def run(module: ModuleType, device: int, host: int, sessions: int, blocks: int, grow: int, turns: int,
        seed: int) -> list[float]:
    """Seconds per counted record."""
    index = module.MemoryPrefixIndex(assume_chains=True, default_capacity=ReplicaCapacity(device, host))
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
    versions = [("working tree", memory)]
    if args.against:
        versions.append((args.against, load_revision(args.against)))
    print(f"{args.sessions} sessions x {args.blocks} blocks (+{args.grow} a turn), {args.turns} turns, "
          f"{args.sessions * args.turns - args.sessions * args.turns // 3} records counted each")
    for tier in args.tiers.split(","):
        device, host = (int(x) for x in tier.split("/"))
        p50s = {}
        for name, module in versions:
            t = run(module, device, host, args.sessions, args.blocks, args.grow, args.turns, args.seed)
            q = statistics.quantiles(t, n=10)
            p50s[name] = statistics.median(t)
            print(f"device {device:>6} / host {host:>6} blocks  {name:>14}: record p50 {p50s[name] * 1e6:7.1f} us"
                  f"  p90 {q[8] * 1e6:7.1f} us  mean {statistics.fmean(t) * 1e6:7.1f} us")
        if args.against:
            print(f"{'':>42}working tree / {args.against}: {p50s['working tree'] / p50s[args.against]:.2f} at p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
