"""Real processes for integration tests: free ports, start/stop, wait for HTTP.

Every wait has a timeout; every process started is killed at teardown.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from loadtest.simulator.ports import free_port

__all__ = ["Proc", "bench_tool", "free_port", "kvgate_cmd", "running", "wait_http"]  # free_port: the one helper, re-exported

ROOT = Path(__file__).resolve().parents[2]


def wait_http(url: str, timeout_s: float = 20.0, ok: Sequence[int] = (200,),
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers one of ``ok``; ``TimeoutError`` at the deadline, or at
    once when ``proc`` (the server being waited for) has exited."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"{url}: the server process exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code in ok:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s (last: {last!r})")


class Proc:
    """A child process with its output captured to a log file."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.popen = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=str(ROOT),
            start_new_session=True,
        )

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running(args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[Proc]:
    proc = Proc(args, log_path, env)
    try:
        yield proc
    finally:
        proc.stop()


def kvgate_cmd(*args: str) -> list[str]:
    """The `kvgate` CLI run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "gateway.cli", *args]


def bench_tool(script: str, *args: str, timeout_s: float = 120.0) -> str:
    """Run ``tools/bench/<script>`` with ``args`` in the repository; its stdout (exit 0 asserted)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / script), *args],
                         capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout
