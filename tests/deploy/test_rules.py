"""The PrometheusRule passes ``promtool check rules`` and its unit tests
(``deploy/rules-tests.yaml``: every alert both firing and not firing), and
``deploy/README.md`` says what an operator sees and does for each alert.

promtool comes from Debian's ``prometheus`` package (``tools/ops/install.sh``). Under CI
(``CI`` set) a missing promtool fails the tests; elsewhere they are skipped with that hint.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from tests.deploy.k8s import DEPLOY, tool

RULES = DEPLOY / "base" / "prometheusrule.yaml"
RULE_TESTS = DEPLOY / "rules-tests.yaml"
README = DEPLOY / "README.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool("promtool")


def rule_spec() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(RULES.read_text())["spec"]
    return spec


def alerts() -> list[str]:
    return [r["alert"] for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r]


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's spec as a plain rules file, beside a copy of the unit tests."""
    out = tmp_path_factory.mktemp("rules")
    (out / "kvgate-rules.yaml").write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    shutil.copy(RULE_TESTS, out / "rules-tests.yaml")
    return out


def run(promtool: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_rules(promtool: str, rules_dir: Path) -> None:
    out = run(promtool, rules_dir, "check", "rules", "kvgate-rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_spec()['groups'])} rules found" in out.stdout


def test_promtool_unit_tests(promtool: str, rules_dir: Path) -> None:
    out = run(promtool, rules_dir, "test", "rules", "rules-tests.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_unit_tests_have_teeth(promtool: str, rules_dir: Path, tmp_path: Path) -> None:
    """The same tests fail against a broken rule (the hot-spot queue threshold raised)."""
    text = (rules_dir / "kvgate-rules.yaml").read_text()
    assert "(sglang:num_queue_reqs) > 4" in text
    (tmp_path / "kvgate-rules.yaml").write_text(text.replace("(sglang:num_queue_reqs) > 4",
                                                             "(sglang:num_queue_reqs) > 40"))
    shutil.copy(RULE_TESTS, tmp_path / "rules-tests.yaml")
    out = run(promtool, tmp_path, "test", "rules", "rules-tests.yaml")
    assert out.returncode != 0 and "KvgateReplicaHotSpot" in out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    for alert in alerts():
        assert cases.get(alert) == {True, False}, f"{alert}: tests firing/not firing = {cases.get(alert)}"


def test_every_alert_has_a_runbook() -> None:
    readme = README.read_text()
    for alert in alerts():
        heading = f"#### {alert}"
        assert heading in readme, f"deploy/README.md has no section {heading!r}"
        section = readme.split(heading, 1)[1].split("####", 1)[0]
        assert "Sees:" in section and "Does:" in section, alert
