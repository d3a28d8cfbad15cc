"""The command line's own flags (no process): ``--version`` and the bare command."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from gateway import cli
from gateway.cli import BENCH_EXTRA, installed_version, main
from gateway.errors import NoReplicaAvailable, UpstreamError
from gateway.relay import error_response

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvgate {installed_version()}"
    assert installed_version() != "unknown"  # the tests run on an installed kvgate


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_gateway_503_carries_retry_after_other_errors_do_not() -> None:
    busy = error_response(NoReplicaAvailable("no replica"), api="messages")
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.headers["x-kvgate-replica"] == "none"
    assert "retry-after" not in error_response(UpstreamError("bad gateway")).headers


def test_serving_install_has_no_harness_packages() -> None:
    """``pip install kvgate`` brings what the gateway needs; the harness's rich, matplotlib and
    uvicorn (the simulated replica's server) come with the ``bench`` extra (the README's main
    command installs it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert not names & BENCH_EXTRA
    bench = {re.split(r"[<>=\[]", dep, maxsplit=1)[0] for dep in project["optional-dependencies"]["bench"]}
    assert bench == BENCH_EXTRA - {"loadtest"}  # the harness package itself is absent from the gateway image
    assert "pip install -e '.[bench]' && kvgate demo" in (ROOT / "README.md").read_text()


def test_harness_command_without_the_extra_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing(name: str) -> object:
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert main(["demo"]) == 2
    assert "pip install 'kvgate[bench]'" in capsys.readouterr().err


def test_the_simulator_in_the_gateway_image_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing(name: str) -> object:  # the gateway image ships no loadtest package
        raise ModuleNotFoundError("No module named 'loadtest'", name="loadtest")

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert main(["sim"]) == 2
    assert "pip install 'kvgate[bench]'" in capsys.readouterr().err
