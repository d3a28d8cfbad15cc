"""sglang-router 0.3.2 registers a simulated replica and relays a stream through it.

Needs ``bash loadtest/peers/install.sh`` (its own virtualenv, from PyPI): marked
``peers``, so ``-m "not peers"`` leaves it out; when selected without the peers
installed it fails with the command to run, never passes silently.
"""
from __future__ import annotations

import pytest

from loadtest.peers.check_sglang_router import ROOT, check

pytestmark = pytest.mark.peers


def test_sglang_router_streams_from_simulated_replica() -> None:
    python = ROOT / ".venv-peers" / "sglang-router" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} missing: run `bash loadtest/peers/install.sh` first "
                    "(or deselect with -m 'not peers')")
    detail = check(ROOT, timeout_s=60.0)
    assert "tokens" in detail
