"""Print the table of `scripts/sweep-moves.sh` results: per config, per policy, per slice."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: str) -> None:
    rows: dict[tuple[str, str], dict[str, list[tuple[str, float, float, float, float]]]] = (
        defaultdict(lambda: defaultdict(list))
    )
    for path in sorted(Path(folder).glob("*.json")):
        name, skip, ramp = path.stem.rsplit("-", 2)
        doc = json.loads(path.read_text())
        oracle = doc["oracle"]["cache_hit_rate"]
        for r in doc["results"]:
            rows[(ramp, name)][r["policy"]].append(
                (skip, r["cache_hit_rate"], oracle, r["ttft_p90_s"], r["ttft_p99_s"])
            )
    print("| ramp | run | policy | hit rate (oracle) per slice | TTFT p90 per slice | TTFT p99 per slice |")
    print("|---|---|---|---|---|---|")
    order = {"c32": 0, "c64": 1, "c128": 2}

    def key(item: tuple[tuple[str, str], object]) -> tuple[int, int, str]:
        (ramp, name), _ = item
        return (int(ramp.removeprefix("ramp")), order.get(name, 3), name)

    for (ramp, name), by_policy in sorted(rows.items(), key=key):
        for policy, cells in sorted(by_policy.items()):
            cells.sort(key=lambda c: int(c[0].removeprefix("skip")))
            hits = " / ".join(f"{100 * h:.1f} ({100 * o:.1f})" for _, h, o, _, _ in cells)
            p90 = " / ".join(f"{p:.2f}" for *_, p, _ in cells)
            p99 = " / ".join(f"{p:.2f}" for *_, p in cells)
            print(f"| {ramp.removeprefix('ramp')} s | {name} | {policy} | {hits} | {p90} | {p99} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvgate-sweep-moves")
