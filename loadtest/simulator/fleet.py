"""Start and stop N simulated replica processes on real ports (tests, demo, harness).

    with SimFleet(3, profile="tiny", time_scale=100.0, seed=1) as fleet:
        httpx.post(fleet.urls[0] + "/v1/chat/completions", json=...)

Each replica is its own ``kvgate sim`` process (``python -m gateway.cli sim ...``) in its
own session, logging to a file; ``__enter__`` returns once every ``/health`` answers 200
(or raises ``TimeoutError``), ``__exit__`` sends SIGTERM (the replicas drain, like
SGLang) and kills whatever is still alive after ``stop_timeout_s``. Ports are free ports
picked at start, or ``base_port + i``. Replica ``i`` gets seed ``seed + i``.
"""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from loadtest.simulator.ports import free_port

HOST = "127.0.0.1"


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
              poll_s: float = 0.05, verify: ssl.SSLContext | bool = True) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits. ``verify``: how an
    https replica's certificate is checked, as httpx takes it."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    with httpx.Client(timeout=2.0, trust_env=False, verify=verify) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
            try:
                r = client.get(url)
                if r.status_code == 200:
                    return
                last = r.status_code
            except httpx.HTTPError as e:
                last = e
            time.sleep(poll_s)
    raise TimeoutError(f"{url} not 200 after {timeout_s}s (last: {last!r})")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int | None:
    """SIGTERM (if still running), wait up to ``timeout_s``, then SIGKILL; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
    """Poll a replica's ``/health`` until 200."""
    wait_http(url + "/health", timeout_s, proc, verify=verify)


class SimFleet:
    """N ``kvgate sim`` replica processes; ``urls[i]`` is replica ``i``'s base URL.

    ``tls``: (certificate file, key file): every replica serves https with them
    (``--ssl-certfile/--ssl-keyfile``), and readiness is checked with the certificate
    file as the CA (a self-signed certificate, or set ``ca_file``)."""

    def __init__(self, n: int, profile: str = "tiny", time_scale: float | None = None,
                 base_port: int | None = None, seed: int = 0, extra_args: Sequence[str] = (),
                 host: str = HOST, log_dir: Path | None = None, ready_timeout_s: float = 30.0,
                 stop_timeout_s: float = 10.0, tls: tuple[str | Path, str | Path] | None = None,
                 ca_file: str | Path | None = None) -> None:
        self.n, self.profile, self.time_scale, self.seed = n, profile, time_scale, seed
        self.extra_args = list(extra_args)
        self.host = host
        self.base_port = base_port
        self.tls = tls
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file or tls[0])) if tls else True
        self.scheme = "https" if tls else "http"
        self.ports = [base_port + i if base_port else free_port(host) for i in range(n)]
        self.urls = [f"{self.scheme}://{host}:{port}" for port in self.ports]
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-sim-fleet-"))
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def command(self, i: int) -> list[str]:
        cmd = [sys.executable, "-m", "gateway.cli", "sim", "--host", self.host,
               "--port", str(self.ports[i]), "--profile", self.profile, "--seed", str(self.seed + i)]
        if self.time_scale is not None:
            cmd += ["--time-scale", repr(self.time_scale)]
        if self.tls is not None:
            cmd += ["--ssl-certfile", str(self.tls[0]), "--ssl-keyfile", str(self.tls[1])]
        return cmd + self.extra_args

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"replica-{i}.log"

    def output(self, i: int) -> str:
        return self.log_path(i).read_text(errors="replace")

    def start(self) -> None:
        for i in range(self.n):
            self._logs.append(open(self.log_path(i), "ab"))  # noqa: SIM115 (closed in stop())
            self.procs.append(self._launch(i))
        for i in range(self.n):
            self._wait_ready(i)

    def _launch(self, i: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(self.command(i), stdout=self._logs[i], stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)

    def _wait_ready(self, i: int, attempts: int = 3) -> None:
        """Wait for replica ``i``; if it died because its free port was taken between
        choosing and binding (another process got it first), relaunch on a new port."""
        for attempt in range(attempts):
            try:
                wait_healthy(self.urls[i], self.ready_timeout_s, self.procs[i], verify=self.verify)
                return
            except RuntimeError:
                if self.base_port or attempt == attempts - 1 or "address already in use" not in self.output(i):
                    raise
            self.ports[i] = free_port(self.host)
            self.urls[i] = f"{self.scheme}://{self.host}:{self.ports[i]}"
            self.procs[i] = self._launch(i)

    def signal(self, i: int, sig: int = signal.SIGTERM) -> None:
        if self.procs[i].poll() is None:
            self.procs[i].send_signal(sig)

    def stop(self) -> list[int | None]:
        """SIGTERM every replica, wait, kill the stragglers; returns the exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for log in self._logs:
            log.close()
        return [proc.returncode for proc in self.procs]

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
