"""Third-party benchmark clients against `kvgate serve` in front of simulated replicas, with
no tokenizer workaround: aiperf 0.13.0 (multi-turn conversations, ``--session-header``),
inference-perf 0.7.0 (shared-prefix multi-turn chat) and guidellm 0.8.1 (synthetic text),
each loading the Hugging Face tokenizer from the folder the gateway reports as
``model_path`` (``GET /model_info``, relayed from a replica), and SGLang 0.5.23's
``bench_serving --flush-cache``, which finds that folder through ``/model_info`` by itself.

aiperf, inference-perf and guidellm live in ``~/.cache/kvgate/bench/`` (``tools/bench/install.sh``,
idempotent; the first run downloads them from the package index); ``bench_serving`` is the
CPU SGLang venv's (``loadtest.sglang_cpu.env``, marker ``sglang_real``: it fails, never
skips, when that venv cannot be built). Everything runs on 127.0.0.1; the model hub and
proxies point at a closed local port. aiperf 0.13.0 rejects a local tokenizer path under
``HF_HUB_OFFLINE=1`` (docs/results-sglang-cpu.md), so the hub is closed that way instead.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from loadtest.sglang_cpu.env import cache_dir, ensure_venv
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import ADMIN_TOKEN, Gateway, start_gateway
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


class Served(NamedTuple):
    gw: Gateway
    tokenizer: str  # the folder the gateway's /model_info reports as model_path
    replicas: list[str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A gateway over two simulated tiny-cpu replicas in real time."""
    logs = tmp_path_factory.mktemp("bench-tools")
    with SimFleet(2, profile="tiny-cpu", time_scale=1.0, seed=3, log_dir=logs) as fleet:
        gw = start_gateway(fleet.urls, logs / "gateway.log")
        try:
            info = httpx.get(gw.url + "/model_info", timeout=10.0, trust_env=False).json()
            assert Path(info["model_path"], "tokenizer.json").is_file(), info
            yield Served(gw, info["model_path"], fleet.urls)
        finally:
            gw.proc.stop()


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, **LOOPBACK, **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_aiperf_multi_turn(tools: Path, served: Served, tmp_path: Path) -> None:
    gw, tokenizer, _ = served
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


def test_inference_perf_shared_prefix_multi_turn(tools: Path, served: Served, tmp_path: Path) -> None:
    gw, tokenizer, _ = served
    config = tmp_path / "config.yaml"
    config.write_text(INFERENCE_PERF_CONFIG.format(url=gw.url, tokenizer=tokenizer, out=tmp_path / "out"))
    _run([str(tools / "inference-perf" / "bin" / "inference-perf"), "-c", str(config)], tmp_path)
    summary = json.loads((tmp_path / "out" / "summary_lifecycle_metrics.json").read_text())
    assert summary["successes"]["count"] >= 12, summary["successes"]["count"]
    assert summary["failures"]["count"] == 0, summary["failures"]


def test_guidellm_synthetic(tools: Path, served: Served, tmp_path: Path) -> None:
    """guidellm takes its tokenizer from ``--tokenizer`` or else loads the model id of
    ``/v1/models`` ("tiny-llama") from the hub: it does not ask ``/model_info``, so it is
    given the folder the gateway reports there."""
    gw, tokenizer, _ = served
    _run([str(tools / "guidellm" / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={gw.url}",
          "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=12",
          "--data", "kind=synthetic_text,prompt_tokens=200,output_tokens=8",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--seed", "kind=static,value=7",
          "--output", "kind=json,path=out.json", "--disable-progress"], tmp_path)
    (bench,) = json.loads((tmp_path / "out.json").read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": 12, "errored": 0, "incomplete": 0, "total": 12}
    assert all(r["output_tokens"] == 8 for r in bench["requests"]["successful"])
    gw.assert_quiet()


PROBE = "probe " + " ".join(str(i) for i in range(60))  # shares no prefix with the benchmark's text


def _cached_tokens(replica: str, text: str) -> int:
    """One chat request straight to a replica: the prompt tokens it found in its cache."""
    r = httpx.post(replica + "/v1/chat/completions", timeout=30.0, trust_env=False,
                   json={"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    r.raise_for_status()
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _sharegpt(path: Path, rows: int) -> Path:
    """A small file in ShareGPT's shape: ``--dataset-name random`` takes its text from one
    (offline, instead of downloading ShareGPT from the hub)."""
    rng = random.Random(5)
    words = ("the", "gateway", "keeps", "each", "conversation", "on", "a", "replica", "that", "holds", "its", "prefix")
    turns = [[{"from": "human", "value": " ".join(rng.choices(words, k=120))},
              {"from": "gpt", "value": " ".join(rng.choices(words, k=30))}] for _ in range(rows)]
    path.write_text(json.dumps([{"id": str(i), "conversations": t} for i, t in enumerate(turns)]))
    return path


@pytest.mark.sglang_real
def test_sglang_bench_serving_flush_cache(served: Served, tmp_path: Path) -> None:
    """``python -m sglang.bench_serving --backend sglang --flush-cache`` against the gateway:
    it finds the tokenizer through ``/model_info``, sends the flush with
    ``Authorization: Bearer $OPENAI_API_KEY`` (here the admin token), and the flush reaches
    both replicas: a prompt each had cached just before the run is gone from both after it.
    ``HF_HUB_OFFLINE=1``: bench_serving also loads the model id ("tiny-llama") as a
    tokenizer, only to warn about chat templates; against the closed hub port that costs
    46 s of retries, offline it fails at once (the tokenizer still comes from /model_info)."""
    gw, _, replicas = served
    python = ensure_venv()  # raises (the test fails) when the SGLang venv cannot be built
    for replica in replicas:
        _cached_tokens(replica, PROBE)
        assert _cached_tokens(replica, PROBE) > 20, replica  # cached now
    flushes = 'kvgate_admin_requests_total{route="/flush_cache",status="200"}'
    before = gw.metric(flushes)
    _run([str(python), "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", gw.url,
          "--dataset-name", "random", "--dataset-path", str(_sharegpt(tmp_path / "sharegpt.json", 16)),
          "--num-prompts", "8", "--random-input-len", "256", "--random-output-len", "8",
          "--random-range-ratio", "1", "--max-concurrency", "2", "--seed", "7", "--flush-cache",
          "--output-file", "out.jsonl", "--disable-tqdm"], tmp_path,
         env={"OPENAI_API_KEY": ADMIN_TOKEN, "HF_HUB_OFFLINE": "1"})
    *_, result = (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
    assert result["completed"] == 8, result
    assert result["total_output_tokens"] == 8 * 8, result
    assert gw.metric(flushes) == before + 1  # 200: every replica answered its /flush_cache with 200
    assert [_cached_tokens(r, PROBE) for r in replicas] == [0, 0]  # the flush reached both
    gw.assert_quiet()
