"""Over real processes: a replica with KV events whose model directory precise mode cannot
reproduce (its tokenizer class is one the gateway does not know) is routed approximately, and
the reason is in the gateway's log, ``/metrics`` and ``/admin/replicas`` (issue 42)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.bench_precise_gateway import EVENTS, profile_file
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway, wait_until

pytestmark = pytest.mark.slow
SERIES = 'kvgate_precise_unreproducible_replicas{reason="unknown_tokenizer_class"}'


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Gateway, str]]:
    name = f"unreproducible-{tmp_path.name}"[:60]
    with SimFleet(1, profile=str(profile_file(tmp_path, name, 4)), time_scale=50.0, seed=3, log_dir=tmp_path,
                  extra_args=("--kv-events-config", EVENTS)) as fleet:
        replica = fleet.urls[0]
        info = httpx.get(replica + "/server_info", timeout=10.0, trust_env=False).json()
        config_path = Path(info["model_path"]) / "tokenizer_config.json"  # this run's own folder
        config = json.loads(config_path.read_text())
        config.pop("kvgate_token_ids", None)
        config["auto_map"] = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
        config_path.write_text(json.dumps(config))
        gw = start_gateway([replica], tmp_path / "gateway.log")
        try:
            yield gw, replica
        finally:
            gw.proc.stop()
    shutil.rmtree(config_path.parent, ignore_errors=True)


def test_the_reason_is_in_the_log_the_metrics_and_the_admin_api(gateway: tuple[Gateway, str]) -> None:
    gw, replica = gateway
    wait_until(lambda: gw.metric(SERIES) == 1.0, 30.0, "the replica reported unreproducible")
    status = gw.replicas()[replica]["precise"]
    assert status["mode"] == "approximate" and status["reason"] == "unknown_tokenizer_class", status
    assert "tokenization_mine.MyTokenizer" in status["detail"]
    assert "cannot be reproduced exactly" in gw.proc.output() and "unknown_tokenizer_class" in gw.proc.output()
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30.0, trust_env=False, json={
        "model": gw.replicas()[replica]["models"][0], "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == replica
    assert gw.metric('kvgate_precise_replicas{state="precise"}') == 0.0
