"""``kvgate sglang-cpu``: real SGLang 0.5.23 server(s) on the CPU with the tiny local model.

    kvgate sglang-cpu --port 30000
    kvgate sglang-cpu --replicas 2 --base-port 30000 --max-total-tokens 16384
    kvgate sglang-cpu --tokenizer tiktoken   # the tiny model with Kimi K2's TikToken tokenizer form

Builds the environment (``tools/sglang_cpu/install.sh``) and the tiny model first when
they are missing (once per machine, cached in ``~/.cache/kvgate``), starts the server(s),
prints ``listening: URL`` for each once ``/health`` answers, and on SIGTERM or SIGINT
stops every process tree (SIGTERM, wait, SIGKILL). Exits 1 if a server dies.
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from loadtest.sglang_cpu.env import EnvError, SGLangEnv, ensure_env, ensure_tiktoken_model
from loadtest.sglang_cpu.server import (
    HOST,
    SERVED_MODEL_NAME,
    ServerSpec,
    SGLangServer,
    start_all,
    stop_all,
)

TIKTOKEN_MODEL_NAME = "tiny-kimi"

DEFAULT_PORT = 30000


class _Stop(Exception):
    """Raised by the signal handler to leave the wait loop."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=HOST, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of a single server")
    parser.add_argument("--max-total-tokens", type=int, default=16384,
                        help="KV pool size in tokens (default 16384)")
    parser.add_argument("--page-size", type=int, default=None, help="KV page (block) size")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="ZMQ endpoint of the KV-event publisher, e.g. tcp://127.0.0.1:5557 "
                             "(with --replicas N, replica i uses port + i)")
    parser.add_argument("--kv-events-replay-endpoint", default=None,
                        help="ZMQ ROUTER endpoint replaying buffered KV-event batches (the server binds it), "
                             "e.g. tcp://127.0.0.1:5600 (with --replicas N, replica i uses port + i)")
    parser.add_argument("--replicas", type=int, default=1, help="number of servers (at most 3)")
    parser.add_argument("--base-port", type=int, default=None,
                        help="with --replicas: server i listens on base-port + i")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    parser.add_argument("--tokenizer", choices=("json", "tiktoken"), default="json",
                        help="the tiny model's tokenizer form: json (tokenizer.json, served as tiny-llama) or "
                             "tiktoken (Kimi K2's tiktoken.model + tokenization_kimi.py, loaded with "
                             "--trust-remote-code, served as tiny-kimi)")


def specs(args: argparse.Namespace) -> list[ServerSpec]:
    base = args.base_port if args.base_port is not None else args.port
    tiktoken = getattr(args, "tokenizer", "json") == "tiktoken"
    name, extra = (TIKTOKEN_MODEL_NAME, ("--trust-remote-code",)) if tiktoken else (SERVED_MODEL_NAME, ())
    return [ServerSpec(port=base + i, host=args.host, max_total_tokens=args.max_total_tokens,
                       page_size=args.page_size,
                       kv_events_endpoint=_endpoint(args.kv_events_endpoint, i),
                       kv_events_replay_endpoint=_endpoint(args.kv_events_replay_endpoint, i),
                       served_model_name=name, extra_args=extra)
            for i in range(args.replicas)]


def model_dir(args: argparse.Namespace, env: SGLangEnv) -> Path:
    """The model the servers load: the tiny model, or its TikToken-form twin (built on first use)."""
    return ensure_tiktoken_model(env.python) if args.tokenizer == "tiktoken" else env.model_dir


def _endpoint(endpoint: str | None, i: int) -> str | None:
    if endpoint is None or i == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + i}"


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.replicas <= 3:
        print("sglang-cpu: --replicas must be 1..3 (each server takes ~2.1 GB)", file=sys.stderr)
        return 2
    try:
        env = ensure_env()
        model = model_dir(args, env)
    except EnvError as e:
        print(f"sglang-cpu: {e}", file=sys.stderr)
        return 1
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvgate-sglang-cpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = [SGLangServer(env, spec, log_dir / f"sglang-{spec.port}.log", model) for spec in specs(args)]
    print(f"sglang-cpu: starting {len(servers)} server(s) with {model} (logs: {log_dir})",
          flush=True)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        t0 = time.monotonic()
        start_all(servers)
        for server in servers:
            print(f"sglang-cpu: listening: {server.url} (ready in {time.monotonic() - t0:.0f}s)",
                  flush=True)
        return _watch(servers)
    except _Stop:
        print("sglang-cpu: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"sglang-cpu: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        stop_all(servers)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(servers: list[SGLangServer]) -> int:
    """Sleep until a signal arrives (``_Stop``) or a server exits (returns 1)."""
    while True:
        for server in servers:
            if server.popen is not None and server.popen.poll() is not None:
                print(f"sglang-cpu: server {server.url} exited with {server.popen.returncode}:\n"
                      f"{server.tail()}", file=sys.stderr)
                return 1
        time.sleep(0.5)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop
