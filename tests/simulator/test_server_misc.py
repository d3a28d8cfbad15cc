"""The official ``openai`` client against the simulator, client disconnects, the fleet CLI."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.fleet import wait_healthy
from loadtest.simulator.ports import free_port

HEADERS = {"content-type": "application/json"}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a haiku about caches."}]


def test_openai_client_non_stream_and_stream(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens is not None
    parts: list[str] = []
    usage = None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) and usage is not None and usage.completion_tokens == 5
    comp = client.completions.create(model="tiny", prompt="hello", max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["tiny"]


def _running(client: httpx.Client) -> int:
    return int(client.get("/v1/loads").json()["loads"][0]["num_running_reqs"])


def test_client_disconnect_aborts_the_request(client: httpx.Client) -> None:
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "long"}],
                         "max_tokens": 3900, "ignore_eos": True, "stream": True})
    with client.stream("POST", "/v1/chat/completions", content=body, headers=HEADERS) as s:
        chunks = s.iter_bytes()  # keep a reference: a collected iterator closes the stream
        next(chunks)
        assert _running(client) == 1
    deadline = time.monotonic() + 10
    while _running(client) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(client) == 0
    assert "sglang:num_aborted_requests_total" in client.get("/metrics").text
    body = orjson.dumps({"text": "long", "sampling_params": {"max_new_tokens": 3900, "ignore_eos": True}})
    try:
        client.put("/generate", content=body, headers=HEADERS, timeout=0.3)
    except httpx.ReadTimeout:
        pass
    deadline = time.monotonic() + 10
    while _running(client) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(client) == 0


def _run_cli(args: list[str], log_path: Path, ports: list[int]) -> str:
    """Start ``kvgate sim ARGS``, wait for every port's /health, SIGTERM it; its output."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for port in ports:
                wait_healthy(f"http://127.0.0.1:{port}", 30.0, proc)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return log_path.read_text()


def test_fleet_cli_starts_and_stops_replicas(tmp_path: Path) -> None:
    base = free_port()
    out = _run_cli(["--replicas", "2", "--base-port", str(base), "--profile", "tiny"],
                   tmp_path / "fleet.log", [base, base + 1])
    assert f"replica 0 listening on http://127.0.0.1:{base}" in out
    assert "fleet stopped" in out
    for port in (base, base + 1):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)


def test_single_replica_cli_announces_itself(tmp_path: Path) -> None:
    port = free_port()
    out = _run_cli(["--port", str(port), "--profile", "tiny", "--time-scale", "100"],
                   tmp_path / "one.log", [port])
    assert f"kvgate sim: replica listening on http://127.0.0.1:{port} profile=tiny time_scale=100" in out


def test_bad_profile_exits_2() -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "sim", "--profile", "no-such-profile"],
                       capture_output=True, timeout=30, check=False)
    assert r.returncode == 2 and b"unknown profile" in r.stderr


@pytest.mark.parametrize("name", ["", "a/b", ".."])
def test_bad_model_name_exits_2(name: str) -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "sim", "--profile", "tiny", "--model", name],
                       capture_output=True, timeout=30, check=False)
    assert r.returncode == 2 and b"--model" in r.stderr
