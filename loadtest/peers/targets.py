"""Targets of `kvgate bench peers`: kvgate under a policy, or a peer router; start one, name it.

Shared by the load comparison (``loadtest/bench_peers.py``) and the overhead measurement
(``loadtest/peers/overhead.py``).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console

from loadtest.demo import GatewayProcess
from loadtest.peers.run import INSTALL_HINT, PEERS, ROOT, install_peers, missing_peers, running_peer
from loadtest.simulator.fleet import stop_process, wait_http
from loadtest.simulator.ports import free_port

PYTHON_FLOOR = "python-floor"  # loadtest/peers/python_floor.py: a pass-through proxy (uvicorn + aiohttp)
PYTHON_FLOOR_GRANIAN = "python-floor-granian"  # the same app on Granian (pip install granian)
PYTHON_FLOOR_RSGI = "python-floor-rsgi"  # the same pass-through on Granian's RSGI interface
FLOORS = (PYTHON_FLOOR, PYTHON_FLOOR_GRANIAN, PYTHON_FLOOR_RSGI)


def parse_targets(text: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    for t in targets:
        if t not in PEERS and t not in ("kvgate", *FLOORS) and not t.startswith(("kvgate-", "kvgate@")):
            raise ValueError(
                f"unknown target {t!r}: kvgate, kvgate-<policy>, kvgate@<checkout>, {', '.join(FLOORS)} "
                f"or one of {', '.join(PEERS)}"
            )
        if (checkout := kvgate_checkout(t)) is not None and not (checkout / "gateway" / "cli.py").is_file():
            raise ValueError(f"target {t!r}: {checkout} is not a kvgate checkout (no gateway/cli.py)")
    return targets


def kvgate_checkout(target: str) -> Path | None:
    """``kvgate@<dir>``: kvgate (cache-aware) run from another checkout, e.g. a ``git
    worktree`` of an older commit, to compare two versions in one interleaved run."""
    return Path(target.removeprefix("kvgate@")).resolve() if target.startswith("kvgate@") else None


def kvgate_policy(target: str) -> str | None:
    """The kvgate policy of a target name (None for a peer)."""
    if target == "kvgate" or target.startswith("kvgate@"):
        return "cache-aware"
    return target.removeprefix("kvgate-") if target.startswith("kvgate-") else None


@contextlib.contextmanager
def open_target(
    target: str, workers: Sequence[str], log_dir: Path, gateway_args: Sequence[str] = (),
    time_scale: float = 1.0,
) -> Iterator[tuple[str, int]]:
    """Start ``target`` in front of ``workers`` (time-scaled by ``time_scale``: `GatewayProcess`);
    yields its (base URL, pid)."""
    policy = kvgate_policy(target)
    if target in FLOORS:
        with _python_floor(target, workers, log_dir) as opened:
            yield opened
    elif policy is not None:
        with GatewayProcess(policy, workers, gateway_args, log_dir=log_dir, root=kvgate_checkout(target) or ROOT,
                            time_scale=time_scale) as gw:
            assert gw.proc is not None
            yield gw.url, gw.proc.pid
    else:
        with running_peer(target, workers, log_dir=log_dir) as peer:
            yield peer.url, peer.pid


@contextlib.contextmanager
def _python_floor(target: str, workers: Sequence[str], log_dir: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    replicas = [arg for w in workers for arg in ("--replica", w)]
    if target == PYTHON_FLOOR:
        cmd = ["-m", "loadtest.peers.python_floor", "--port", str(port), *replicas]
    elif target == PYTHON_FLOOR_RSGI:
        cmd = ["-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1", "--port", str(port), "--loop",
               "uvloop", "--http", "1", "--no-ws", "--log-level", "warning", "--factory",
               "loadtest.peers.python_floor:rsgi_from_env"]
    else:
        cmd = ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port), "--loop",
               "uvloop", "--http", "1", "--no-ws", "--log-level", "warning", "--factory",
               "loadtest.peers.python_floor:from_env"]
    with open(log_dir / f"{target}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                env={**os.environ, "KVGATE_FLOOR_REPLICA": ",".join(workers)})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 30.0, proc)
        # Granian serves from one worker process under a supervisor: its CPU is the worker's
        yield url, proc.pid if target == PYTHON_FLOOR else _only_child(proc.pid)
    finally:
        stop_process(proc)


def _only_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"expected one worker process under {pid}, found {children}")
    return int(children[0])


def target_version(target: str) -> str:
    if target == PYTHON_FLOOR:
        return "pass-through (uvicorn+aiohttp)"
    if target == PYTHON_FLOOR_GRANIAN:
        return "pass-through (granian+aiohttp)"
    if target == PYTHON_FLOOR_RSGI:
        return "pass-through (granian RSGI+aiohttp)"
    if (checkout := kvgate_checkout(target)) is not None:
        return f"kvgate cache-aware from {checkout}"
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
