"""Check that sglang-router 0.3.2 runs against a simulated replica, on loopback only.

    python loadtest/peers/check_sglang_router.py [--root DIR] [--timeout-s 60]

Starts one simulated replica (``kvgate sim``, tiny profile) and the router from
``.venv-peers/sglang-router`` (``bash loadtest/peers/install.sh`` installs it) with the
loopback settings of the peers reference: proxies and the model hub pointed at a dead
local port, ``--host 127.0.0.1 --prometheus-host 127.0.0.1``, ``--log-level warn``.
Waits for ``GET /readiness`` 200, sends one streaming chat request through the router
and checks that the replica's SSE stream arrives intact. Prints PASS or FAIL (exit 0/1).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtest.simulator.fleet import SimFleet, stop_process, wait_http
from loadtest.simulator.ports import free_port

LOOPBACK_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


def router_command(python: Path, port: int, prom_port: int, workers: list[str]) -> list[str]:
    return [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *workers, "--policy", "cache_aware",
            "--cache-threshold", "0.3", "--balance-abs-threshold", "64",
            "--balance-rel-threshold", "1.5", "--eviction-interval-secs", "60",
            "--max-tree-size", "67108864", "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]


def stream_through(url: str) -> tuple[int, int, str]:
    """One streaming chat request; returns (content chunks, completion tokens, text)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello through the router"}],
            "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, tokens, text = 0, -1, ""
    done = False
    with httpx.Client(timeout=30.0, trust_env=False) as client, \
            client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body),
                          headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    chunks += 1
                    text += piece
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not done:
        raise AssertionError("stream ended without data: [DONE]")
    return chunks, tokens, text


def check(root: Path, timeout_s: float) -> str:
    """Run the check; returns a one-line description (raises on failure)."""
    python = root / ".venv-peers" / "sglang-router" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run bash loadtest/peers/install.sh")
    logs = Path(tempfile.mkdtemp(prefix="kvgate-peer-check-"))
    with SimFleet(1, profile="tiny", time_scale=50.0, log_dir=logs) as fleet:
        port, prom = free_port(), free_port()
        log = open(logs / "router.log", "wb")  # noqa: SIM115 (lives as long as the router)
        env = {**os.environ, **LOOPBACK_ENV}
        proc = subprocess.Popen(router_command(python, port, prom, fleet.urls), stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/readiness", timeout_s, proc, poll_s=0.2)
            chunks, tokens, text = stream_through(url)
        finally:
            stop_process(proc)
            log.close()
    if chunks < 1 or tokens != 8 or not text:
        raise AssertionError(f"unexpected stream: chunks={chunks} tokens={tokens} text={text!r} "
                             f"(logs in {logs})")
    return f"{chunks} content chunks, {tokens} tokens, text {text[:40]!r}... (logs in {logs})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        detail = check(args.root, args.timeout_s)
    except (OSError, RuntimeError, AssertionError, httpx.HTTPError) as e:
        print(f"FAIL sglang-router 0.3.2 vs simulated replica: {type(e).__name__}: {e}")
        return 1
    print(f"PASS sglang-router 0.3.2 vs simulated replica: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
