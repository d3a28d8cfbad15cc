"""The load harness on REAL SGLang CPU servers: ``--engine sim|sglang-cpu`` and ``--api``.

Shared by ``kvgate loadtest sweep`` (`loadtest.cli`) and ``kvgate bench peers``
(`loadtest.bench_peers`):

- ``--engine sim`` (default): the simulated fleet (`SimFleet`, a replica profile, time-scaled);
- ``--replica-url URL`` (repeatable): running replicas instead (the package's real servers
  in tests/sglang_real, or ``kvgate sglang-cpu --replicas 2``);
- ``--engine sglang-cpu``: ``--replicas`` (1..3) real SGLang 0.5.23 servers with the tiny
  model (`loadtest.sglang_cpu.server`), each with ``--max-total-tokens`` of KV pool (and
  ``--page-size``). They run in real time, so the driver's time scale is forced to 1
  (think times are shortened with ``--think-scale`` / ``--max-think-s`` instead).

Workload scaling for the tiny model (`scale_workload`). A Claude Code session is ~100k
tokens a request (p90 ~230k), the tiny model's context is 32,768 tokens and its pool
16,384 by default. Every token figure is multiplied by ``--token-scale`` (default 1/16
with sglang-cpu): the hash block size (64 -> 4 tokens: the same hash ids, so the same
prefix structure, in 16 times less text), the prompt and the output lengths (at least
1); sessions whose largest scaled prompt + output exceeds ``--max-prompt-fraction``
(0.5) of the KV pool are dropped (a longer one would be rejected or evict everything).
The rendered text is ~3.7 characters per tiny-tokenizer token, the renderer assumes 4:
real prompts are ~8% longer than the scaled figures.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from loadtest.driver import API_CHOICES
from loadtest.workload import Session, Turn, Workload

ENGINES = ("sim", "sglang-cpu")
MAX_REAL_REPLICAS = 3  # ~2.1 GB RSS each
DEFAULT_TOKEN_SCALE = 1 / 16


class Fleet(Protocol):
    """What the harness needs of a fleet: its replicas' base URLs."""

    @property
    def urls(self) -> list[str]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RealFleetUrls:
    urls: list[str]


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="sim",
                        help="sim: simulated replicas; sglang-cpu: real SGLang CPU servers (tiny model)")
    parser.add_argument("--api", choices=API_CHOICES, default="chat",
                        help="the API the driver speaks (chat: /v1/chat/completions)")
    parser.add_argument("--max-total-tokens", type=int, default=16384,
                        help="sglang-cpu: KV pool per server, in tokens")
    parser.add_argument("--page-size", type=int, default=None, help="sglang-cpu: KV page size")
    parser.add_argument("--token-scale", type=float, default=None,
                        help=f"multiply every token figure of the workload (sglang-cpu default {DEFAULT_TOKEN_SCALE:g})")
    parser.add_argument("--max-prompt-fraction", type=float, default=0.5,
                        help="sglang-cpu: drop sessions whose largest request exceeds this share of the pool")
    parser.add_argument("--replica-url", action="append", default=[], metavar="URL",
                        help="use these running replicas (e.g. of `kvgate sglang-cpu --replicas 2`) "
                             "instead of starting a fleet (repeatable; --replicas is ignored)")


def check_engine_args(args: argparse.Namespace) -> str | None:
    """An error message for impossible combinations, else None."""
    if args.engine == "sglang-cpu" and not args.replica_url and not 1 <= args.replicas <= MAX_REAL_REPLICAS:
        return f"--engine sglang-cpu: --replicas must be 1..{MAX_REAL_REPLICAS} (each server takes ~2.1 GB)"
    return None


def effective_time_scale(args: argparse.Namespace) -> float:
    return 1.0 if args.engine == "sglang-cpu" else float(args.time_scale)


def engine_workload(args: argparse.Namespace, workload: Workload) -> Workload:
    """The workload as the engine can serve it (unchanged for ``sim`` unless ``--token-scale``)."""
    scale = args.token_scale
    if scale is None:
        scale = DEFAULT_TOKEN_SCALE if args.engine == "sglang-cpu" else 1.0
    limit = int(args.max_prompt_fraction * args.max_total_tokens) if args.engine == "sglang-cpu" else None
    if scale == 1.0 and limit is None:
        return workload
    return scale_workload(workload, scale, limit)


def scale_workload(workload: Workload, factor: float, max_request_tokens: int | None = None) -> Workload:
    """Every token figure times ``factor``; sessions over ``max_request_tokens`` dropped."""
    scaled = [_scale_session(s, factor) for s in workload.sessions]
    if max_request_tokens is not None:
        scaled = [s for s in scaled if largest_request(s) <= max_request_tokens]
    return Workload(f"{workload.name} x{factor:g}", tuple(scaled), workload.open_loop)


def _scale_session(session: Session, factor: float) -> Session:
    block = max(1, round(session.block_size * factor))
    ratio = block / session.block_size  # the block size is an integer: keep tokens per block exact
    turns = tuple(_scale_turn(t, ratio, factor) for t in session.turns)
    return dataclasses.replace(session, block_size=block, turns=turns)


def _scale_turn(turn: Turn, ratio: float, factor: float) -> Turn:
    return dataclasses.replace(
        turn, in_tokens=max(1, round(turn.in_tokens * ratio)), out_tokens=max(1, round(turn.out_tokens * factor)),
        subagents=tuple(_scale_session(s, factor) for s in turn.subagents))


def largest_request(session: Session) -> int:
    """The largest prompt + output of a session and its subagents, in tokens."""
    own = max((t.in_tokens + t.out_tokens for t in session.turns), default=0)
    subs = (largest_request(s) for t in session.turns for s in t.subagents)
    return max([own, *subs])


@contextlib.contextmanager
def open_fleet(args: argparse.Namespace, profile: str, log_dir: Path | None) -> Iterator[Fleet]:
    """The fleet of ``args.engine``: simulated replicas of ``profile``, or real CPU servers
    (or the running replicas of ``--replica-url``, neither started nor stopped here)."""
    if args.replica_url:
        yield RealFleetUrls([u.rstrip("/") for u in args.replica_url])
        return
    if args.engine == "sglang-cpu":
        with real_fleet(args.replicas, args.max_total_tokens, args.page_size, log_dir) as fleet:
            yield fleet
        return
    from loadtest.simulator.fleet import SimFleet

    with SimFleet(args.replicas, profile=profile, time_scale=args.time_scale, seed=args.seed,
                  log_dir=log_dir) as sim:
        yield sim


@contextlib.contextmanager
def real_fleet(replicas: int, max_total_tokens: int, page_size: int | None,
               log_dir: Path | None) -> Iterator[Fleet]:
    """``replicas`` real SGLang CPU servers on free ports; all stopped on exit."""
    import tempfile

    from loadtest.sglang_cpu.env import ensure_env
    from loadtest.sglang_cpu.server import AUTO_PORT, ServerSpec, SGLangServer, start_all, stop_all

    env = ensure_env()
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-sglang-fleet-"))
    servers = [SGLangServer(env, ServerSpec(port=AUTO_PORT, max_total_tokens=max_total_tokens,
                                            page_size=page_size), logs / f"sglang-{i}.log")
               for i in range(replicas)]
    start_all(servers)
    try:
        yield RealFleetUrls([s.url for s in servers])
    finally:
        stop_all(servers)
