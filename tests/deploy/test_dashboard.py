"""Every metric the Grafana dashboard and the PrometheusRule query is really exported.

The exported names come from the running code, not from a list: the gateway's from
``gateway.metrics.GatewayMetrics()`` (every family its registry declares, labelled or
not), the replica's from the ``/metrics`` of a real ``kvgate sim`` process (SGLang
0.5.23's names, labels and buckets). Each panel's PromQL is parsed for metric names
(``tests/deploy/promql.py``); a name must be exported by one of them, be a recording rule
of ``deploy/base/prometheusrule.yaml`` (whose own names are checked the same way), or be
in ``REAL_SGLANG_ONLY``: real SGLang series the simulator does not export, each with its
reason, each checked to be in the SGLang contract (§1.6) and absent from the simulator.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from loadtest.simulator.fleet import SimFleet
from tests.deploy.k8s import DEPLOY
from tests.deploy.promql import metric_names

DASHBOARD = DEPLOY / "base" / "kvgate-dashboard.json"
RULES = DEPLOY / "base" / "prometheusrule.yaml"
CONTRACT = Path(__file__).resolve().parents[3] / "shared" / "reference" / "sglang-0.5.23-contract.md"  # ../shared

# real SGLang (0.5.23) series the simulated replica does not export -> why the dashboard uses it
REAL_SGLANG_ONLY: dict[str, str] = {
    "sglang:queue_time_seconds": "time a request waits in SGLang's scheduler queue before prefill: the "
                                 "simulator models queueing but exports no queue-time histogram",
}
# the fleet rows the issue asks for (per replica, from SGLang's own series)
REQUIRED_REPLICA_SERIES = {
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds", "sglang:spec_accept_length",
    "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
}
REQUIRED_GATEWAY_SERIES = {
    "kvgate_route_decisions_total", "kvgate_index_degraded_total", "kvgate_upstream_retries_total",
    "kvgate_replica_ejections_total", "kvgate_replica_ejected", "kvgate_requests_rejected_total",
    "kvgate_admin_requests_total", "kvgate_predicted_cached_tokens_total", "kvgate_reported_cached_tokens_total",
}


def exported(families: Iterable[Any]) -> set[str]:
    """Names as queried: counters with ``_total``, histograms and gauges by family name."""
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


@pytest.fixture(scope="module")
def gateway_names() -> set[str]:
    return exported(GatewayMetrics().registry.collect())


@pytest.fixture(scope="module")
def replica_names() -> set[str]:
    with SimFleet(1, profile="tiny", seed=11) as fleet:
        text = httpx.get(f"{fleet.urls[0]}/metrics", timeout=10.0).text
    return exported(text_string_to_metric_families(text))


def recording_rules() -> dict[str, str]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return {r["record"]: r["expr"] for g in spec["groups"] for r in g["rules"] if "record" in r}


def alert_exprs() -> dict[str, str]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return {r["alert"]: r["expr"] for g in spec["groups"] for r in g["rules"] if "alert" in r}


def dashboard_queries() -> dict[str, list[str]]:
    """Panel title -> its expressions; the template variables' queries as one more 'panel'."""
    board = json.loads(DASHBOARD.read_text())
    queries = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in board["panels"] if p["type"] != "row"}
    variables = [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    # label_values(<selector>, <label>): only the selector names a metric
    queries["(variables)"] = [re.sub(r"label_values\((.*),\s*\w+\)", r"\1", q) for q in variables]
    return queries


def unknown(names: set[str], known: set[str]) -> set[str]:
    return {n for n in names if n not in known}


def test_dashboard_queries_use_exported_names(gateway_names: set[str], replica_names: set[str]) -> None:
    known = gateway_names | replica_names | set(recording_rules()) | set(REAL_SGLANG_ONLY)
    problems = {}
    for title, exprs in dashboard_queries().items():
        assert exprs, f"panel {title!r} has no query"
        names = set().union(*(metric_names(e) for e in exprs))
        assert names, f"panel {title!r}: no metric name found"
        if missing := unknown(names, known):
            problems[title] = sorted(missing)
    assert not problems, f"names neither exported nor recorded nor allow-listed: {problems}"


def test_rules_use_exported_names(gateway_names: set[str], replica_names: set[str]) -> None:
    rules = recording_rules()
    known = gateway_names | replica_names | set(REAL_SGLANG_ONLY)
    for record, expr in rules.items():
        assert not unknown(metric_names(expr), known | set(rules)), record
    for alert, expr in alert_exprs().items():
        assert not unknown(metric_names(expr), known | set(rules)), alert


def resolved(names: set[str]) -> set[str]:
    """Names with recording rules replaced by the names their expressions use."""
    rules = recording_rules()
    out: set[str] = set()
    for name in names:
        out |= resolved(metric_names(rules[name])) if name in rules else {name}
    return out


def test_dashboard_covers_fleet_and_gateway() -> None:
    used = resolved(set().union(*(metric_names(e) for es in dashboard_queries().values() for e in es)))
    assert REQUIRED_REPLICA_SERIES <= used, REQUIRED_REPLICA_SERIES - used
    assert REQUIRED_GATEWAY_SERIES <= used, REQUIRED_GATEWAY_SERIES - used
    titles = json.loads(DASHBOARD.read_text())["panels"]
    assert [p["title"] for p in titles if p["type"] == "row"][:2] == [
        "Gateway", "Fleet: SGLang replicas (their own sglang:* series)"]


def test_allow_list_is_needed(replica_names: set[str]) -> None:
    for name, reason in REAL_SGLANG_ONLY.items():
        assert name not in replica_names, f"{name} is exported by the simulator now: drop it from the allow-list"
        assert len(reason) > 20


@pytest.mark.skipif(not CONTRACT.is_file(), reason="../shared/reference not on this machine")
def test_allow_list_is_real() -> None:
    contract = CONTRACT.read_text()
    section = contract[contract.index("### 1.6"):contract.index("### 1.7")]
    for name in REAL_SGLANG_ONLY:
        assert f"`{name}`" in section, f"{name} is not a SGLang 0.5.23 metric (contract §1.6)"


def test_name_check_has_teeth(gateway_names: set[str], replica_names: set[str]) -> None:
    assert "kvgate_requests_total" in gateway_names and "kvgate_request_ttft_seconds" in gateway_names
    assert "kvgate_admin_requests_total" in gateway_names  # labelled, no child yet: still declared
    assert "sglang:num_queue_reqs" in replica_names and "sglang:time_to_first_token_seconds" in replica_names
    bad = metric_names('sum(rate(kvgate_request_total{namespace="$namespace"}[5m])) / sglang:num_queued_reqs')
    assert unknown(bad, gateway_names | replica_names) == {"kvgate_request_total", "sglang:num_queued_reqs"}
