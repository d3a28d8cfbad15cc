"""Third-party benchmark clients against `kvgate serve` in front of simulated replicas, with
no tokenizer workaround: aiperf 0.13.0 (multi-turn conversations, ``--session-header``) and
inference-perf 0.7.0 (shared-prefix multi-turn chat), each loading the Hugging Face
tokenizer from the folder the replicas report as ``model_path`` (``GET /model_info``).

The tools live in ``~/.cache/kvgate/bench/`` (``tools/bench/install.sh``, idempotent; the first run
downloads them from the package index). Everything runs on 127.0.0.1; the model hub and
proxies point at a closed local port. aiperf 0.13.0 rejects a local tokenizer path under
``HF_HUB_OFFLINE=1`` (docs/results-sglang-cpu.md), so the hub is closed that way instead.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.sglang_cpu.env import cache_dir
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway
from tests.support.procs import ROOT

BENCH = cache_dir() / "bench"  # tools/bench/install.sh's default
CLOSED = "http://127.0.0.1:9"
LOOPBACK = {"HF_ENDPOINT": CLOSED, "HTTP_PROXY": CLOSED, "HTTPS_PROXY": CLOSED, "http_proxy": CLOSED,
            "https_proxy": CLOSED, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def tools() -> Path:
    done = subprocess.run(["bash", str(ROOT / "tools" / "bench" / "install.sh"), str(BENCH)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return BENCH


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    """(gateway, tokenizer folder) over two simulated tiny-cpu replicas in real time."""
    logs = tmp_path_factory.mktemp("bench-tools")
    with SimFleet(2, profile="tiny-cpu", time_scale=1.0, seed=3, log_dir=logs) as fleet:
        gw = start_gateway(fleet.urls, logs / "gateway.log")
        try:
            info = httpx.get(fleet.urls[0] + "/model_info", timeout=10.0).json()
            assert Path(info["model_path"], "tokenizer.json").is_file(), info
            yield gw, info["model_path"]
        finally:
            gw.proc.stop()


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, **LOOPBACK})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_aiperf_multi_turn(tools: Path, served: tuple[Gateway, str], tmp_path: Path) -> None:
    gw, tokenizer = served
    _run([str(tools / "aiperf" / "bin" / "aiperf"), "profile", "--model", "tiny-llama", "--url", gw.url,
          "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
          "--conversation-num", "4", "--conversation-turn-mean", "3", "--conversation-turn-stddev", "0",
          "--prompt-input-tokens-mean", "300", "--prompt-input-tokens-stddev", "0",
          "--prompt-output-tokens-mean", "8", "--prompt-output-tokens-stddev", "0", "--concurrency", "2",
          "--request-count", "12", "--session-header", "x-kvgate-session", "--random-seed", "7",
          "--extra-inputs", "ignore_eos:true", "--output-artifact-dir", "out", "--ui", "none"], tmp_path)
    result = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == 12, result["request_count"]
    assert not result.get("error_summary"), result["error_summary"]
    assert result["overall_usage_prompt_cache_read_pct"]["avg"] > 50, result["overall_usage_prompt_cache_read_pct"]
    # aiperf counts the text it sent with the replicas' tokenizer: within 10% of their usage
    assert abs(result["usage_prompt_tokens_diff_pct"]["avg"]) < 10, result["usage_prompt_tokens_diff_pct"]


INFERENCE_PERF_CONFIG = """\
api: {{type: chat, streaming: true}}
data:
  type: shared_prefix
  shared_prefix: {{num_groups: 2, num_prompts_per_group: 3, system_prompt_len: 200, question_len: 40,
                  output_len: 8, enable_multi_turn_chat: true}}
load: {{type: constant, stages: [{{rate: 4, duration: 4}}], num_workers: 1}}
server: {{type: sglang, model_name: tiny-llama, base_url: "{url}", ignore_eos: true}}
tokenizer: {{pretrained_model_name_or_path: "{tokenizer}"}}
storage: {{local_storage: {{path: "{out}"}}}}
report: {{request_lifecycle: {{summary: true}}}}
"""


def test_inference_perf_shared_prefix_multi_turn(tools: Path, served: tuple[Gateway, str], tmp_path: Path) -> None:
    gw, tokenizer = served
    config = tmp_path / "config.yaml"
    config.write_text(INFERENCE_PERF_CONFIG.format(url=gw.url, tokenizer=tokenizer, out=tmp_path / "out"))
    _run([str(tools / "inference-perf" / "bin" / "inference-perf"), "-c", str(config)], tmp_path)
    summary = json.loads((tmp_path / "out" / "summary_lifecycle_metrics.json").read_text())
    assert summary["successes"]["count"] >= 12, summary["successes"]["count"]
    assert summary["failures"]["count"] == 0, summary["failures"]
