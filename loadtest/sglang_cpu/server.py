"""One real SGLang 0.5.23 server on the CPU: launch command, environment, process tree.

    servers = [SGLangServer(ensure_env(), ServerSpec(port=AUTO_PORT, max_total_tokens=16384), log)]
    start_all(servers)  # returns once every /health answers 200 (url known from here on)
    httpx.get(servers[0].url + "/v1/models", trust_env=False)
    stop_all(servers)

The server is ``python -m sglang.launch_server`` with the flags that work on a CPU-only
machine (``tools/sglang_cpu/README.md``), in its own session (``start_new_session``) so
that :meth:`SGLangServer.stop` can signal the whole tree (tokenizer manager, scheduler,
detokenizer) with ``killpg``: SIGTERM (SGLang drains, then exits), wait, then SIGKILL.
Everything is on 127.0.0.1 and offline: the hub and proxy variables point at a closed
local port, so clients must not read proxy variables either (``trust_env=False``).

Ports. An SGLang server binds its HTTP port only when it is ready, 30-90 s after it
starts; a port taken from ``bind(0)`` (the kernel's ephemeral range) can be handed to
another socket in that window (a CI run lost one to another server's listening socket
and waited 240 s on it). So :func:`late_bind_port` picks ports below the ephemeral range
and below SGLang's own late-bound ``nccl_port`` range (22000-29999), never twice in one
process; and a server started with ``port=AUTO_PORT`` that still finds its port taken is
restarted on a fresh one (:meth:`SGLangServer.wait_healthy`).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import httpx

from loadtest.sglang_cpu.env import SGLangEnv

HOST = "127.0.0.1"
SERVED_MODEL_NAME = "tiny-llama"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--mem-fraction-static", "0.05", "--enable-cache-report", "--grammar-backend", "none",
             "--sleep-on-idle", "--enable-metrics")
OFFLINE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "HF_ENDPOINT": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1",
}
START_TIMEOUT_S = 240.0
AUTO_PORT = 0  # ServerSpec.port: pick one with late_bind_port(), re-pick on a collision
LATE_BIND_PORTS = range(12000, 22000)  # below SGLang's nccl_port range and the ephemeral range
BIND_ERROR = "error while attempting to bind on address"  # uvicorn's line for EADDRINUSE
PORT_ATTEMPTS = 3
_handed_out: set[int] = set()


def late_bind_port(host: str = HOST) -> int:
    """A free port for a socket that a child process binds only much later."""
    candidates = [p for p in LATE_BIND_PORTS if p not in _handed_out]
    for port in random.sample(candidates, min(256, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {LATE_BIND_PORTS} on {host}")


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port: another socket holds it."""
HEALTH_TIMEOUT_S = 10.0  # /health runs a 1-token generation (~1 s)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    port: int
    host: str = HOST
    max_total_tokens: int = 16384
    page_size: int | None = None
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557 (the PUB connects)
    kv_events_replay_endpoint: str | None = None  # the ROUTER replaying buffered batches (SGLang binds it)
    served_model_name: str = SERVED_MODEL_NAME
    extra_args: tuple[str, ...] = ()  # appended last, e.g. ("--max-running-requests", "4")

    def args(self, model_dir: Path) -> list[str]:
        args = ["--model-path", str(model_dir), "--served-model-name", self.served_model_name,
                "--host", self.host, "--port", str(self.port),
                "--max-total-tokens", str(self.max_total_tokens), *CPU_FLAGS]
        if self.page_size is not None:
            args += ["--page-size", str(self.page_size)]
        if self.kv_events_endpoint is not None:
            config = {"publisher": "zmq", "endpoint": self.kv_events_endpoint, "topic": "kv"}
            if self.kv_events_replay_endpoint is not None:
                config["replay_endpoint"] = self.kv_events_replay_endpoint
            args += ["--kv-events-config", json.dumps(config)]
        return [*args, *self.extra_args]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)  # the project's paths must not shadow the venv's packages
    env.update(OFFLINE_ENV)
    return env


class SGLangServer:
    """A real SGLang server process tree; ``url`` is its base URL."""

    def __init__(self, env: SGLangEnv, spec: ServerSpec, log_path: Path,
                 model_dir: Path | None = None) -> None:
        self.auto_port = spec.port == AUTO_PORT
        if self.auto_port:
            spec = replace(spec, port=late_bind_port(spec.host))
        self.env, self.spec, self.log_path = env, spec, log_path
        self.model_dir = model_dir or env.model_dir
        self.url = f"http://{spec.host}:{spec.port}"
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0  # where this start's output begins in the (appended) log

    def command(self) -> list[str]:
        return [str(self.env.python), "-m", "sglang.launch_server", *self.spec.args(self.model_dir)]

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self._log_start = self._log.tell()
        self.popen = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                      env=server_env(), start_new_session=True)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for ``/health`` to answer 200. A server on an automatic port that finds the
        port taken is restarted on a fresh one (``url`` changes), up to ``PORT_ATTEMPTS``
        times; on a fixed port that is :class:`PortTaken` at once."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._wait_healthy_once(timeout_s)
                return
            except PortTaken:
                if not self.auto_port or attempt == PORT_ATTEMPTS:
                    raise
            self.stop()
            self.spec = replace(self.spec, port=late_bind_port(self.spec.host))
            self.url = f"http://{self.spec.host}:{self.spec.port}"
            self.start()

    def _wait_healthy_once(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; ``RuntimeError`` if the server exits first,
        :class:`PortTaken` as soon as its log says the port could not be bound."""
        log_start = self._log_start
        deadline = time.monotonic() + timeout_s
        last: object = None
        with httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._bind_failed(log_start):  # first: whoever answers there is not this server
                    raise PortTaken(f"SGLang could not bind {self.url}:\n{self.tail()}")
                if self.popen is None or self.popen.poll() is not None:
                    code = None if self.popen is None else self.popen.returncode
                    raise RuntimeError(f"SGLang on {self.url} exited ({code}):\n{self.tail()}")
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code == 200 and not self._bind_failed(log_start):
                        return
                    last = r.status_code
                except httpx.HTTPError as e:
                    last = e
                time.sleep(0.5)
        raise TimeoutError(f"SGLang on {self.url} not healthy after {timeout_s:.0f}s "
                           f"(last: {last!r}):\n{self.tail()}")

    def _bind_failed(self, log_start: int) -> bool:
        """Whether this start's part of the log (from byte ``log_start``) has the bind error."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_start)
                return BIND_ERROR.encode() in f.read()
        except OSError:
            return False

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group."""
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the tree, wait up to ``timeout_s``, then SIGKILL whatever is left."""
        code = None
        if self.popen is not None:
            self.signal(signal.SIGTERM)
            try:
                code = self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            kill_group(self.popen.pid)
            if code is None:
                code = self.popen.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


def kill_group(pgid: int) -> None:
    """SIGKILL every process still in group ``pgid`` (children the leader left behind)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_all(servers: list[SGLangServer], timeout_s: float = START_TIMEOUT_S) -> None:
    """Start every server (they warm up in parallel), wait for each; stop all on failure."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(timeout_s)
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: list[SGLangServer]) -> None:
    for server in servers:
        server.signal(signal.SIGTERM)  # all drain at once
    for server in servers:
        server.stop()
