"""Launch and stop a peer router (sglang-router 0.3.2, smg 1.13.0) on loopback.

    with running_peer("sglang-router", fleet.urls) as peer:
        httpx.post(peer.url + "/v1/chat/completions", ...)

    python -m loadtest.peers.run sglang-router http://127.0.0.1:31001 ...   # until Ctrl-C

The peers are separate programs, each in its own virtual environment under
``.venv-peers/`` (``bash loadtest/peers/install.sh``); they are not kvgate dependencies.
Every peer runs with these loopback rules: the model hub and the proxies pointed at a dead local
port (``HF_ENDPOINT``, ``HTTP(S)_PROXY`` = ``http://127.0.0.1:9``), ``--host 127.0.0.1
--prometheus-host 127.0.0.1`` on free ports, ``--log-level warn`` (info costs ~20% CPU).

Kinds (`PEERS`):

- ``sglang-router``: sglang-router 0.3.2, ``cache_aware`` with the reference flags
  (cache threshold 0.3, balance thresholds 64 / 1.5, eviction every 60 s, 2^26-character
  trees): its defaults, written out so a version change cannot move them silently.
- ``smg``: smg 1.13.0 with the same ``cache_aware`` flags.
- ``smg-least-load``: smg 1.13.0 ``least_load`` (queued + in-flight tokens over
  throughput, with a KV-pressure penalty; it polls the workers' ``/v1/loads``).

Readiness: ``GET /readiness`` answers 200 as soon as *one* worker registered (a worker
that fails registration is simply not counted), so `PeerRouter` waits until the
readiness body reports ``healthy_workers`` equal to the number of workers given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from loadtest.simulator.fleet import stop_process
from loadtest.simulator.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
INSTALL_HINT = "bash loadtest/peers/install.sh"
LOOPBACK_ENV = {
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "no_proxy": "127.0.0.1,localhost",
}
CACHE_AWARE_ARGS = (
    "--policy",
    "cache_aware",
    "--cache-threshold",
    "0.3",
    "--balance-abs-threshold",
    "64",
    "--balance-rel-threshold",
    "1.5",
    "--eviction-interval-secs",
    "60",
    "--max-tree-size",
    "67108864",
)


@dataclass(frozen=True)
class PeerSpec:
    """How to launch one peer: its virtual environment, module and policy flags."""

    name: str
    venv: str  # folder under .venv-peers/
    version: str  # what it is, for reports
    module: str  # run as `python -m module`
    policy_args: tuple[str, ...]


PEERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec(
        "sglang-router",
        "sglang-router",
        "sglang-router 0.3.2 cache_aware",
        "sglang_router.launch_router",
        CACHE_AWARE_ARGS,
    ),
    "smg": PeerSpec("smg", "smg", "smg 1.13.0 cache_aware", "smg.launch_router", CACHE_AWARE_ARGS),
    "smg-least-load": PeerSpec(
        "smg-least-load",
        "smg",
        "smg 1.13.0 least_load",
        "smg.launch_router",
        ("--policy", "least_load"),
    ),
}


def peer_python(spec: PeerSpec, root: Path = ROOT) -> Path:
    return root / ".venv-peers" / spec.venv / "bin" / "python"


def missing_peers(names: Sequence[str], root: Path = ROOT) -> list[str]:
    """The peer kinds among ``names`` whose virtual environment is not installed."""
    return [n for n in names if n in PEERS and not peer_python(PEERS[n], root).exists()]


def install_peers(root: Path = ROOT) -> int:
    """Run ``loadtest/peers/install.sh`` (downloads from PyPI); returns its exit code."""
    return subprocess.call(["bash", str(root / "loadtest" / "peers" / "install.sh"), str(root)])


def peer_command(
    spec: PeerSpec, port: int, prom_port: int, workers: Sequence[str], root: Path = ROOT
) -> list[str]:
    return [
        str(peer_python(spec, root)),
        "-m",
        spec.module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        *spec.policy_args,
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prom_port),
    ]


def _healthy_workers(client: httpx.Client, url: str) -> int | None:
    """Healthy workers reported by ``/readiness`` (None: not ready or no count)."""
    try:
        r = client.get(url + "/readiness")
        if r.status_code != 200:
            return None
        count = r.json().get("healthy_workers")
        return int(count) if count is not None else None
    except (httpx.HTTPError, ValueError, AttributeError, TypeError):
        return None


class PeerRouter:
    """One peer router process in front of ``workers``; ``url`` once entered."""

    def __init__(
        self,
        kind: str,
        workers: Sequence[str],
        root: Path = ROOT,
        log_dir: Path | None = None,
        ready_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        if kind not in PEERS:
            raise ValueError(f"unknown peer {kind!r}; known: {', '.join(PEERS)}")
        self.spec = PEERS[kind]
        self.workers = list(workers)
        self.port, self.prom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = peer_command(self.spec, self.port, self.prom_port, self.workers, root) + list(
            extra_args
        )
        self.log_path = (log_dir or Path(tempfile.mkdtemp(prefix="kvgate-peer-"))) / f"{kind}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "peer not started"
        return self.proc.pid

    def start(self) -> None:
        if not Path(self.cmd[0]).exists():
            raise FileNotFoundError(f"{self.cmd[0]} missing: run {INSTALL_HINT}")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **LOOPBACK_ENV},
            start_new_session=True,
        )
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until ``/readiness`` reports every worker healthy; fails early if the peer exits."""
        deadline = time.monotonic() + self.ready_timeout_s
        seen: int | None = None
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.name} exited with {self.proc.returncode}; log: {self.log_path}"
                    )
                seen = _healthy_workers(client, self.url)
                if seen is not None and seen >= len(self.workers):
                    return
                time.sleep(0.2)
        raise TimeoutError(
            f"{self.spec.name}: {seen} of {len(self.workers)} workers healthy after "
            f"{self.ready_timeout_s:.0f} s; log: {self.log_path}"
        )

    def stop(self, timeout_s: float = 10.0) -> int | None:
        code = stop_process(self.proc, timeout_s) if self.proc is not None else None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


@contextlib.contextmanager
def running_peer(kind: str, workers: Sequence[str], **kwargs: Any) -> Iterator[PeerRouter]:
    """A started `PeerRouter` (ready: every worker healthy), stopped on exit."""
    peer = PeerRouter(kind, workers, **kwargs)
    try:
        peer.start()
        yield peer
    finally:
        peer.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.peers.run",
        description="run one peer router on loopback until Ctrl-C",
    )
    parser.add_argument("kind", choices=sorted(PEERS))
    parser.add_argument("workers", nargs="+", help="worker base URLs (loopback)")
    args = parser.parse_args(argv)
    with running_peer(args.kind, args.workers) as peer:
        print(
            f"{peer.spec.version} at {peer.url} (log {peer.log_path}); Ctrl-C to stop", flush=True
        )
        try:
            while peer.proc is not None and peer.proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
