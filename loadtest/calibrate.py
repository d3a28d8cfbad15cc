"""Calibrate the simulated replica against a real SGLang CPU server: per-request ``cached_tokens``.

    python -m loadtest.calibrate                       # starts both, prints the report
    python -m loadtest.calibrate --real URL --sim URL  # against running servers

The same deterministic multi-session workload goes, one request at a time and in the same
order, to a real server (``kvgate sglang-cpu``) and to a simulated replica of the
``tiny-cpu`` profile with the same KV pool (``--max-total-tokens``) and page size. The
requests are ``POST /generate`` with ``input_ids`` (both count exactly the same tokens:
no tokenizer or chat template in between) and ``max_new_tokens`` 1 (nothing of the
output is cached: SGLang caches prompt + output[:-1]).

Workload (`WorkloadParams`, seeded): ``groups`` shared system prefixes; each session
starts with its group's prefix plus its own first message and every turn appends its
own new tokens (the whole history is re-sent, as an agent does). Turns are interleaved
round-robin across sessions, so the sessions' total (sessions x final length, several
times ``--max-total-tokens``) overflows the pool: older sessions are evicted (LRU) and
their next turn is a partial hit. The report is the distribution of ``sim - real``
cached tokens per request and the share within one page.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

PROFILE = "tiny-cpu"
TOKEN_RANGE = (16, 4000)  # ordinary ids of the tiny model's 4,096-token vocabulary
REQUEST_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadParams:
    sessions: int = 12
    groups: int = 3
    shared_tokens: int = 700  # per group
    first_tokens: int = 500
    turn_tokens: int = 300  # new tokens per later turn (+-50%)
    turns: int = 6
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One request: its position, prompt length, and cached tokens on each side."""

    index: int
    session: int
    turn: int
    prompt_tokens: int
    real_cached: int
    sim_cached: int

    @property
    def diff(self) -> int:
        return self.sim_cached - self.real_cached


def build_requests(p: WorkloadParams) -> list[tuple[int, int, list[int]]]:
    """(session, turn, input_ids) in send order; the same for every run with the same params."""
    rng = random.Random(p.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    shared = [ids(p.shared_tokens) for _ in range(p.groups)]
    history = [shared[s % p.groups] + ids(p.first_tokens) for s in range(p.sessions)]
    out: list[tuple[int, int, list[int]]] = []
    for turn in range(p.turns):
        for s in range(p.sessions):
            if turn:
                history[s] = history[s] + ids(rng.randint(p.turn_tokens // 2, p.turn_tokens * 3 // 2))
            out.append((s, turn, list(history[s])))
    return out


def generate(client: httpx.Client, input_ids: Sequence[int]) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of one ``/generate`` of ``input_ids``."""
    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    r = client.post("/generate", json=body)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return int(meta["prompt_tokens"]), int(meta.get("cached_tokens") or 0)


def flush(client: httpx.Client) -> None:
    r = client.post("/flush_cache")
    if r.status_code != 200:
        raise RuntimeError(f"{client.base_url}/flush_cache: {r.status_code} {r.text[:200]}")


def replay(real_url: str, sim_url: str, params: WorkloadParams) -> list[Row]:
    """Flush both, then send every request to the real server and to the simulated one."""
    rows: list[Row] = []
    with httpx.Client(base_url=real_url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as real, \
            httpx.Client(base_url=sim_url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as sim:
        flush(real)
        flush(sim)
        for i, (s, turn, input_ids) in enumerate(build_requests(params)):
            prompt, real_cached = generate(real, input_ids)
            sim_prompt, sim_cached = generate(sim, input_ids)
            if sim_prompt != prompt:
                raise RuntimeError(f"request {i}: prompt_tokens differ: real {prompt}, sim {sim_prompt}")
            rows.append(Row(i, s, turn, prompt, real_cached, sim_cached))
    return rows


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    requests: int
    page_size: int
    within_page: float  # share of requests with |sim - real| < page_size (or == 0)
    exact: float
    real_hit_rate: float
    sim_hit_rate: float
    diff_quantiles: dict[str, int]  # p0 p5 p50 p95 p100 of sim - real
    diff_histogram: dict[str, int]  # bucket -> requests

    def text(self) -> str:
        return (f"{self.requests} requests, page {self.page_size}: {100 * self.within_page:.1f}% within one page, "
                f"{100 * self.exact:.1f}% exact; hit rate real {100 * self.real_hit_rate:.1f}% / sim "
                f"{100 * self.sim_hit_rate:.1f}%; sim - real quantiles {self.diff_quantiles}; "
                f"histogram {self.diff_histogram}")


def report(rows: Sequence[Row], page_size: int) -> Report:
    diffs = sorted(r.diff for r in rows)
    n = len(diffs)
    if n == 0:
        raise ValueError("no requests to compare")
    prompt = sum(r.prompt_tokens for r in rows)
    quantiles = {f"p{q}": diffs[min(n - 1, q * n // 100)] for q in (0, 5, 50, 95)} | {"p100": diffs[-1]}
    return Report(requests=n, page_size=page_size,
                  within_page=sum(abs(d) < max(page_size, 1) or d == 0 for d in diffs) / n,
                  exact=sum(d == 0 for d in diffs) / n,
                  real_hit_rate=sum(r.real_cached for r in rows) / prompt,
                  sim_hit_rate=sum(r.sim_cached for r in rows) / prompt,
                  diff_quantiles=quantiles, diff_histogram=histogram(diffs, page_size))


def histogram(diffs: Sequence[int], page_size: int) -> dict[str, int]:
    def bucket(d: int) -> str:
        if abs(d) < max(page_size, 1):
            return "within a page"
        pages = abs(d) // max(page_size, 1)
        side = "sim more" if d > 0 else "sim less"
        return f"{side} {'1-9' if pages < 10 else '10-99' if pages < 100 else '100+'} pages"

    return dict(sorted(Counter(bucket(d) for d in diffs).items()))


def profile_with(out_dir: Path, device_tokens: int, page_size: int, base: str = PROFILE) -> str:
    """A copy of ``base`` (resolved) with this KV pool and page size; returns its path."""
    from loadtest.simulator.profile import load_profile

    data = dataclasses.asdict(load_profile(base))
    data.update(device_tokens=device_tokens, page_size=page_size, name=f"{base}-{device_tokens}-p{page_size}")
    data["spec_algorithm"] = data["spec_algorithm"] or ""
    out = out_dir / f"{data['name']}.toml"
    out.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items()), encoding="utf-8")
    return str(out)


@contextmanager
def both_servers(max_total_tokens: int, page_size: int, log_dir: Path) -> Iterator[tuple[str, str]]:
    """A real CPU server and a simulated ``tiny-cpu`` replica with the same pool and page."""
    from loadtest.sglang_cpu.harness import real_fleet
    from loadtest.simulator.fleet import SimFleet

    profile = profile_with(log_dir, max_total_tokens, page_size)
    with real_fleet(1, max_total_tokens, page_size, log_dir) as real, \
            SimFleet(1, profile=profile, time_scale=50.0, seed=1, log_dir=log_dir) as sim:
        yield real.urls[0], sim.urls[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--real", help="base URL of a running real server (default: start one)")
    parser.add_argument("--sim", help="base URL of a running simulated replica (default: start one)")
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every row and the report")
    args = parser.parse_args(argv)
    params = WorkloadParams(seed=args.seed)
    if args.real and args.sim:
        rows = replay(args.real, args.sim, params)
    else:
        with both_servers(args.max_total_tokens, args.page_size,
                          Path(tempfile.mkdtemp(prefix="kvgate-calibrate-"))) as (real_url, sim_url):
            rows = replay(real_url, sim_url, params)
    rep = report(rows, args.page_size)
    print(rep.text())
    if args.json:
        args.json.write_text(json.dumps({"report": dataclasses.asdict(rep),
                                         "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0 if rep.within_page >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
