"""A replica whose model directory precise mode cannot reproduce exactly stays approximate, and
says why: a WARNING in the log, ``kvgate_precise_unreproducible_replicas{reason}``, and
``PreciseMode.replica_status`` (what ``/admin/replicas`` shows). Over a real gateway process:
tests/kv_events/test_precise_unreproducible_process.py."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gateway.kv_wiring import PreciseMode
from gateway.metrics import GatewayMetrics
from policies.base import RequestContext, SessionKeys
from prefix_index.base import ReplicaId
from prefix_index.config import IndexConfig
from tests.kv_events.kimi_dir import write_kimi_model

A = ReplicaId("http://127.0.0.1:1")


def info(model: Path | str) -> dict[str, Any]:
    return {"model_path": str(model), "page_size": 4, "startup_time": 1.0,
            "kv_events": {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": 1,
                          "topic": "kv", "block_size": 4, "dp_size": 1}}


async def discover(model: Path | str, config: IndexConfig | None = None) -> tuple[PreciseMode, GatewayMetrics, bool]:
    async def fetch(url: str) -> dict[str, Any]:
        return info(model)

    metrics = GatewayMetrics()
    mode = PreciseMode(config or IndexConfig(), fetch, metrics=metrics)
    return mode, metrics, await mode.discover(A)


@pytest.mark.parametrize("damage, reason", [
    ("unknown_class", "unknown_tokenizer_class"), ("no_ranks", "missing_files"), ("template", "template_error"),
    ("not_local", "no_local_tokenizer")])
async def test_unreproducible_replicas_are_approximate_with_their_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, reason: str) -> None:
    model: Path | str = (write_kimi_model(tmp_path / "m", template="{% if %}") if damage == "template"
                         else write_kimi_model(tmp_path / "m"))
    if damage == "unknown_class":
        path = tmp_path / "m" / "tokenizer_config.json"
        path.write_text(path.read_text().replace("tokenization_kimi.", "tokenization_mine."))
    elif damage == "no_ranks":
        (tmp_path / "m" / "tiktoken.model").unlink()
    elif damage == "not_local":
        model = "moonshotai/Kimi-K2.6"
    with caplog.at_level(logging.WARNING, logger="kvgate.precise"):
        mode, metrics, precise = await discover(model)
    try:
        assert not precise and mode.precise_replicas() == []
        status = mode.replica_status(A)
        assert status["mode"] == "approximate" and status["reason"] == reason, status
        assert metrics.precise_unreproducible.labels(reason)._value.get() == 1
        assert any(reason in r.getMessage() and "routed approximately" in r.getMessage() for r in caplog.records)
        ctx = RequestContext("r", "chat", "m", SessionKeys("s"), (), 10, 3, 4,
                             payload={"messages": [{"role": "user", "content": "hi"}]})
        assert await mode.lookup(ctx, [A]) is None
        mode.on_removed(A)
        assert metrics.precise_unreproducible.labels(reason)._value.get() == 0
    finally:
        await mode.close()


async def test_a_reproducible_tiktoken_dir_is_subscribed(tmp_path: Path) -> None:
    mode, metrics, precise = await discover(write_kimi_model(tmp_path / "m"))
    try:
        assert precise
        status = mode.replica_status(A)
        assert status["mode"] == "joining" and status["tokenizer"] == "tiktoken"  # no publisher here: never live
        assert all(metrics.precise_unreproducible.labels(r)._value.get() == 0 for r in ("unknown_tokenizer_class",
                                                                                          "template_error"))
    finally:
        await mode.close()
