"""Targets of `kvgate bench peers`: kvgate under a policy, or a peer router; start one, name it.

Shared by the load comparison (``loadtest/bench_peers.py``) and the overhead measurement
(``loadtest/peers/overhead.py``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console

from loadtest.demo import GatewayProcess
from loadtest.peers.run import INSTALL_HINT, PEERS, ROOT, install_peers, missing_peers, running_peer


def parse_targets(text: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    for t in targets:
        if t not in PEERS and t != "kvgate" and not t.startswith("kvgate-"):
            raise ValueError(
                f"unknown target {t!r}: kvgate, kvgate-<policy> or one of {', '.join(PEERS)}"
            )
    return targets


def kvgate_policy(target: str) -> str | None:
    """The kvgate policy of a target name (None for a peer)."""
    if target == "kvgate":
        return "cache-aware"
    return target.removeprefix("kvgate-") if target.startswith("kvgate-") else None


@contextlib.contextmanager
def open_target(
    target: str, workers: Sequence[str], log_dir: Path, gateway_args: Sequence[str] = ()
) -> Iterator[tuple[str, int]]:
    """Start ``target`` in front of ``workers``; yields its (base URL, pid)."""
    policy = kvgate_policy(target)
    if policy is not None:
        with GatewayProcess(policy, workers, gateway_args, log_dir=log_dir) as gw:
            assert gw.proc is not None
            yield gw.url, gw.proc.pid
    else:
        with running_peer(target, workers, log_dir=log_dir) as peer:
            yield peer.url, peer.pid


def target_version(target: str) -> str:
    policy = kvgate_policy(target)
    return f"kvgate {policy}" if policy is not None else PEERS[target].version


def check_peers(targets: Sequence[str], install: bool, console: Console, root: Path = ROOT) -> bool:
    """True when every peer among ``targets`` is installed (after ``install.sh`` if asked)."""
    missing = missing_peers(targets, root)
    if missing and install:
        install_peers(root)
        missing = missing_peers(targets, root)
    if missing:
        console.print(
            f"[red]peer routers not installed: {', '.join(missing)}[/]; run `{INSTALL_HINT}` "
            "(or pass --install)"
        )
    return not missing
