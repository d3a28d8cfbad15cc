"""The command line's own flags (no process): ``--version`` and the bare command."""
from __future__ import annotations

import pytest

from gateway.cli import installed_version, main
from gateway.errors import NoReplicaAvailable, UpstreamError
from gateway.relay import error_response


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
